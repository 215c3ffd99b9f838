"""The run summary (``OUT/summary.json``, schema: docs/SUMMARY.md): one record per rank, the run's
record built from them on global rank 0, and the merged summary of several runs.

``OUT/summary.json`` of ``geotrain train`` holds the primary run's record at the top level and
every run (primary first, then the baseline) under ``runs``; ``comparison`` compares the two
when a baseline ran. Nothing here communicates: the caller gathers the rank records.
"""

from __future__ import annotations

import platform
from typing import Any

import torch

from geotrain.comm.collectives import CommStats
from geotrain.comm.topology import RankInfo, Topology

# dense bf16 peak FLOP/s of one device (no sparsity), by a name torch.cuda.get_device_name contains
DEVICE_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L4": 121e12}


def device_peak(name: str) -> float | None:
    """The dense bf16 peak of a device named ``name`` (None: not in the table, a CPU)."""
    return next((v for k, v in DEVICE_PEAK_BF16.items() if k in name), None)


def flops_per_token(params: int, layers: int, width: int, context: int) -> float:
    """Model FLOPs of one training token: 6N (forward and backward of every weight) plus
    attention's 12·layers·width·context (PaLM's appendix B; nanoGPT's estimate)."""
    return 6.0 * params + 12.0 * layers * width * context


def rank_record(me: RankInfo, stats: CommStats, result: dict[str, Any], global_hash: str) -> dict[str, Any]:
    """One rank's numbers: bytes by link class, times, utilisation, and its global-model hash."""
    return {
        "rank": me.rank,
        "site": me.site,
        "local_rank": me.local_rank,
        "inter_site_bytes": stats.inter_bytes,
        "inter_region_bytes": stats.inter_region_bytes,
        "inter_site_raw_bytes": stats.inter_raw_bytes,
        "link_bytes": {str(dst): n for dst, n in sorted(stats.link_bytes.items())},  # by the receiving site's index
        "intra_site_bytes": stats.intra_bytes,
        "peak_inter_site_bytes_per_step": result["peak_inter_site_bytes_per_step"],
        "final_sync_inter_site_bytes": result["final_sync_inter_site_bytes"],
        "compute_seconds": result["compute_seconds"],
        "utilization": result["utilization"],
        "steps_done": result["steps_done"],
        "step_seconds": result["step_seconds"],
        "network_seconds": stats.network_seconds,
        "comm_wait_seconds": stats.comm_seconds,
        "wan_wait_seconds": stats.wan_wait_seconds,
        "eval_seconds": result["eval_seconds"],
        "eval_seconds_before": result["eval_seconds_before"],
        "wall_seconds": result["wall_seconds"],
        "peak_memory_bytes": result.get("peak_memory_bytes"),
        "global_param_hash": global_hash,
    }


def link_bytes(ranks: list[dict[str, Any]], topo: Topology) -> dict[str, int]:
    """Bytes each directed site-to-site link carried ("A->B"), summed over the ranks' records."""
    out: dict[str, int] = {}
    for r in ranks:
        for dst, n in r.get("link_bytes", {}).items():
            key = f"{r['site']}->{topo.site_names[int(dst)]}"
            out[key] = out.get(key, 0) + n
    return dict(sorted(out.items()))


