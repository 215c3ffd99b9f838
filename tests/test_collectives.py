"""Ring / hierarchical collectives against torch.distributed.all_reduce, with exact byte counts."""

from __future__ import annotations

import os

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


def _cuda_only_control_rank(rank: int, sites: int, workers: int) -> list[str]:
    """Every control collective geotrain runs, with a stand-in for NCCL: a backend registered for
    CUDA tensors only (as NCCL is), so a CPU tensor or object sent to a group without a CPU
    backend fails here exactly as it does at step 0 of a GPU run."""
    import torch
    import torch.distributed as dist

    from geotrain.comm.session import close_collectives, open_collectives
    from geotrain.config import ModelConfig
    from geotrain.models import build_model
    from geotrain.privacy.build import global_max
    from geotrain.run.loop import Evaluator
    from geotrain.run.state import check_same_start

    if "cudaonly" not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            "cudaonly", lambda store, r, size, timeout: dist.ProcessGroupGloo(store, r, size, timeout), devices=["cuda"]
        )
    topo = uniform_topology(sites, workers)
    comm = open_collectives(topo, backend="cudaonly", emulate="inprocess", run_key=f"cudaonly-{os.getppid()}")
    g = comm.groups
    done = []
    try:
        torch.manual_seed(0)
        model = build_model(ModelConfig(n_layer=1, n_embd=16, n_head=2, block_size=8))
        check_same_start(model, g.world)
        done.append("start hash")
        x = torch.randint(0, 64, (2, 8))
        Evaluator(model, [(x, x)] * 4, g, 16).loss([p.detach() for p in model.parameters()])
        done.append("evaluation")
        assert comm.site_values(float(g.me.site_index)) == [float(s) for s in range(sites)]
        done.append("guard norms")
        t = torch.ones(1, dtype=torch.float64)
        comm.all_reduce_across_sites(t)
        done.append("token weights")
        assert global_max(float(rank), g.world) == float(sites * workers - 1)
        done.append("privacy max")
        box: list[object] = [g.me.rank]
        dist.broadcast_object_list(box, src=g.topology.site_ranks(g.me.site_index)[0], group=g.intra)
        done.append("round view")
        flag = torch.ones(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=g.intra)
        done.append("round flags")
        y = torch.ones(1000)
        comm.all_reduce(y, "hierarchical")  # emulated links: with headers
        assert float(y[0]) == sites * workers
        done.append("payload with link headers")
    finally:
        close_collectives(comm, unlink_links=rank == 0)
    return done


@pytest.mark.timeout(120)
def test_control_traffic_runs_when_the_data_backend_takes_only_device_tensors() -> None:
    """The GPU path's bug class on a CPU machine: with NCCL as the data backend, the world maps
    cpu to Gloo (comm.groups.world_backend), so every control collective above runs."""
    for done in run_ranks(4, _cuda_only_control_rank, 2, 2):
        assert done[-1] == "payload with link headers", done


def test_a_world_without_a_cpu_backend_is_refused() -> None:
    from geotrain.comm.groups import data_backend, world_backend

    assert world_backend("nccl") == "cpu:gloo,cuda:nccl" and world_backend("gloo") == "gloo"
    assert data_backend("cpu:gloo,cuda:nccl") == "nccl" and data_backend("gloo") == "gloo"
    with pytest.raises(RuntimeError, match="takes no CPU tensors.*backend='cpu:gloo,cuda:nccl'"):
        data_backend("nccl")
