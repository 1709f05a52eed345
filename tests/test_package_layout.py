"""The shape of the package: no import circle (lazy imports inside functions count too), imports point
the documented way (the model never imports parallel or train; config imports nothing of the package),
and every file fits in a head (<= 450 lines)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "moe_lc"
MAX_LINES = 450


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """moe_lc module -> the moe_lc modules it imports anywhere in its file (package imports resolve to
    the package's __init__)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_circle_in_the_package():
    # a package's __init__ re-exporting its modules is not a circle of ideas: drop edges module -> own package
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in import_graph().items()}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_imports_point_the_documented_way():
    graph = import_graph()
    for module, deps in graph.items():
        if module.startswith("moe_lc.config"):
            assert all(d.startswith("moe_lc.config") for d in deps), (module, deps)
        if module.startswith("moe_lc.model"):
            assert not any(d.startswith(("moe_lc.parallel", "moe_lc.train", "moe_lc.data")) for d in deps), (module, deps)
        if module.startswith("moe_lc.ops"):
            allowed = ("moe_lc.ops", "moe_lc.config", "moe_lc.parallel.comm", "moe_lc.parallel.mesh")
            assert all(d.startswith(allowed) for d in deps), (module, deps)


def test_the_model_modules_import_no_recomputation():
    """Recomputation plugs into the model's seams from outside (moe_lc/model/seams.py)."""
    graph = import_graph()
    users = [m for m, deps in graph.items() if "moe_lc.model.recompute" in deps and m.startswith("moe_lc.model")]
    assert users == [], users


def test_files_fit_in_a_head():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


REPO = PACKAGE.parent
SIDE_PACKAGES = {"tools": "moe_lc_tools", "eval": "moe_lc_eval"}  # checkout name -> installed name


def test_pyproject_installs_every_package_directory():
    """pyproject.toml lists packages by hand (tools/ and eval/ install under prefixed names): a new
    package directory missing from the list would be left out of `pip install .`."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for top in ("moe_lc", *SIDE_PACKAGES):
        for init in (REPO / top).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO).parts
            found.add(".".join((SIDE_PACKAGES.get(parts[0], parts[0]), *parts[1:])))
    assert listed == found, (sorted(listed - found), sorted(found - listed))


def test_tools_and_eval_import_themselves_relatively():
    """Absolute `tools.` / `eval.` imports would break under the installed names; and the package
    never imports tools/ or eval/ (they sit above it)."""
    for top in SIDE_PACKAGES:
        for path in (REPO / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
                bad = [n for n in names if n.split(".")[0] in SIDE_PACKAGES]
                assert not bad, f"{path.relative_to(REPO)}: import {bad[0]} (use a relative import)"
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.split(".")[0] in (*SIDE_PACKAGES, *SIDE_PACKAGES.values()) for n in names), path
