"""``geotrain data prepare``: text inputs to token shards on disk, with a manifest.

Inputs are text files, directories of them, JSONL (one JSON object per line, its text in a field)
and Parquet (a text column). Documents are tokenized with the Hugging Face ``tokenizers`` library:
a byte-level BPE trained on the inputs, or a local ``tokenizer.json`` / tokenizer directory; never
downloaded. ``bytes`` keeps geotrain's zero-setup byte vocabulary.

Output (``OUT/``), in the style of nanoGPT's ``.bin`` files:

- ``train-00000.bin``, ... and ``eval-00000.bin``, ...: flat little-endian ``uint16``/``uint32`` ids;
  documents are joined by the tokenizer's end-of-text id when it has one;
- every ``round(1/eval_fraction)``-th block of ``BLOCK_TOKENS`` tokens goes to the eval split (as the
  byte corpus does), so a corpus of one document still has an evaluation split;
- ``tokenizer.json`` (unless ``bytes``) and ``manifest.json`` (written last, by rename): token counts,
  sha256 of every shard, dtype, vocabulary size, the tokenizer's sha256.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from geotrain.data.corpus import BLOCK_BYTES, as_text, hidden_below

FORMAT = "geotrain-tokens/1"
MANIFEST = "manifest.json"
BLOCK_TOKENS = BLOCK_BYTES
EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class PrepareError(ValueError):
    """Bad input to ``data prepare``: the message names the input (one line)."""


def _text_file(path: Path) -> str:
    """A file named on its own: its text, or a PrepareError saying why it is not text."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PrepareError(f"{path}: cannot read ({exc.strerror or exc})") from None
    text, why = as_text(raw)
    if text is None:
        raise PrepareError(f"{path}: {why}")
    return text


def _jsonl(path: Path, text_field: str) -> Iterator[str]:
    try:
        with open(path, "rb") as fh:
            n = 0
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise PrepareError(f"{path}:{lineno}: not a JSON object ({exc})") from None
                text = obj.get(text_field) if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    raise PrepareError(f"{path}:{lineno}: no string field {text_field!r} (--text-field)")
                n += 1
                yield text
    except OSError as exc:
        raise PrepareError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if n == 0:
        raise PrepareError(f"{path}: empty")


def _parquet(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError(f"{path}: Parquet input needs pyarrow: pip install 'geotrain[hf]'") from None

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a file that is not Parquet
        raise PrepareError(f"{path}: not a readable Parquet file ({exc})") from None
    if text_field not in pf.schema_arrow.names:
        raise PrepareError(f"{path}: no column {text_field!r} (--text-field; columns: {', '.join(pf.schema_arrow.names)})")
    if pf.metadata.num_rows == 0:
        raise PrepareError(f"{path}: empty")
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise PrepareError(f"{path}: column {text_field!r} holds a non-string value")
            yield text


@dataclass
class Inputs:
    """What ``data prepare`` reads, and what it left out.

    ``paths``: files and directories. A file named on its own is read as it is (JSONL and Parquet
    by suffix, anything else as text) and refused if it is not. In a directory, every file that is
    not hidden is considered: ``.jsonl`` and ``.parquet`` by suffix, any other file by its content
    (text: not blank, no NUL byte, valid UTF-8), so a ``.c``, ``.tex`` or a ``LICENSE`` without a
    suffix is read and a binary is skipped. ``include``/``exclude``: globs matched against the
    path below the directory and against the file's name (``*.py``, ``tests/*``); with
    ``include`` only matching files are read, and ``exclude`` wins. Hidden paths (``.git``, a
    ``.venv``, dotfiles) are never read. ``skipped`` maps every other file of a directory that was
    left out to why (filled as the files are read; each pass finds the same).
    """

    paths: list[Path]
    text_field: str = "text"
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)

    def _matches(self, rel: str, patterns: tuple[str, ...]) -> str | None:
        name = rel.rsplit("/", 1)[-1]
        return next((g for g in patterns if fnmatch.fnmatchcase(rel, g) or fnmatch.fnmatchcase(name, g)), None)

    def files(self) -> list[tuple[Path, bool]]:
        """Every file to consider, in a fixed order, with whether it was named on its own."""
        out: list[tuple[Path, bool]] = []
        for p in self.paths:
            if not p.exists():
                raise PrepareError(f"{p}: not found")
            if not p.is_dir():
                out.append((p, True))
                continue
            found = []
            for f in sorted(x for x in p.rglob("*") if x.is_file()):
                rel = f.relative_to(p).as_posix()
                if hidden_below(f, p):  # never read (.git objects, a .venv, dotfiles); not listed
                    continue
                if self.include and self._matches(rel, self.include) is None:
                    why = f"not matched by --include {' '.join(self.include)}"
                elif (g := self._matches(rel, self.exclude)) is not None:
                    why = f"excluded by --exclude {g}"
                else:
                    found.append((f, False))
                    continue
                self.skipped[str(f)] = why
            if not found:
                raise PrepareError(f"{p}: no files to read in this directory ({skipped_summary(self.skipped)})")
            out.extend(found)
        return out

    def documents(self) -> Iterator[str]:
        """Every document in a fixed order (a text file is one document); a directory's files that
        are not text are skipped and recorded."""
        for f, named in self.files():
            suffix = f.suffix.lower()
            if suffix == ".jsonl":
                yield from _jsonl(f, self.text_field)
            elif suffix == ".parquet":
                yield from _parquet(f, self.text_field)
            elif named:
                yield _text_file(f)
            else:
                try:
                    raw = f.read_bytes()
                except OSError as exc:
                    self.skipped[str(f)] = f"cannot read ({exc.strerror or exc})"
                    continue
                text, why = as_text(raw)
                if text is None:
                    self.skipped[str(f)] = why
                else:
                    yield text


