"""geotrain's layering as rules over the source tree, checked with plain ``ast`` (no new dependency).

A *part* is a folder under ``geotrain/`` (``comm``, ``sync``, ...) or a top-level module
(``cli``, ``errors``, ``api``); the package's own ``__init__`` is the part ``geotrain``. Every
import counts, lazy ones (inside functions, under ``TYPE_CHECKING``) and
``importlib.import_module("...")`` included, and ``from geotrain.p import m`` counts as an import
of the package ``p`` (its ``__init__``, which Python runs first) as well as of ``p.m``. The rules:

1. no import circle between modules, and none between parts;
2. a part imports only the parts :data:`ALLOWED` lists for it (imports point one way);
3. ``models/`` imports no ``torch.distributed``, directly or through geotrain modules it imports;
4. ``codecs/`` imports neither ``comm/`` nor ``torch.distributed``, likewise;
5. ``config/``, ``plan/`` and ``netsim/`` import no torch, likewise;
6. no module imports ``cli`` (``__main__``, whose one job is to run it, aside);
7. only ``comm/groups.py`` creates process groups or device meshes;
8. no module is longer than :data:`MAX_LINES` lines.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MAX_LINES = 500
GROUP_MAKERS = {"init_process_group", "new_group", "new_subgroups", "init_device_mesh", "ProcessGroupGloo", "ProcessGroupNCCL"}
GROUPS_MODULE = "comm.groups"
ROOT = "geotrain"  # the part of the package's own __init__

_BELOW_RUN = {"comm", "codecs", "config", "data", "elastic", "errors", "models", "privacy", "report", "round", "sync"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "config": {"errors"},
    "netsim": {"config", "errors"},
    "plan": {"config", "errors", "netsim"},
    "codecs": {"errors"},
    "models": {"config", "errors"},
    "data": {"config", "errors"},
    "comm": {"codecs", "config", "errors"},
    "sync": {"codecs", "comm", "config", "errors", "plan"},  # plan: the one closed form adaptation steers by
    "round": {"codecs", "comm", "config", "errors", "plan", "sync"},  # the round engine and its parts, over sync's hooks
    "privacy": {"comm", "config", "errors"},
    "elastic": {"comm", "config", "errors"},
    "report": {"comm", "config", "errors"},
    "run": _BELOW_RUN,
    "launch": {"comm", "config", "data", "elastic", "errors", "models", "report", "run"},  # report: preflight checks the tracker
    "bench": _BELOW_RUN | {"launch", "plan", "run"},  # plan: bench place runs what geotrain place predicts
    "api": {"comm", "config", "errors", "round", "sync"},
    "cli": _BELOW_RUN | {"api", "bench", "launch", "netsim", "plan", "run"},
    "__main__": {"cli"},
    ROOT: {"api", "config", "errors"},
}


@dataclass(frozen=True)
class Import:
    source: str  # importing module, relative to the package: 'comm.groups', '' for the package's __init__
    target: str  # imported name in full: 'torch.distributed', 'geotrain.sync.base'
    line: int
    lazy: bool


def _modules(root: Path) -> dict[str, Path]:
    """Module name relative to the package ('' = its __init__) -> file."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def part_of(module: str) -> str:
    return module.split(".")[0] if module else ROOT


