"""The import layering of DESIGN.md, checked on the source itself.

actors/ and transports/ are a general runtime: they import no LLM layer.
models/ is synchronous: it imports no trio.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

FORBIDDEN = {
    "actors": {"torch", "transformers", "triton", "models", "serving"},
    "transports": {"torch", "transformers", "triton", "models", "serving", "actors"},
    "models": {"trio", "serving", "actors", "transports"},
}


def imported_top_levels(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_respects_layering(package):
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = imported_top_levels(path) & FORBIDDEN[package]
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not offenders, "\n".join(offenders)


def test_checker_sees_forbidden_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import torch.nn\nfrom serving.app import x\nfrom . import sibling\n")
    assert imported_top_levels(probe) == {"torch", "serving"}


def test_no_pickle_on_any_wire():
    offenders = []
    for package in ("actors", "transports", "serving"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if {"pickle", "cloudpickle"} & imported_top_levels(path):
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders
