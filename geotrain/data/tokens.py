"""Token shards made by ``geotrain data prepare``, read window by window: resident memory does not grow with the corpus.

The shards of a split are cut into blocks of ``max(block_tokens, block_size + 1)`` tokens (a block
never crosses a shard file; a shard's last block may be shorter if it holds one window). Blocks are shared out like the byte corpus's: IID, block *b* to rank
``b mod world``; non-IID, one contiguous range per site, then per worker. A rank's blocks are an
arithmetic range (start, stride, count), so nothing per block is held in memory. A batch draws a
block and an offset inside it per row from a generator seeded by ``(seed, rank)``; the generator's
state is the data position, so a resumed run draws the same batches.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from geotrain.config import DataConfig
from geotrain.data.prepare import DTYPES, FORMAT, MANIFEST


def is_token_dir(path: str | Path | None) -> bool:
    return path is not None and (Path(path) / MANIFEST).is_file()


def vocab_size(cfg: DataConfig) -> int:
    """The model's vocabulary for ``cfg``: the prepared shards' tokenizer's, else 256 byte tokens."""
    return int(read_manifest(Path(str(cfg.corpus)))["vocab_size"]) if is_token_dir(cfg.corpus) else 256


def tokenizer_file(cfg: DataConfig) -> Path | None:
    """The ``tokenizer.json`` the data was prepared with (None for bytes), to ship with an exported model."""
    f = Path(str(cfg.corpus)) / "tokenizer.json"
    return f if is_token_dir(cfg.corpus) and f.is_file() else None


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of a prepared directory, checked against the files (sizes; sha256 is ``verify``'s job)."""
    try:
        m = json.loads((root / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{root / MANIFEST}: unreadable ({exc})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("dtype") not in DTYPES:
        raise ValueError(f"{root / MANIFEST}: not a {FORMAT} manifest (made by geotrain data prepare)")
    item = np.dtype(DTYPES[m["dtype"]]).itemsize
    for split in ("train", "eval"):
        for sh in m["shards"][split]:
            f = root / sh["file"]
            if not f.is_file() or f.stat().st_size != sh["tokens"] * item:
                raise ValueError(f"{f}: missing or not {sh['tokens']} tokens as the manifest says")
    return m


def verify(root: Path) -> dict[str, Any]:
    """Every shard's sha256 against the manifest (reads every byte: ``geotrain data verify``, tests); the manifest."""
    import hashlib

    m = read_manifest(root)
    for split in ("train", "eval"):
        for sh in m["shards"][split]:
            h = hashlib.sha256()
            with open(root / sh["file"], "rb") as fh:
                while chunk := fh.read(1 << 24):
                    h.update(chunk)
            if h.hexdigest() != sh["sha256"]:
                raise ValueError(f"{root / sh['file']}: sha256 differs from the manifest")
    return m


@dataclass(frozen=True)
class BlockRange:
    """Block ids ``start, start + stride, ...`` (``count`` of them)."""

    start: int
    stride: int
    count: int


def site_slot(rank: int, sites: Sequence[int]) -> tuple[int, int]:
    """(site index, local rank) of global ``rank``, ranks numbered site by site; ``sites``: each
    site's worker count."""
    for s, n in enumerate(sites):
        if rank < n:
            return s, rank
        rank -= n
    raise ValueError(f"rank outside a world of {sum(sites)}")


def rank_blocks(n_blocks: int, rank: int, sites: Sequence[int], non_iid: bool) -> BlockRange:
    """The blocks rank ``rank`` reads: every world-th block (iid), or a contiguous run of its site's
    share (non-iid). Either way a site gets blocks in proportion to its workers."""
    world = sum(sites)
    if not non_iid:
        return BlockRange(rank, world, max(0, (n_blocks - rank + world - 1) // world))
    site, local = site_slot(rank, sites)
    first = sum(sites[:site])
    lo, hi = n_blocks * first // world, n_blocks * (first + sites[site]) // world
    per_site = sites[site]
    a, b = lo + (hi - lo) * local // per_site, lo + (hi - lo) * (local + 1) // per_site
    return BlockRange(a, 1, b - a)


class TokenShards:
    """One split of a prepared directory as numbered blocks of ``block`` tokens, read window by window.

    ``reader="pread"`` (the default) reads each window with one ``os.pread`` from the page cache:
    nothing is mapped into the process, so its resident memory does not grow with the corpus.
    ``reader="mmap"`` memory-maps the shards instead; the pages a rank touches then count in its
    RSS (``geotrain bench scale`` measures both; docs/SCALE.md).
    """

    MAX_OPEN = 64  # file descriptors kept open per split

    def __init__(self, root: Path, split: str, block_size: int, reader: str = "pread") -> None:
        self._fds: dict[int, int] = {}  # first: __del__ runs even when the manifest is refused
        m = read_manifest(root)
        self.manifest = m
        self.vocab_size = int(m["vocab_size"])
        self.block = max(int(m["block_tokens"]), block_size + 1)
        self.dtype = np.dtype(DTYPES[m["dtype"]])
        kept = [sh for sh in m["shards"][split] if sh["tokens"]]
        self.files = [root / sh["file"] for sh in kept]
        self.lengths = [int(sh["tokens"]) for sh in kept]
        self.maps = [np.memmap(f, dtype=self.dtype, mode="r") for f in self.files] if reader == "mmap" else None
        # a shard's last block may be shorter, if it still holds one window of block_size + 1 tokens
        counts = np.array([-(-(n - block_size) // self.block) if n > block_size else 0 for n in self.lengths], dtype=np.int64)
        self.first_block = np.concatenate([[0], np.cumsum(counts)])  # block id where each shard starts
        self.n_blocks = int(self.first_block[-1])

    def read(self, shard: int, start: int, length: int) -> np.ndarray:
        """Tokens ``start : start + length`` of shard number ``shard``, as int64."""
        if self.maps is not None:
            return np.asarray(self.maps[shard][start : start + length], dtype=np.int64)
        fd = self._fds.get(shard)
        if fd is None:
            if len(self._fds) >= self.MAX_OPEN:
                os.close(self._fds.pop(next(iter(self._fds))))
            fd = self._fds[shard] = os.open(self.files[shard], os.O_RDONLY)
        raw = os.pread(fd, length * self.dtype.itemsize, start * self.dtype.itemsize)
        if len(raw) != length * self.dtype.itemsize:
            raise ValueError(f"{self.files[shard]}: shorter than its manifest says (changed while training?)")
        return np.frombuffer(raw, dtype=self.dtype).astype(np.int64)

    def window(self, block_id: int, offset: int, length: int) -> np.ndarray:
        shard = int(np.searchsorted(self.first_block, block_id, side="right")) - 1
        start = (block_id - int(self.first_block[shard])) * self.block
        room = min(self.block, self.lengths[shard] - start) - length + 1  # window starts this block allows
        return self.read(shard, start + offset % room, length)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:
        self.close()


class TokenSampler:
    """Random ``[batch, block_size]`` windows from a rank's blocks; same interface as ``BatchSampler``."""

    def __init__(self, shards: TokenShards, blocks: BlockRange, block_size: int, batch_size: int, seed: int) -> None:
        if blocks.count < 1:
            raise ValueError(f"data.corpus: {shards.n_blocks} blocks of {shards.block} tokens leave this rank none")
        self.shards, self.blocks = shards, blocks
        self.block_size, self.batch_size = block_size, batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.num_tokens = blocks.count * shards.block

    def _draw(self) -> tuple[torch.Tensor, torch.Tensor]:
        which = torch.randint(0, self.blocks.count, (self.batch_size,), generator=self.gen)
        offset = torch.randint(0, self.shards.block - self.block_size, (self.batch_size,), generator=self.gen)
        return which, offset

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        which, offset = self._draw()
        rows = [
            self.shards.window(self.blocks.start + int(w) * self.blocks.stride, int(o), self.block_size + 1)
            for w, o in zip(which, offset, strict=True)
        ]
        win = torch.from_numpy(np.stack(rows))
        return win[:, :-1], win[:, 1:]

    def skip(self, batches: int) -> None:
        for _ in range(batches):
            self._draw()

    def state(self) -> torch.Tensor:
        return self.gen.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.gen.set_state(state)


def token_sampler(
    root: Path, rank: int, sites: Sequence[int], non_iid: bool, block_size: int, batch_size: int, seed: int
) -> TokenSampler:
    shards = TokenShards(root, "train", block_size)
    return TokenSampler(shards, rank_blocks(shards.n_blocks, rank, sites, non_iid), block_size, batch_size, seed)


def token_eval_batches(
    root: Path, block_size: int, batch_size: int, n: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` fixed evaluation batches from the eval split, identical on every rank."""
    shards = TokenShards(root, "eval", block_size)
    sampler = TokenSampler(shards, BlockRange(0, 1, shards.n_blocks), block_size, batch_size, seed + 1_000_003)
    return [sampler.next() for _ in range(n)]


def check_token_data(
    root: Path, sites: Sequence[int], non_iid: bool, block_size: int, site_corpora: list[str | None], only_site: int | None
) -> None:
    """Launch-time check of a prepared corpus: an eval split, blocks for every rank, one tokenizer throughout."""
    ev = TokenShards(root, "eval", block_size)
    if ev.n_blocks < 1:
        raise ValueError(f"data.corpus: the eval split of {root} holds no block of {ev.block} tokens; prepare more text")
    train = TokenShards(root, "train", block_size)
    world = sum(sites)
    for s, per_site in enumerate(sites):
        if only_site is not None and s != only_site:
            continue
        own = site_corpora[s] if s < len(site_corpora) else None
        if own is None:
            for r in range(sum(sites[:s]), sum(sites[: s + 1])):
                if rank_blocks(train.n_blocks, r, sites, non_iid).count < 1:
                    raise ValueError(
                        f"data.corpus: {train.n_blocks} blocks of {train.block} tokens leave rank {r} of {world} none"
                    )
            continue
        where = f"topology.sites[{s}].corpus"
        if not Path(own).exists():
            raise ValueError(f"{where}: file or directory not found on this machine: {own}")
        check_same_vocabulary(root, own, where)
        site = TokenShards(Path(own), "train", block_size)
        if site.n_blocks < per_site:
            raise ValueError(f"{where}: {site.n_blocks} blocks of {site.block} tokens for {per_site} workers")


def refuse_token_site_corpus(site_corpora: list[str | None]) -> None:
    """With a text ``data.corpus``, no site may bring token shards (the model has one vocabulary)."""
    if any(is_token_dir(c) for c in site_corpora):
        raise ValueError("topology.sites[].corpus: token shards need data.corpus to be token shards of the same tokenizer")


def check_same_vocabulary(root: Path, site_corpus: str, where: str) -> None:
    """A site-private corpus must be token shards of the same tokenizer as ``data.corpus`` (one model vocabulary)."""
    if not is_token_dir(site_corpus):
        raise ValueError(f"{where}: data.corpus is token shards, so this must be a directory made by geotrain data prepare")
    a, b = read_manifest(root), read_manifest(Path(site_corpus))
    if (a["vocab_size"], a["tokenizer_sha256"]) != (b["vocab_size"], b["tokenizer_sha256"]):
        raise ValueError(
            f"{where}: prepared with another tokenizer than data.corpus ({b['tokenizer_source']} vs {a['tokenizer_source']})"
        )