def _imports(tree: ast.AST, source: str, is_package: bool, package: str, known: set[str], packages: set[str]) -> Iterator[Import]:
    """Every import in ``tree`` (``source``'s module), resolved to full names; ``from p import m``
    of a sub-package ``p`` of ``package`` also yields ``p`` itself (the package's own root aside:
    Python has run it before any module of it)."""

    def walk(node: ast.AST, lazy: bool) -> Iterator[tuple[ast.AST, bool]]:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                inner = True
            yield child, inner
            yield from walk(child, inner)

    here = f"{package}.{source}" if source else package
    base = here if is_package else here.rpartition(".")[0]
    for node, lazy in walk(tree, False):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(source, alias.name, node.lineno, lazy)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                anchor = base
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                mod = f"{anchor}.{mod}" if mod else anchor
            pkg = mod.removeprefix(f"{package}.")
            if mod.startswith(f"{package}.") and pkg in packages and pkg != source:
                yield Import(source, mod, node.lineno, lazy)  # the package's __init__ runs first
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                internal = sub.removeprefix(f"{package}.")
                yield Import(source, sub if sub.startswith(f"{package}.") and internal in known else mod, node.lineno, lazy)
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ("importlib.import_module", "import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    yield Import(source, arg.value, node.lineno, True)


def _group_calls(tree: ast.AST) -> Iterator[tuple[str, int]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in GROUP_MAKERS:
                yield name, node.lineno


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle in ``graph`` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def check(root: Path, package: str = "geotrain") -> list[str]:
    """Every violation of the rules above in the package at ``root``, one line each."""
    files = _modules(root)
    known = set(files)
    trees = {m: ast.parse(f.read_text(), filename=str(f)) for m, f in files.items()}
    packages = {m for m, f in files.items() if f.name == "__init__.py"}
    imports = [
        imp for m, tree in trees.items() for imp in _imports(tree, m, files[m].name == "__init__.py", package, known, packages)
    ]
    internal = {}  # module -> internal modules it imports
    for imp in imports:
        if imp.target == package or imp.target.startswith(f"{package}."):
            internal.setdefault(imp.source, set()).add(imp.target.removeprefix(package).lstrip("."))
    bad: list[str] = []

    def where(m: str) -> str:
        return str(files[m].relative_to(root.parent))

    # 1. circles
    if cyc := _cycle(internal):
        bad.append(f"import circle between modules: {' -> '.join(c or package for c in cyc)}")
    parts: dict[str, set[str]] = {}
    for m, targets in internal.items():
        for t in targets:
            if part_of(t) != part_of(m):
                parts.setdefault(part_of(m), set()).add(part_of(t))
    if cyc := _cycle(parts):
        bad.append(f"import circle between parts: {' -> '.join(cyc)}")
    # 2. direction
    for p, deps in sorted(parts.items()):
        allowed = ALLOWED.get(p)
        if allowed is None:
            bad.append(f"part {p!r} is not in the layering (tests/layering.py ALLOWED)")
            continue
        for d in sorted(deps - allowed):
            m = next(m for m, ts in sorted(internal.items()) if part_of(m) == p and any(part_of(t) == d for t in ts))
            bad.append(f"{where(m)}: part {p!r} imports part {d!r} (allowed: {', '.join(sorted(allowed)) or 'none'})")

    # 3-5. what a part may reach, through the geotrain modules it imports
    def reach(m: str) -> set[str]:
        seen, todo = {m}, [m]
        while todo:
            for t in internal.get(todo.pop(), ()):
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return seen

    def external(m: str, prefix: str) -> Import | None:
        return next((i for i in imports if i.source == m and (i.target == prefix or i.target.startswith(prefix + "."))), None)

    rules = [
        ("models", "torch.distributed"),
        ("codecs", "torch.distributed"),
        ("config", "torch"),
        ("plan", "torch"),
        ("netsim", "torch"),
    ]
    for part, forbidden in rules:
        for m in sorted(x for x in files if part_of(x) == part):
            for r in sorted(reach(m)):
                if imp := external(r, forbidden):
                    via = "" if r == m else f" (through {package}.{r})"
                    bad.append(f"{where(m)}: {part}/ must not import {forbidden}{via}: {where(r)}:{imp.line}")
                    break
    for m in sorted(x for x in files if part_of(x) == "codecs"):
        if hit := sorted(t for t in reach(m) if part_of(t) == "comm"):
            bad.append(f"{where(m)}: codecs/ must not import comm/ ({package}.{hit[0]})")
    # 6. nobody imports the CLI
    for m, targets in sorted(internal.items()):
        if m != "__main__" and part_of(m) != "cli" and any(part_of(t) == "cli" for t in targets):
            bad.append(f"{where(m)}: imports the CLI (only __main__ may)")
    # 7. one module creates process groups
    for m, tree in sorted(trees.items()):
        if m != GROUPS_MODULE:
            for name, line in _group_calls(tree):
                bad.append(f"{where(m)}:{line}: calls {name}; only {package}/{GROUPS_MODULE.replace('.', '/')}.py creates groups")
    # 8. short modules
    for m, f in sorted(files.items()):
        n = len(f.read_text().splitlines())
        if n > MAX_LINES:
            bad.append(f"{where(m)}: {n} lines (at most {MAX_LINES})")
    return bad
