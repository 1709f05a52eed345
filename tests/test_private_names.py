"""No module reaches into another module's private names: a leading underscore means "this file only".

An AST scan of every .py under moe_lc/, tools/ and eval/ fails on
  - `from x import _y` (or `from . import _y`): importing another module's private name, and
  - `m._y` where `m` is bound to one of the project's modules (`import moe_lc.ops.fp8 as m`,
    `from moe_lc.ops import fp8`, or the dotted `moe_lc.ops.fp8._y`).
Dunders (`__version__`, `__file__`) are public. Third-party privates (`torch._scaled_mm`) are not this
test's business: torch has no public name to offer instead. Private attributes of objects
(`group._count_ring`) are out of scope too: the scan only knows which names are modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("moe_lc", "tools", "eval")


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def is_project_module(dotted: str, root: Path = ROOT) -> bool:
    """`dotted` names a module or package of the checkout (moe_lc.ops.fp8, tools.bench, eval)."""
    parts = dotted.split(".")
    if parts[0] not in SCANNED:
        return False
    path = root.joinpath(*parts)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def module_of(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def absolute(node: ast.ImportFrom, path: Path, root: Path = ROOT) -> str:
    """The module a (possibly relative) `from ... import` reads from, as a dotted name."""
    if not node.level:
        return node.module or ""
    package = module_of(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def dotted_name(node: ast.expr) -> str | None:
    """`a.b.c` as "a.b.c"; None for anything that is not a chain of names."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def violations(path: Path, root: Path = ROOT) -> list[str]:
    """'file:line: what' for every private name of another module this file uses."""
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(root)
    found = []
    modules: dict[str, str] = {}  # local name -> the project module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    modules[alias.asname] = alias.name
                else:  # `import a.b.c` binds `a`; `a.b.c._y` is resolved through the dotted chain below
                    modules[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source = absolute(node, path, root)
            for alias in node.names:
                if is_private(alias.name):
                    found.append(f"{where}:{node.lineno}: imports {alias.name} from {source or '.'}")
                elif is_project_module(f"{source}.{alias.name}", root):
                    modules[alias.asname or alias.name] = f"{source}.{alias.name}"
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and is_private(node.attr)):
            continue
        chain = dotted_name(node.value)
        if chain is None or chain.split(".")[0] not in modules:
            continue
        head, _, rest = chain.partition(".")
        module = ".".join(filter(None, [modules[head], rest]))
        if is_project_module(module, root):
            found.append(f"{where}:{node.lineno}: reads {node.attr} of module {module}")
    return found


def scanned_files(root: Path = ROOT) -> list[Path]:
    return sorted(p for top in SCANNED for p in (root / top).rglob("*.py"))


def test_no_module_uses_another_modules_private_names():
    found = [v for path in scanned_files() for v in violations(path)]
    assert not found, "private names used across modules (make them public, or keep them inside):\n" + "\n".join(found)


def test_the_scan_catches_each_form(tmp_path):
    """A planted package: every form the scan must catch, and the ones it must let through."""
    pkg = tmp_path / "moe_lc"
    (pkg / "ops").mkdir(parents=True)
    for name in ("__init__.py", "ops/__init__.py"):
        (pkg / name).write_text("")
    (pkg / "ops" / "fp8.py").write_text("_GRANULARITY = {}\n__all__ = []\nBLOCK = 128\n")
    (pkg / "user.py").write_text(
        "import torch\n"
        "import moe_lc.ops.fp8\n"
        "import moe_lc.ops.fp8 as f\n"
        "from moe_lc.ops import fp8\n"
        "from moe_lc.ops.fp8 import _GRANULARITY, BLOCK\n"
        "from .ops.fp8 import _GRANULARITY as g\n"
        "x = fp8._GRANULARITY, f._GRANULARITY, moe_lc.ops.fp8._GRANULARITY\n"
        "ok = fp8.BLOCK, fp8.__all__, torch._scaled_mm, self_like._private\n")
    found = violations(pkg / "user.py", tmp_path)
    assert found == ["moe_lc/user.py:5: imports _GRANULARITY from moe_lc.ops.fp8",
                     "moe_lc/user.py:6: imports _GRANULARITY from moe_lc.ops.fp8",
                     "moe_lc/user.py:7: reads _GRANULARITY of module moe_lc.ops.fp8",
                     "moe_lc/user.py:7: reads _GRANULARITY of module moe_lc.ops.fp8",
                     "moe_lc/user.py:7: reads _GRANULARITY of module moe_lc.ops.fp8"], found
