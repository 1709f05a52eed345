"""The shape of the code: no import circle anywhere in moe_lc/, tools/ or eval/ (lazy imports inside
functions and relative imports count too), imports point the documented way (the model never imports
parallel or the job; config imports nothing of the package; nothing below the job imports it), the
folders show the architecture (few loose modules at the top of moe_lc/ and moe_lc/parallel/), every file
fits in a head (<= 450 lines), and every repository path the code and the docs name exists."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "moe_lc"
REPO = PACKAGE.parent
ROOTS = ("moe_lc", "tools", "eval")
MAX_LINES = 450


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module an ImportFrom names (relative ones resolved against `module`)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(roots=ROOTS) -> dict[str, set[str]]:
    """Module -> the modules of `roots` it imports anywhere in its file (package imports resolve to the
    package's __init__; relative imports resolved)."""
    paths = [p for root in roots for p in (REPO / root).rglob("*.py")]
    modules = {module_name(p): p for p in paths}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, name, path.name == "__init__.py")
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
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


def test_no_import_circle_anywhere():
    # a package's __init__ re-exporting its modules is not a circle of ideas: drop edges module -> own package
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in import_graph().items()}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_circle_check_sees_relative_imports():
    tree = ast.parse("from .lm_eval_model import MoeLcLM\nfrom ..planner.plan import plan\nfrom . import tasks\n")
    a, b, c = (n for n in tree.body)
    assert _absolute(a, "eval.lm_eval", False) == "eval.lm_eval_model"
    assert _absolute(b, "tools.dry_run.rank_trace", False) == "tools.planner.plan"
    assert _absolute(c, "eval", True) == "eval"
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_the_folders_show_the_architecture():
    """moe_lc/'s top holds the train entry, the package init and leaf utilities (the job's modules live in
    moe_lc/job/); moe_lc/parallel/'s top the mesh, the counted collectives and the plan, with each
    technique in a folder of its own (tp, cp, ep, zero, memory, pipeline)."""
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(loose) <= 4, loose
    parallel = sorted(p.name for p in (PACKAGE / "parallel").glob("*.py"))
    assert len(parallel) <= 14, parallel
    assert {"tp", "cp", "ep", "zero", "memory", "pipeline"} <= {p.name for p in (PACKAGE / "parallel").iterdir()
                                                               if p.is_dir() and p.name != "__pycache__"}


def test_imports_point_the_documented_way():
    graph = import_graph()
    for module, deps in graph.items():
        if module.startswith("moe_lc.config"):
            assert all(d.startswith("moe_lc.config") for d in deps), (module, deps)
        if module.startswith("moe_lc.model"):
            assert not any(d.startswith(("moe_lc.parallel", "moe_lc.train", "moe_lc.data")) for d in deps), (module, deps)
        if module.startswith(("moe_lc.config", "moe_lc.model", "moe_lc.ops", "moe_lc.parallel", "moe_lc.data",
                              "moe_lc.optim")):
            assert not any(d.startswith(("moe_lc.job", "moe_lc.train")) for d in deps), (module, deps)
        if module.startswith("moe_lc.ops"):
            allowed = ("moe_lc.ops", "moe_lc.config", "moe_lc.parallel.comm", "moe_lc.parallel.mesh", "moe_lc.kernels")
            assert all(d.startswith(allowed) for d in deps), (module, deps)
        if module.startswith("moe_lc.kernels"):  # Triton kernels are leaves (torch and triton only)
            assert all(d.startswith("moe_lc.kernels") for d in deps), (module, deps)


def test_the_model_modules_import_no_recomputation():
    """Recomputation plugs into the model's seams from outside (moe_lc/model/seams.py)."""
    graph = import_graph()
    users = [m for m, deps in graph.items() if "moe_lc.model.recompute" in deps and m.startswith("moe_lc.model")]
    assert users == [], users


def test_files_fit_in_a_head():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


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


PATH_NAMED = re.compile(r"(?<![\w/.-])((?:moe_lc|tools|eval|tests|recipes|docs|\.ci)/[\w./-]*[\w/])")
# what past runs printed (their paths are of that day), and tests (which plant made-up paths for the scanners)
SKIPPED = ("docs/results/", "tools/bench/results/", "tests/")


def named_paths(text: str) -> list[str]:
    """Repository paths in a text: moe_lc/..., tools/..., docs/..., with a file extension or a trailing /
    (a dotted module path such as moe_lc.parallel.comm is not one; globs and placeholders stop the match)."""
    out = []
    for m in PATH_NAMED.finditer(text):
        path = m.group(1).rstrip(".")
        end = text[m.end():m.end() + 1]
        if end in "*<{":
            continue  # a glob or a placeholder: tests/golden/<case>.json
        if path.endswith("/") or re.search(r"\.(py|md|toml|json|sh|sbatch|txt|png|csv|yaml)$", path):
            out.append(path)
    return out


def test_the_path_scan_finds_paths_and_skips_placeholders():
    text = ("see moe_lc/parallel/comm.py and tools/plan.py, (docs/guide/) not moe_lc.parallel.comm; "
            "tests/golden/<case>.json, recipes/*.toml, runs/x.py, moe_lc/nope.py.")
    assert named_paths(text) == ["moe_lc/parallel/comm.py", "tools/plan.py", "docs/guide/", "moe_lc/nope.py"]


def test_every_repo_path_named_in_code_and_docs_exists():
    """A rename that leaves a docstring, a recipe's comment or a README line pointing nowhere is caught here
    (docs/results/ and tools/bench/results/ are records of past runs, left as they were printed)."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    missing = []
    for name in files:
        if name.startswith(SKIPPED) or not name.endswith((".py", ".md", ".toml", ".sh", ".sbatch")) \
                or not (REPO / name).is_file():
            continue
        for path in named_paths((REPO / name).read_text(errors="replace")):
            if not (REPO / path).exists():
                missing.append(f"{name}: {path}")
    assert not missing, "\n".join(sorted(set(missing)))