def documents(inputs: list[Path], text_field: str = "text") -> Iterator[str]:
    """Every document of ``inputs`` in a fixed order, with nothing filtered (see :class:`Inputs`)."""
    return Inputs(inputs, text_field).documents()


@dataclass
class Tokenizer:
    """What ``prepare`` needs of a tokenizer: ids of a text, the vocabulary size, an end-of-text id."""

    name: str
    vocab_size: int
    eot_id: int | None
    hf: Any = None  # a tokenizers.Tokenizer, or None for bytes

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids followed by the end-of-text id (when the tokenizer has one)."""
        end = [] if self.eot_id is None else [self.eot_id]
        if self.hf is None:
            return [list(t.encode("utf-8")) + end for t in texts]
        return [list(e.ids) + end for e in self.hf.encode_batch(texts, add_special_tokens=False)]


def _eot(hf: Any) -> int | None:
    for tok in EOT_CANDIDATES:
        i = hf.token_to_id(tok)
        if i is not None:
            return int(i)
    return None


def load_tokenizer(spec: str, inputs: Inputs, vocab_size: int) -> Tokenizer:
    """``bytes``, ``bpe`` (trained on ``inputs``), a ``tokenizer.json`` or a local tokenizer directory."""
    if spec == "bytes":
        return Tokenizer("bytes", 256, None)
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise PrepareError(f"--tokenizer {spec}: needs the Hugging Face tokenizers library: pip install tokenizers") from None

    if spec == "bpe":
        from tokenizers import decoders, models, pre_tokenizers, trainers

        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator(inputs.documents(), trainer=trainer)
        return Tokenizer(f"bpe-{hf.get_vocab_size()}", hf.get_vocab_size(), _eot(hf), hf)
    path = Path(spec)
    if not path.exists():
        raise PrepareError(f"--tokenizer: {spec}: not found (give bytes, bpe, a tokenizer.json or a tokenizer directory)")
    file = path / "tokenizer.json" if path.is_dir() else path
    if file.is_file():
        try:
            hf = HFTokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
            raise PrepareError(f"--tokenizer: {file}: not a tokenizer.json ({exc})") from None
    else:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise PrepareError(
                f"--tokenizer: {path}: a tokenizer directory needs transformers: pip install 'geotrain[hf]'"
            ) from None
        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True, use_fast=True).backend_tokenizer
        except Exception as exc:  # transformers raises OSError, ValueError, ... for a directory it cannot use
            raise PrepareError(f"--tokenizer: {path}: no usable Hugging Face tokenizer ({exc})") from None
    return Tokenizer(str(path), hf.get_vocab_size(with_added_tokens=True), _eot(hf), hf)


def _batched(items: Iterator[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _write_blocks(tok: Tokenizer, inputs: Inputs, writers: dict[str, _ShardWriter], every: int) -> tuple[int, int]:
    """Tokenize every document into blocks; every ``every``-th block to eval. Returns (documents, blocks)."""
    pending = np.zeros(0, dtype=np.int64)
    blocks = docs = 0
    for batch in _batched(inputs.documents(), 256):
        pending = np.concatenate([pending, *(np.asarray(i, dtype=np.int64) for i in tok.encode_batch(batch))])
        docs += len(batch)
        full = pending.size // BLOCK_TOKENS
        for b in range(full):
            writers["eval" if blocks % every == every - 1 else "train"].add(pending[b * BLOCK_TOKENS : (b + 1) * BLOCK_TOKENS])
            blocks += 1
        pending = pending[full * BLOCK_TOKENS :]
    if pending.size:
        writers["eval" if blocks % every == every - 1 else "train"].add(pending)
        blocks += 1
    for w in writers.values():
        w.flush()
    return docs, blocks


@dataclass
class _ShardWriter:
    out: Path
    split: str
    dtype: Any
    shard_tokens: int
    shards: list[dict[str, Any]] = field(default_factory=list)
    _buf: list[np.ndarray] = field(default_factory=list)
    _n: int = 0

    def add(self, ids: np.ndarray) -> None:
        while ids.size:
            take = min(ids.size, self.shard_tokens - self._n)
            self._buf.append(ids[:take])
            self._n += take
            ids = ids[take:]
            if self._n == self.shard_tokens:
                self.flush()

    def flush(self) -> None:
        if not self._n:
            return
        arr = np.concatenate(self._buf).astype(self.dtype)
        name = f"{self.split}-{len(self.shards):05d}.bin"
        (self.out / name).write_bytes(arr.tobytes())  # little-endian on every platform geotrain runs on
        self.shards.append({"file": name, "tokens": int(arr.size), "sha256": hashlib.sha256(arr.tobytes()).hexdigest()})
        self._buf, self._n = [], 0


def prepare(
    inputs: list[Path],
    tokenizer: str,
    out: Path,
    *,
    vocab_size: int = 8192,
    text_field: str = "text",
    dtype: str = "auto",
    eval_fraction: float = 0.05,
    shard_tokens: int = 1 << 24,
    shard_bytes: int | None = None,
    include: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Tokenize ``inputs`` into shards under ``out``; returns the manifest (also ``out/manifest.json``),
    which lists the files of a directory left out and why (:class:`Inputs`). Shards hold
    ``shard_tokens`` tokens, or ``shard_bytes`` bytes when given."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PrepareError(f"--out: {out} exists and is not an empty directory")
    if not 0 < eval_fraction < 0.5:
        raise PrepareError(f"--eval-fraction: must be > 0 and < 0.5 (got {eval_fraction})")
    source = Inputs(inputs, text_field, tuple(include), tuple(exclude))
    tok = load_tokenizer(tokenizer, source, vocab_size)
    if dtype == "auto":
        dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    if dtype not in DTYPES:
        raise PrepareError(f"--dtype: choose from auto, uint16, uint32 (got {dtype!r})")
    if tok.vocab_size > (1 << (8 * np.dtype(DTYPES[dtype]).itemsize)):
        raise PrepareError(f"--dtype: {dtype} cannot hold the ids of {tok.name} (vocabulary {tok.vocab_size}); use uint32")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    if shard_bytes is not None:  # the file size asked for, in tokens of the dtype just chosen
        shard_tokens = max(1, shard_bytes // np.dtype(DTYPES[dtype]).itemsize)
    writers = {s: _ShardWriter(out, s, DTYPES[dtype], shard_tokens) for s in ("train", "eval")}
    try:
        source.skipped.clear()  # this pass reads every file again and finds the same
        docs, blocks = _write_blocks(tok, source, writers, max(2, round(1 / eval_fraction)))
        if not docs:
            raise PrepareError(f"{', '.join(map(str, inputs))}: no text to read ({skipped_summary(source.skipped)})")
        if not writers["eval"].shards or not writers["train"].shards:
            raise PrepareError(
                f"{', '.join(map(str, inputs))}: too little text: {blocks} blocks of {BLOCK_TOKENS} tokens, "
                f"none {'held out' if not writers['eval'].shards else 'left to train on'} at --eval-fraction {eval_fraction}"
            )
    except BaseException:  # leave nothing half-written behind: the shards so far, and the directory if it was new
        for w in writers.values():
            for sh in w.shards:
                (out / sh["file"]).unlink(missing_ok=True)
        if created:
            out.rmdir()
        raise
    tok_sha = None
    if tok.hf is not None:
        tok.hf.save(str(out / "tokenizer.json"))
        tok_sha = hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    manifest = {
        "format": FORMAT,
        "tokenizer": "bytes" if tok.hf is None else "tokenizer.json",
        "tokenizer_source": tok.name,
        "tokenizer_sha256": tok_sha,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": dtype,
        "eval_fraction": eval_fraction,
        "block_tokens": BLOCK_TOKENS,
        "documents": docs,
        "inputs": [str(p) for p in inputs],
        "include": list(include),
        "exclude": list(exclude),
        "skipped": dict(sorted(source.skipped.items())),
        "tokens": {s: sum(sh["tokens"] for sh in w.shards) for s, w in writers.items()},
        "shards": {s: w.shards for s, w in writers.items()},
    }
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out / MANIFEST)
    return manifest


def skipped_summary(skipped: dict[str, str], what: str = "skipped") -> str:
    """'17 skipped: 15 binary (a NUL byte), 2 empty' (reasons by count, then name)."""
    counts: dict[str, int] = {}
    for why in skipped.values():
        key = why.split(" (byte ")[0]  # every offset of a bad byte is one reason
        counts[key] = counts.get(key, 0) + 1
    parts = ", ".join(f"{n} {why}" for why, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"{len(skipped)} {what}" + (f": {parts}" if parts else "")
