"""What the README and the docs name exists: every ``geotrain.x.y`` import path resolves, every
file path is there, docs/DESIGN.md's file tree lists every source file (one line per file), and
the README and DESIGN.md stay short (at most 250 and 400 lines)."""

from __future__ import annotations

import importlib
import re
import subprocess

from tests.helpers import REPO

DOCS = [REPO / "README.md", REPO / "DEVELOPERS.md", *sorted((REPO / "docs").glob("*.md"))]
DOTTED = re.compile(r"(?<![\w/.-])geotrain(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w/.-])((?:geotrain|tests|benchmarks|examples|configs|scenarios|docs)/[\w./*-]*[\w/*])")
SOURCE_DIRS = ("geotrain", "tests", "benchmarks", "examples")


def _resolves(dotted: str) -> bool:
    """``dotted`` is a module, or a module followed by attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_import_paths_in_docs_resolve() -> None:
    bad = []
    for doc in DOCS:
        for name in sorted(set(DOTTED.findall(doc.read_text()))):
            if not _resolves(name.rstrip(".")):
                bad.append(f"{doc.name}: {name}")
    assert bad == []


def test_file_paths_in_docs_exist() -> None:
    bad = []
    for doc in DOCS:
        for path in sorted(set(PATH.findall(doc.read_text()))):
            if not ((REPO / path).exists() if "*" not in path else any(REPO.glob(path))):
                bad.append(f"{doc.name}: {path}")
    assert bad == []


def test_design_tree_lists_every_source_file() -> None:
    tracked = subprocess.run(["git", "ls-files", *SOURCE_DIRS], cwd=REPO, capture_output=True, text=True, check=True).stdout
    untracked = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard", *SOURCE_DIRS], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    files = sorted({f for f in (tracked + untracked).splitlines() if f.endswith(".py") and (REPO / f).exists()})
    assert files, "no source files found"
    tree = (REPO / "docs" / "DESIGN.md").read_text()
    tree = tree[tree.index("## Files") :]
    listed = {line.split()[0] for line in tree.splitlines() if line.strip() and not line.startswith(("#", "`"))}
    missing = [f for f in files if f not in listed and f != "tests/__init__.py"]
    assert missing == [], "docs/DESIGN.md ## Files misses: " + ", ".join(missing)
    stale = sorted(f for f in listed if f.endswith(".py") and f not in files)
    assert stale == [], "docs/DESIGN.md ## Files lists files that are gone: " + ", ".join(stale)


def test_the_readme_and_the_design_stay_short() -> None:
    """A newcomer reads the README (what geotrain is, a round, what combines, the quickstart, the
    modes) and DESIGN.md (the decisions and the tree); history is in git."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 250
    assert len((REPO / "docs" / "DESIGN.md").read_text().splitlines()) <= 400


def _lines(*paths: str) -> int:
    return sum(len((REPO / p).read_text().splitlines()) for p in paths)


def test_the_sizes_design_states_are_true() -> None:
    """DESIGN.md's figures for the size of the code hold within 10% (they were once 12,500 lines
    for 21,500, and a 300-line round protocol of 970)."""
    design = (REPO / "docs" / "DESIGN.md").read_text()

    def stated(pattern: str) -> int:
        m = re.search(pattern, design)
        assert m, pattern
        return int(m.group(1).replace(",", ""))

    every = [str(p.relative_to(REPO)) for p in (REPO / "geotrain").rglob("*.py")]
    protocol = [f"geotrain/elastic/{m}.py" for m in ("member", "meeting", "hints", "exchange", "roundstore", "auth")]
    for pattern, actual in (
        (r"geotrain is about ([\d,]+) lines of Python", _lines(*every)),
        (r"a round protocol of about ([\d,]+) lines", _lines(*protocol)),
        (r"The zygote is about ([\d,]+) lines", _lines("geotrain/launch/zygote.py")),
    ):
        claim = stated(pattern)
        assert abs(actual - claim) <= 0.1 * actual, f"DESIGN.md says {claim} ({pattern!r}); the code has {actual}"


def test_design_names_every_module_of_sync_in_its_table() -> None:
    """§0's row for sync/ names each of its modules (it once left out five)."""
    row = next(line for line in (REPO / "docs" / "DESIGN.md").read_text().splitlines() if line.startswith("| `sync/` |"))
    names = {"ddp": "DDP", "diloco": "DiLoCo", "streaming": "Streaming DiLoCo", "reducer": "reducer", "guard": "guard"}
    for module in sorted(
        p.stem for p in (REPO / "geotrain" / "sync").glob("*.py") if p.stem not in ("__init__", "base", "outer")
    ):
        assert names.get(module, f"`{module}`") in row, f"DESIGN.md §0's sync/ row does not name {module}"


def test_every_test_the_threat_model_names_exists() -> None:
    """docs/SECURITY.md holds each claim by a named test: every one it names is defined."""
    import re as _re

    text = (REPO / "docs" / "SECURITY.md").read_text()
    named = set(_re.findall(r"`(test_\w+)`", text))
    defined = set()
    for f in (REPO / "tests").glob("test_*.py"):
        defined |= set(_re.findall(r"^def (test_\w+)", f.read_text(), _re.M))
    assert len(named) >= 15 and named <= defined, sorted(named - defined)
