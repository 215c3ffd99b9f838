"""Batches: random windows from a rank's shard, reproducible from the sampler's state.

Each worker samples random windows from its own shard with a generator seeded by
``(seed, rank)``; its state is the data position (saved in checkpoints). Evaluation batches
are fixed and identical on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from geotrain.config import DataConfig
from geotrain.data.corpus import load_corpus, split_corpus
from geotrain.data.shards import shard_for_rank, site_shard
from geotrain.data.tokens import (
    TokenSampler,
    check_same_vocabulary,
    is_token_dir,
    refuse_token_site_corpus,
    site_slot,
    token_eval_batches,
    token_sampler,
)


class BatchSampler:
    """Random ``[batch, block_size]`` windows from one token shard, reproducible from its state."""

    def __init__(self, tokens: torch.Tensor, block_size: int, batch_size: int, seed: int) -> None:
        if tokens.numel() <= block_size + 1:
            raise ValueError(f"data.corpus: shard of {tokens.numel()} tokens is too small for model.block_size={block_size}")
        self.tokens = tokens
        self.num_tokens = tokens.numel()
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
    train: BatchSampler | TokenSampler
    eval: list[tuple[torch.Tensor, torch.Tensor]]
    micro_batches: int = 1  # batches a training step draws (train.grad_accum)


def build_rank_data(
    cfg: DataConfig,
    rank: int,
    sites: Sequence[int],
    block_size: int,
    batch_size: int,
    eval_batches_n: int,
    seed: int,
    site_corpus: str | None = None,
) -> RankData:
    """A rank's sampler and the shared evaluation batches. With ``site_corpus`` the rank trains only
    on that (site-private) corpus; evaluation stays on the shared held-out split of ``data.corpus``.
    A directory made by ``geotrain data prepare`` is read as token shards, window by window."""
    site, local = site_slot(rank, sites)
    seed_rank = seed * 1_000_033 + rank
    if is_token_dir(cfg.corpus):
        root = Path(str(cfg.corpus))
        evals = token_eval_batches(root, block_size, batch_size, eval_batches_n, seed)
        if site_corpus is not None:
            check_same_vocabulary(root, site_corpus, "topology.sites[].corpus")
            train = token_sampler(Path(site_corpus), local, [sites[site]], False, block_size, batch_size, seed_rank)
        else:
            train = token_sampler(root, rank, sites, cfg.non_iid, block_size, batch_size, seed_rank)
        return RankData(train=train, eval=evals)
    refuse_token_site_corpus([site_corpus])
    splits = split_corpus(load_corpus(cfg), cfg.eval_fraction)
    if site_corpus is not None:
        shard = site_shard(site_corpus, local, sites[site], cfg.eval_fraction)
    else:
        shard = shard_for_rank(splits, rank, sites, cfg.non_iid)
    return RankData(
        train=BatchSampler(shard, block_size, batch_size, seed_rank),
        eval=eval_batches(splits.eval_tokens, block_size, batch_size, eval_batches_n, seed),
    )