def run_summary(
    gathered: list[dict[str, Any]], topo: Topology, result: dict[str, Any], run: dict[str, Any], privacy: dict[str, Any]
) -> dict[str, Any]:
    """The run's record from every rank's :func:`rank_record` (any order). A site none of whose
    ranks reported (it died, and asynchronous quorum rounds went on without it) is listed in
    ``lost_sites`` and left out of the per-site numbers.

    Args:
        topo: the topology of the ranks gathered.
        result: global rank 0's training-loop result (steps, curve, final loss).
        run: what the run was: algorithm, H, fragments, rounds, rounds_rolled_back,
            guard_rejections, guard_events, codec, params, link_emulation, threads_per_rank,
            backend, config.
        privacy: the privacy machinery's summary.
    """
    ranks = sorted(gathered, key=lambda r: r["rank"])
    by_rank = {r["rank"]: r for r in ranks}
    live = [i for i in range(topo.num_sites) if all(r in by_rank for r in topo.site_ranks(i))]
    hashes = {topo.site_names[i]: by_rank[topo.site_ranks(i)[0]]["global_param_hash"] for i in live}
    agree = all(r["global_param_hash"] == hashes.get(r["site"]) for r in ranks)
    n = len(ranks)
    inter = sum(r["inter_site_bytes"] for r in ranks)
    raw = sum(r["inter_site_raw_bytes"] for r in ranks)
    return {
        "algorithm": run["algorithm"],
        "sites": list(topo.site_names),
        "workers_per_site": topo.workers[0] if topo.uniform else list(topo.workers),
        "world_size": topo.world_size,
        "steps": result["steps_done"],
        "H": run["H"],
        "fragments": run["fragments"],
        "rounds": run["rounds"],
        "region_rounds": run.get("region_rounds", 0),
        "rounds_rolled_back": run["rounds_rolled_back"],
        "guard_rejections": run["guard_rejections"],
        "guard_events": run["guard_events"],
        "codec": run["codec"],
        "tokens": result["curve"][-1]["tokens"],
        "params": run["params"],
        "final_eval_loss": result["final_eval_loss"],
        "inter_site_bytes": inter,
        "inter_region_bytes": sum(r["inter_region_bytes"] for r in ranks),  # over the slow tier (0 without regions)
        "link_bytes": link_bytes(ranks, topo),
        "compression_ratio": raw / inter if inter else 1.0,
        "utilization": min(r["utilization"] for r in ranks),
        # each site's measured pace: steps run, compute seconds per step (network waits excluded), busy fraction
        "pace": run.get("pace", []),
        # sync.adapt: each round's measured link and the H and codec chosen for the next round
        "adapt": run.get("adapt", []),
        "per_site": [
            {
                "site": topo.site_names[i],
                "workers": topo.workers[i],
                "steps": max(by_rank[r]["steps_done"] for r in topo.site_ranks(i)),
                "step_seconds": sum(by_rank[r]["step_seconds"] for r in topo.site_ranks(i)) / topo.workers[i],
                "utilization": min(by_rank[r]["utilization"] for r in topo.site_ranks(i)),
            }
            for i in live
        ],
        "lost_sites": [name for i, name in enumerate(topo.site_names) if i not in live],
        "link_emulation": run["link_emulation"],
        "peak_inter_site_bytes_per_step": sum(r["peak_inter_site_bytes_per_step"] for r in ranks),
        "final_sync_inter_site_bytes": sum(r["final_sync_inter_site_bytes"] for r in ranks),
        "intra_site_bytes": sum(r["intra_site_bytes"] for r in ranks),
        "wall_seconds": max(r["wall_seconds"] for r in ranks),
        "compute_seconds": sum(r["compute_seconds"] for r in ranks) / n,
        "comm_wait_seconds": sum(r["comm_wait_seconds"] for r in ranks) / n,
        "wan_wait_seconds": sum(r["wan_wait_seconds"] for r in ranks) / n,
        "eval_seconds": sum(r["eval_seconds"] for r in ranks) / n,
        "eval_seconds_before": sum(r.get("eval_seconds_before", 0.0) for r in ranks) / n,
        "global_param_hash": hashes,
        "hashes_agree_within_sites": agree,
        **privacy,
        "eval_curve": result["curve"],
        "per_rank": ranks,
        "threads_per_rank": run["threads_per_rank"],
        **throughput(result, ranks, run),
        "backend": run["backend"],
        "torch": torch.__version__,
        "python": platform.python_version(),
        "config": run["config"],
    }


def throughput(result: dict[str, Any], ranks: list[dict[str, Any]], run: dict[str, Any]) -> dict[str, Any]:
    """Tokens per second per rank over the training wall time (evaluations excluded) and model
    FLOPs utilisation: that × :func:`flops_per_token` ÷ the device's dense bf16 peak (None where
    the device is not in :data:`DEVICE_PEAK_BF16`, e.g. a CPU)."""
    # wall_seconds starts after the evaluation before the first step, which eval_seconds counts too
    wall = max(r["wall_seconds"] - r["eval_seconds"] + r.get("eval_seconds_before", 0.0) for r in ranks)
    per_rank = result["curve"][-1]["tokens"] / len(ranks) / max(wall, 1e-9)
    peak = device_peak(run.get("device", "cpu"))
    fpt = run.get("flops_per_token", 0.0)
    return {
        "tokens_per_second_per_rank": per_rank,
        "flops_per_token": fpt,
        "device": run.get("device", "cpu"),
        "mfu": per_rank * fpt / peak if peak and fpt else None,
    }


def compare(primary: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """Ratios of the primary run against the baseline at equal tokens."""
    inter_p, inter_b = primary["inter_site_bytes"], baseline["inter_site_bytes"]
    return {
        "primary": primary["algorithm"],
        "baseline": baseline["algorithm"],
        "equal_tokens": primary["tokens"] == baseline["tokens"],
        "eval_loss_ratio": primary["final_eval_loss"] / baseline["final_eval_loss"],
        "inter_site_bytes_ratio": (inter_b / inter_p) if inter_p else None,
        "wall_seconds_ratio": primary["wall_seconds"] / baseline["wall_seconds"],
    }


def merged_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    top = {k: v for k, v in runs[0].items() if k not in ("per_rank", "config", "eval_curve")}
    top["runs"] = runs
    if len(runs) > 1:
        top["comparison"] = compare(runs[0], runs[1])
    return top
