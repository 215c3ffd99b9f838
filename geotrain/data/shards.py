"""Which training tokens each rank may read, and the launch-time check that every rank gets some.

* IID (default): block *b* goes to rank ``b mod world`` — every worker sees a representative mix;
* non-IID: the training stream is cut into one contiguous slice per site (then per worker), so
  sites see different kinds of text, like organisations with their own data;
* a site-private corpus (``topology.sites[i].corpus``): that site's workers read only it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from geotrain.config import DataConfig
from geotrain.data.corpus import Splits, load_corpus, read_corpus, split_corpus
from geotrain.data.tokens import check_token_data, is_token_dir, refuse_token_site_corpus, site_slot


def shard_for_rank(splits: Splits, rank: int, sites: Sequence[int], non_iid: bool) -> torch.Tensor:
    """The training tokens one rank may read (a site's share is in proportion to its workers)."""
    blocks = splits.train_blocks
    world = sum(sites)
    if not non_iid:
        mine = blocks[rank::world]
    else:
        site, local = site_slot(rank, sites)
        first, per_site = sum(sites[:site]), sites[site]
        site_blocks = blocks[len(blocks) * first // world : len(blocks) * (first + per_site) // world]
        mine = site_blocks[len(site_blocks) * local // per_site : len(site_blocks) * (local + 1) // per_site]
    if not mine:
        raise ValueError(f"data.corpus: too small to give rank {rank} of {world} any data")
    return torch.cat(mine)


def site_shard(site_corpus: str, local_rank: int, workers: int, eval_fraction: float) -> torch.Tensor:
    """A worker's training tokens from its site's private corpus (its held-out blocks are not used)."""
    blocks = split_corpus(read_corpus(site_corpus), eval_fraction).train_blocks
    mine = blocks[local_rank::workers]
    if not mine:
        raise ValueError(f"{site_corpus} is too small for {workers} workers")
    return torch.cat(mine)


def check_data(
    cfg: DataConfig,
    sites: Sequence[int],
    block_size: int,
    site_corpora: list[str | None] | None = None,
    only_site: int | None = None,
) -> None:
    """Fail early (in the launcher) if the corpus cannot feed every rank (``only_site``: the
    ranks of that site only; a site's private corpus may exist on its own machine only)."""
    if is_token_dir(cfg.corpus):
        check_token_data(Path(str(cfg.corpus)), sites, cfg.non_iid, block_size, site_corpora or [], only_site)
        return
    refuse_token_site_corpus(site_corpora or [])
    splits = split_corpus(load_corpus(cfg), cfg.eval_fraction)
    if splits.eval_tokens.numel() <= block_size + 1:
        raise ValueError(f"data.corpus: held-out split too small for model.block_size={block_size}")
    world = sum(sites)
    for r in range(world):
        site, local = site_slot(r, sites)
        if only_site is not None and site != only_site:
            continue
        own = (site_corpora or [None] * len(sites))[site]
        if own is not None:
            where = f"topology.sites[{site}].corpus"
            if not Path(own).exists():
                raise ValueError(f"{where}: file or directory not found on this machine: {own}")
            try:
                shard = site_shard(own, local, sites[site], cfg.eval_fraction)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            if shard.numel() <= block_size + 1:
                raise ValueError(f"{where}: too small for model.block_size={block_size}")
            continue
        shard = shard_for_rank(splits, r, sites, cfg.non_iid)
        if shard.numel() <= block_size + 1:
            raise ValueError(f"data.corpus: too small for {world} ranks at model.block_size={block_size}")
