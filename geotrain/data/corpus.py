"""Text to train on, as bytes (vocabulary 256), cut into blocks with a held-out split.

Default corpus: text every CPython install ships — the pydoc topic texts (``pydoc_data``) and
the standard library's own ``.py`` sources — so the first run downloads nothing. Any text file,
or a directory of text files, can be named instead (``data.corpus``).

The byte stream is cut into 4 KiB blocks; every ``round(1/eval_fraction)``-th block is held out
for evaluation.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from geotrain.config import DataConfig

BLOCK_BYTES = 4096
DEFAULT_CORPUS_BYTES = 3_000_000


def hidden_below(f: Path, root: Path) -> bool:
    """Whether a part of ``f``'s path below ``root`` is hidden (``.git`` objects, a ``.venv``, dotfiles)."""
    return any(part.startswith(".") for part in f.relative_to(root).parts)


def as_text(raw: bytes) -> tuple[str | None, str]:
    """(the text, '') if ``raw`` is text — not blank, no NUL byte, valid UTF-8 — else (None, why).

    Text is decided by content, not by a list of suffixes: a ``.c``, a ``.tex`` or a ``LICENSE``
    without a suffix is text, an image or an archive is not."""
    if not raw.strip():
        return None, "empty"
    if b"\0" in raw:
        return None, "binary (a NUL byte)"
    try:
        return raw.decode("utf-8"), ""
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 text (byte {exc.start})"


def _default_corpus() -> bytes:
    parts: list[bytes] = []
    try:
        from pydoc_data.topics import topics

        parts.extend(topics[k].encode("utf-8") for k in sorted(topics))
    except ImportError:  # some distributions strip pydoc_data; the sources are always there
        pass
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = sum(len(p) for p in parts)
    for path in sorted(stdlib.glob("*.py")):
        if total >= DEFAULT_CORPUS_BYTES:
            break
        data = path.read_bytes()
        parts.append(data)
        total += len(data)
    return b"\n\n".join(parts)


def read_corpus(path: str) -> bytes:
    p = Path(path)
    if p.is_file():
        return p.read_bytes()
    texts = []  # every file not hidden below the directory whose content is text (as_text)
    for f in sorted(x for x in p.rglob("*") if x.is_file() and not hidden_below(x, p)):
        raw = f.read_bytes()
        if as_text(raw)[0] is not None:
            texts.append(raw)
    if not texts:
        raise ValueError(f"data.corpus: no text files under {path}")
    return b"\n\n".join(texts)


def load_corpus(cfg: DataConfig) -> bytes:
    return _default_corpus() if cfg.corpus is None else read_corpus(cfg.corpus)


@dataclass
class Splits:
    train_blocks: list[torch.Tensor]
    eval_tokens: torch.Tensor


def split_corpus(raw: bytes, eval_fraction: float) -> Splits:
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    blocks = list(tokens.split(BLOCK_BYTES))
    every = max(2, round(1 / eval_fraction))
    eval_blocks = [b for i, b in enumerate(blocks) if i % every == every - 1]
    train_blocks = [b for i, b in enumerate(blocks) if i % every != every - 1]
    if not eval_blocks:
        eval_blocks = [train_blocks.pop()]
    return Splits(train_blocks=train_blocks, eval_tokens=torch.cat(eval_blocks))
