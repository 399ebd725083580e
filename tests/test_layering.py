"""The import layering, checked on the source itself.

serving/ uses models/, actors/ and transports/; actors/ uses transports/.
actors/ and transports/ are a general runtime: they import no LLM layer.
models/ is synchronous: it imports no trio. Inside serving/ the import
graph has no cycle, and the HTTP layer imports nothing that starts processes.
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


# -- inside serving/: an import graph without cycles; HTTP starts nothing ----------------

PACKAGES = ("actors", "transports", "models", "serving")
STARTS_PROCESSES = {"actors.process", "serving.runtime.launch", "serving.runtime.workers",
                    "serving.runtime.engine", "serving.cli"}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def imported_modules(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports anywhere in its source (function bodies
    included), with the packages Python runs on the way: ``from .a import b`` names
    ``pkg.a``, and ``pkg.a.b`` too when that is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {m for m in found & known if m != name}


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported_modules(name, path, set(modules)) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_in_serving():
    graph = import_graph()
    serving = {m: {n for n in deps if n.startswith("serving")} for m, deps in graph.items()
               if m.startswith("serving")}
    assert find_cycle(serving) is None, " -> ".join(find_cycle(serving))


def test_the_cycle_finder_sees_a_cycle_hidden_in_a_function(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    known = {"pkg", "pkg.a", "pkg.b"}
    graph = {
        "pkg.a": imported_modules("pkg.a", pkg / "a.py", known),
        "pkg.b": imported_modules("pkg.b", pkg / "b.py", known),
    }
    assert graph == {"pkg.a": {"pkg", "pkg.b"}, "pkg.b": {"pkg", "pkg.a"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


def test_http_imports_nothing_that_starts_processes():
    graph = import_graph()
    reached, todo = set(), [m for m in graph if m.startswith("serving.http")]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(graph[module])
    assert not reached & STARTS_PROCESSES, sorted(reached & STARTS_PROCESSES)
    spawners = {m for m in reached if {"subprocess", "multiprocessing"} & imported_top_levels(project_modules()[m])}
    assert not spawners, sorted(spawners)


def test_the_topology_is_a_schema_only():
    """serving/runtime/topology.py reads and checks a YAML file: it imports neither torch nor the managers
    (directly or through what it imports), so a config is checked without loading either."""
    graph = import_graph()
    reached, todo = set(), ["serving.runtime.topology"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(graph[module])
    managers = sorted(m for m in reached if m.startswith("serving.managers") or m.startswith("models"))
    assert not managers, managers
    heavy = {m for m in reached if {"torch", "transformers"} & imported_top_levels(project_modules()[m])}
    assert not heavy, sorted(heavy)


def replica_switches(source: str) -> list[str]:
    """Where ``source`` switches on whether replicas exist: ``… .replicated``, ``replicas is None``
    (or ``is not None``), ``isinstance(…, ReplicaStatus / ReplicaSet / ReplicaPool)``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "replicated":
            found.append(f"line {node.lineno}: .replicated")
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.Is | ast.IsNot) for op in node.ops):
            names = [n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", "") for n in (node.left,
                                                                                               *node.comparators)]
            if "replicas" in names:
                found.append(f"line {node.lineno}: replicas is (not) None")
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance"
              and any(getattr(a, "id", "") in ("ReplicaStatus", "ReplicaSet", "ReplicaPool") for a in ast.walk(node))):
            found.append(f"line {node.lineno}: isinstance of a replica class")
    return found


def test_no_runtime_module_switches_on_whether_replicas_exist():
    """A server without replicas is a pool of one (issue 30): the runtime has one mode. (The topology,
    a schema, may say whether it has replicas; HTTP words its health answer by it.)"""
    offenders = [f"{path.relative_to(ROOT)} {where}"
                 for path in sorted((ROOT / "serving" / "runtime").glob("*.py")) if path.name != "topology.py"
                 for where in replica_switches(path.read_text())]
    assert not offenders, offenders


def test_the_switch_finder_sees_each_kind_of_switch():
    source = ("if topology.replicated: pass\nif self.replicas is None: pass\n"
              "if isinstance(self.status, ReplicaStatus): pass\nif len(self.replicas) == 1: pass\n")
    assert [w.split(":")[0] for w in replica_switches(source)] == ["line 1", "line 2", "line 3"]
