"""Corpus, byte-level tokenizer, held-out split and per-site / per-worker shards.

Default corpus: text every CPython install ships — the pydoc topic texts (``pydoc_data``) and
the standard library's own ``.py`` sources — so the first run downloads nothing. Any text file,
or a directory of text files, can be named instead (``data.corpus``).

Tokens are bytes (vocabulary 256). The byte stream is cut into 4 KiB blocks; every
``round(1/eval_fraction)``-th block is held out for evaluation. Training blocks are sharded:

* IID (default): block *b* goes to rank ``b mod world`` — every worker sees a representative mix;
* non-IID: the training stream is cut into one contiguous slice per site (then per worker), so
  sites see different kinds of text, like organisations with their own data.

Each worker samples random windows from its own shard with a generator seeded by
``(seed, rank)``; its state is the data position (checkpointable later).
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from geotrain.config import DataConfig

BLOCK_BYTES = 4096
DEFAULT_CORPUS_BYTES = 3_000_000
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".text", ".csv", ".json", ".html", ""}


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


def _read_corpus(path: str) -> bytes:
    p = Path(path)
    if p.is_file():
        return p.read_bytes()
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise ValueError(f"data.corpus: no text files under {path}")
    return b"\n\n".join(f.read_bytes() for f in files)


def load_corpus(cfg: DataConfig) -> bytes:
    return _default_corpus() if cfg.corpus is None else _read_corpus(cfg.corpus)


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


def shard_for_rank(splits: Splits, rank: int, world: int, num_sites: int, non_iid: bool) -> torch.Tensor:
    """The training tokens one rank may read."""
    blocks = splits.train_blocks
    if not non_iid:
        mine = blocks[rank::world]
    else:
        per_site = world // num_sites
        site, local = divmod(rank, per_site)
        site_blocks = blocks[len(blocks) * site // num_sites : len(blocks) * (site + 1) // num_sites]
        mine = site_blocks[len(site_blocks) * local // per_site : len(site_blocks) * (local + 1) // per_site]
    if not mine:
        raise ValueError(f"data.corpus: too small to give rank {rank} of {world} any data")
    return torch.cat(mine)


class BatchSampler:
    """Random ``[batch, block_size]`` windows from one token shard, reproducible from its state."""

    def __init__(self, tokens: torch.Tensor, block_size: int, batch_size: int, seed: int) -> None:
        if tokens.numel() <= block_size + 1:
            raise ValueError(f"data.corpus: shard of {tokens.numel()} tokens is too small for model.block_size={block_size}")
        self.tokens = tokens
        self.block_size = block_size
        self.batch_size = batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self._offsets = torch.arange(block_size + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, self.tokens.numel() - self.block_size - 1, (self.batch_size,), generator=self.gen)
        win = self.tokens[starts[:, None] + self._offsets].long()
        return win[:, :-1], win[:, 1:]

    def skip(self, batches: int) -> None:
        """Advance the position as if ``batches`` batches had been drawn (a healed site catching up)."""
        high = self.tokens.numel() - self.block_size - 1
        for _ in range(batches):
            torch.randint(0, high, (self.batch_size,), generator=self.gen)

    def state(self) -> torch.Tensor:
        return self.gen.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.gen.set_state(state)


def eval_batches(
    eval_tokens: torch.Tensor, block_size: int, batch_size: int, n: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` fixed evaluation batches, identical on every rank."""
    sampler = BatchSampler(eval_tokens, block_size, batch_size, seed + 1_000_003)
    return [sampler.next() for _ in range(n)]


@dataclass
class RankData:
    train: BatchSampler
    eval: list[tuple[torch.Tensor, torch.Tensor]]


def site_shard(site_corpus: str, local_rank: int, workers: int, eval_fraction: float) -> torch.Tensor:
    """A worker's training tokens from its site's private corpus (its held-out blocks are not used)."""
    blocks = split_corpus(_read_corpus(site_corpus), eval_fraction).train_blocks
    mine = blocks[local_rank::workers]
    if not mine:
        raise ValueError(f"{site_corpus} is too small for {workers} workers")
    return torch.cat(mine)


def build_rank_data(
    cfg: DataConfig,
    rank: int,
    world: int,
    num_sites: int,
    block_size: int,
    batch_size: int,
    eval_batches_n: int,
    seed: int,
    site_corpus: str | None = None,
) -> RankData:
    """A rank's sampler and the shared evaluation batches. With ``site_corpus`` the rank trains only
    on that (site-private) corpus; evaluation stays on the shared held-out split of ``data.corpus``."""
    splits = split_corpus(load_corpus(cfg), cfg.eval_fraction)
    if site_corpus is not None:
        per_site = world // num_sites
        shard = site_shard(site_corpus, rank % per_site, per_site, cfg.eval_fraction)
    else:
        shard = shard_for_rank(splits, rank, world, num_sites, cfg.non_iid)
    return RankData(
        train=BatchSampler(shard, block_size, batch_size, seed * 1_000_033 + rank),
        eval=eval_batches(splits.eval_tokens, block_size, batch_size, eval_batches_n, seed),
    )


def check_data(
    cfg: DataConfig, world: int, num_sites: int, block_size: int, site_corpora: list[str | None] | None = None
) -> None:
    """Fail early (in the launcher) if the corpus cannot feed every rank."""
    splits = split_corpus(load_corpus(cfg), cfg.eval_fraction)
    if splits.eval_tokens.numel() <= block_size + 1:
        raise ValueError(f"data.corpus: held-out split too small for model.block_size={block_size}")
    per_site = world // num_sites
    for r in range(world):
        own = (site_corpora or [None] * num_sites)[r // per_site]
        if own is not None:
            where = f"topology.sites[{r // per_site}].corpus"
            try:
                shard = site_shard(own, r % per_site, per_site, cfg.eval_fraction)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            if shard.numel() <= block_size + 1:
                raise ValueError(f"{where}: too small for model.block_size={block_size}")
            continue
        shard = shard_for_rank(splits, r, world, num_sites, cfg.non_iid)
        if shard.numel() <= block_size + 1:
            raise ValueError(f"data.corpus: too small for {world} ranks at model.block_size={block_size}")


__all__ = ["build_rank_data", "check_data", "BatchSampler", "load_corpus", "split_corpus", "shard_for_rank"]
