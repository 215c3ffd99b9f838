"""``geotrain bench allreduce``: the hierarchical all-reduce against a flat ring over all ranks on
an emulated link; bus bandwidth the nccl-tests way (busbw = S/t · 2(n−1)/n), inter-site link
utilisation (inter-site bytes carried ÷ (capacity of the links used × time)) and the α-β
prediction.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from geotrain.bench.common import MIB, bps, link_topology, table
from geotrain.comm.procs import run_ranks
from geotrain.comm.session import rank_comm
from geotrain.comm.topology import Topology


def alpha_beta_seconds(algorithm: str, nbytes: int, sites: int, workers: int, bandwidth_bps: float, latency_s: float) -> float:
    """α-β time of a ring all-reduce whose cost is the wide-area link (in-site hops taken as free).

    hierarchical: N sites in a ring, each link carries 2(N−1)/N · S (the G shards together) in
    2(N−1) dependent steps; flat: n = N·G ranks, the ring crosses each site boundary once,
    2(n−1)/n · S over the boundary link in 2(n−1) steps.
    """
    n = sites if algorithm == "hierarchical" else sites * workers
    return 2 * (n - 1) * latency_s + 2 * (n - 1) / n * nbytes * 8 / bandwidth_bps


def _allreduce_rank(rank: int, topo: Topology, sizes: list[int], reps: int, lanes: int, chunk_bytes: int) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    rows = []
    with rank_comm(topo, "inprocess", lanes, chunk_bytes) as (groups, comm):
        for n in sizes:
            x = torch.ones(n // 4)
            for how in ("hierarchical", "flat"):
                times, inter = [], []
                for i in range(reps + 1):
                    x.fill_(1.0)
                    dist.barrier(group=groups.lanes[0].world)
                    b0 = comm.stats.inter_bytes
                    t0 = time.perf_counter()
                    comm.all_reduce(x, how)
                    dt = time.perf_counter() - t0
                    if i:  # the first is a warm-up
                        times.append(dt)
                        inter.append(comm.stats.inter_bytes - b0)
                    assert float(x[0]) == topo.world_size
                rows.append({"algorithm": how, "bytes": n, "times": times, "inter_bytes": inter[0]})
    return rows


def bench_allreduce(
    sizes_mib: list[float],
    bandwidth_bps: float = 1e9,
    latency_s: float = 0.04,
    sites: int = 2,
    workers: int = 2,
    reps: int = 3,
    lanes: int = 4,
    chunk_bytes: int = 4 * MIB,
) -> dict[str, Any]:
    topo = link_topology(sites, workers, bandwidth_bps, latency_s)
    sizes = [int(s * MIB) // 4 * 4 for s in sizes_mib]
    per_rank = run_ranks(topo.world_size, _allreduce_rank, topo, sizes, reps, lanes, chunk_bytes, timeout=1800)
    n = topo.world_size
    links_used = 2 if sites == 2 else sites  # directed site-to-site links a ring uses
    points = []
    for i, row in enumerate(per_rank[0]):
        # the collective ends when the slowest rank is done
        seconds = statistics.median(max(r[i]["times"][k] for r in per_rank) for k in range(reps))
        inter = sum(r[i]["inter_bytes"] for r in per_rank)
        S = row["bytes"]
        points.append(
            {
                "algorithm": row["algorithm"],
                "bytes": S,
                "seconds": seconds,
                "busbw_bps": S * 8 / seconds * 2 * (n - 1) / n,
                "link_utilization": inter * 8 / (links_used * bandwidth_bps * seconds),
                "inter_site_bytes": inter,
                "predicted_seconds": alpha_beta_seconds(row["algorithm"], S, sites, workers, bandwidth_bps, latency_s),
                "link_bps": bandwidth_bps,
                "latency_s": latency_s,
            }
        )
    return {
        "sites": sites,
        "workers_per_site": workers,
        "lanes": lanes,
        "chunk_bytes": chunk_bytes,
        "points": points,
    }


def print_allreduce(result: dict[str, Any], console: Any) -> None:
    pts = result["points"]
    t = table(
        f"all-reduce over emulated links: {result['sites']} sites x {result['workers_per_site']} workers, "
        f"{bps(pts[0]['link_bps'])}, {pts[0]['latency_s'] * 1e3:g} ms, {result['lanes']} lanes x {result['chunk_bytes'] >> 20} MiB chunks",
        ["algorithm", "size", "time", "α-β predicted", "busbw", "link utilisation", "inter-site bytes"],
    )
    for p in pts:
        t.add_row(
            p["algorithm"], f"{p['bytes'] / MIB:g} MiB", f"{p['seconds'] * 1e3:.0f} ms", f"{p['predicted_seconds'] * 1e3:.0f} ms",
            bps(p["busbw_bps"]), f"{p['link_utilization']:.1%}", f"{p['inter_site_bytes'] / 1e6:.1f} MB",
        )  # fmt: skip
    console.print(t)
    for size in dict.fromkeys(p["bytes"] for p in pts):
        h = next(p for p in pts if p["bytes"] == size and p["algorithm"] == "hierarchical")
        f = next(p for p in pts if p["bytes"] == size and p["algorithm"] == "flat")
        console.print(
            f"{size / MIB:g} MiB: hierarchical {f['seconds'] / h['seconds']:.2f}x faster than flat "
            f"(α-β model: {f['predicted_seconds'] / h['predicted_seconds']:.2f}x)"
        )
