"""Ring / hierarchical collectives against torch.distributed.all_reduce, with exact byte counts."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import run_ranks, sum_mismatch, uniform_topology

SIZES = [1, 3, 7, 1000, 4099, 65537]


def _collectives_rank(rank: int, sites: int, workers: int) -> dict:
    from geotrain.comm.collectives import Collectives
    from geotrain.comm.groups import ProcessGroups

    topo = uniform_topology(sites, workers)
    groups = ProcessGroups.build(topo, "gloo", timeout_s=60)
    out: dict = {"errors": [], "bytes": {}}
    try:
        for how in ("hierarchical", "flat", "intra", "across"):
            comm = Collectives(groups)
            for n in SIZES:
                for dtype in (torch.float32, torch.float64):
                    # 'across' takes input identical inside a site by contract
                    seed = 1000 * n + (topo.site_of(rank) if how == "across" else rank)
                    if bad := sum_mismatch(comm, how, n, dtype, seed):
                        out["errors"].append(bad)
            out["bytes"][how] = (comm.stats.intra_bytes, comm.stats.inter_bytes)
        # 2-D input is refused with a clear error
        try:
            Collectives(groups).all_reduce_intra(torch.zeros(2, 2))
            out["errors"].append("2-D accepted")
        except ValueError:
            pass
    finally:
        groups.destroy()
    return out


def _ring_sent(chunks: list[int], i: int) -> int:
    """Elements rank i of a ring sends in reduce-scatter (all chunks but its own) plus all-gather
    (all chunks but its successor's)."""
    n = len(chunks)
    return (sum(chunks) - chunks[i]) + (sum(chunks) - chunks[(i + 1) % n])


def _split(n: int, parts: int) -> list[int]:
    return [t.numel() for t in torch.empty(n).tensor_split(parts)]


def _expected(sites: int, workers: int, how: str) -> tuple[int, int]:
    """Total (intra, inter) bytes over all ranks and all test tensors, worked out independently."""
    intra = inter = 0
    world = sites * workers
    for n in SIZES:
        for elem in (4, 8):
            if how == "flat":
                chunks = _split(n, world)
                for r in range(world):
                    b = _ring_sent(chunks, r) * elem if world > 1 else 0
                    if (r + 1) % workers == 0 and sites > 1:  # r sends to the next site
                        inter += b
                    else:
                        intra += b
                continue
            if how in ("hierarchical", "intra") and workers > 1:
                chunks = _split(n, workers)
                intra += sites * sum(_ring_sent(chunks, i) for i in range(workers)) * elem
            if how in ("hierarchical", "across") and sites > 1:
                for shard in _split(n, workers):
                    chunks = _split(shard, sites)
                    inter += sum(_ring_sent(chunks, i) for i in range(sites)) * elem
            if how == "across" and workers > 1:  # all-gather in site only
                chunks = _split(n, workers)
                intra += sites * sum(sum(chunks) - chunks[(i + 1) % workers] for i in range(workers)) * elem
    return intra, inter


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sites,workers", [(2, 2), pytest.param(3, 2, marks=pytest.mark.slow), (2, 1)])
def test_collectives_match_all_reduce_and_count_bytes(sites: int, workers: int) -> None:
    results = run_ranks(sites * workers, _collectives_rank, sites, workers)
    for r, res in enumerate(results):
        assert res["errors"] == [], f"rank {r}: {res['errors']}"
    for how in ("hierarchical", "flat", "intra", "across"):
        intra = sum(res["bytes"][how][0] for res in results)
        inter = sum(res["bytes"][how][1] for res in results)
        assert (intra, inter) == _expected(sites, workers, how), how
