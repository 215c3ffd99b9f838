"""Benchmarks of the emulated wide-area network: ``geotrain bench link``, ``bench allreduce``
and ``bench wan``.

* **link**: one buffer sent from site A to site B over an emulated link; the time from the
  sender's start to the receiver holding the data (both read the same CLOCK_MONOTONIC, so no
  ack is needed), against size/bandwidth + latency, at several speeds, in-process and (as root)
  kernel mode.
* **allreduce**: the hierarchical all-reduce against a flat ring over all ranks on an emulated
  link; bus bandwidth the nccl-tests way (busbw = S/t · 2(n−1)/n), inter-site link utilisation
  (inter-site bytes carried ÷ (capacity of the links used × time)) and the α-β prediction.
* **wan**: real training runs (the default model) swept over inter-site bandwidth for ddp,
  diloco and streaming; compute utilisation (compute ÷ wall, min over ranks), inter-site bytes
  and final loss; plus a timeline of one run.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from geotrain.comm.procs import run_ranks
from geotrain.comm.topology import Topology
from geotrain.config import Config, TopologyConfig, load_config

MIB = 1 << 20


def link_topology(sites: int, workers: int, bandwidth_bps: float, latency_s: float, emulate: str = "inprocess") -> Topology:
    return Topology.from_config(
        TopologyConfig.model_validate(
            {
                "sites": [{"name": f"s{i}", "workers": workers} for i in range(sites)],
                "links": {"emulate": emulate, "inter": {"bandwidth_bps": bandwidth_bps, "latency_s": latency_s}},
            }
        )
    )


def _in_namespaces(topo: Topology, mode: str, fn: Callable[..., Any], *args: Any, timeout: float = 600) -> list[Any]:
    """``run_ranks`` on loopback (inprocess) or with each rank in its site's namespace (kernel)."""
    world = topo.world_size
    if mode != "kernel":
        return run_ranks(world, fn, *args, timeout=timeout)
    from geotrain.comm.emulate.kernel import IFNAME, KernelLinks

    with KernelLinks(topo) as k:
        netns = [k.namespaces[topo.site_of(r)] for r in range(world)]
        return run_ranks(world, fn, *args, timeout=timeout, netns=netns, addrs=[k.address(0)], ifname=[IFNAME] * world)


@contextlib.contextmanager
def rank_comm(topo: Topology, mode: str = "inprocess", lanes: int = 1, chunk_bytes: int = 4 * MIB) -> Iterator[Any]:
    """In a rank started by ``run_ranks``: its groups and a :class:`Collectives` over links
    emulated in ``mode`` ('off' for none); everything is closed on exit. Yields (groups, comm)."""
    from geotrain.comm.collectives import Collectives
    from geotrain.comm.emulate.inprocess import WanEmulator
    from geotrain.comm.groups import ProcessGroups

    groups = ProcessGroups.build(topo, "gloo", timeout_s=600, lanes=lanes)
    wan = None if mode == "off" else WanEmulator(topo, groups.me.site_index, os.environ["MASTER_PORT"], mode)
    comm = Collectives(groups, chunk_bytes=chunk_bytes, wan=wan)
    try:
        yield groups, comm
    finally:
        comm.close()
        if wan is not None:
            wan.close(unlink=groups.me.rank == 0)
        groups.destroy()


# --------------------------------------------------------------------------- link


def bench_link(
    speeds: list[float],
    latency_s: float = 0.04,
    seconds: float = 0.5,
    reps: int = 3,
    modes: tuple[str, ...] = ("inprocess", "kernel"),
) -> dict[str, Any]:
    """One-way transfer time of a buffer sized to take about ``seconds`` at each speed."""
    from geotrain.comm.emulate.kernel import unavailable

    points = []
    notes = []
    for mode in modes:
        if mode == "kernel" and (why := unavailable()):
            notes.append(f"kernel mode skipped: {why}")
            continue
        for bw in speeds:
            size = max(64 << 10, int(bw / 8 * seconds)) // 4 * 4
            topo = link_topology(2, 1, bw, latency_s, mode)
            sender, receiver = _in_namespaces(topo, mode, _timed_pair, topo, mode, size, reps)
            times = sorted(r - s for s, r in zip(sender, receiver, strict=True))
            measured = statistics.median(times)
            predicted = size * 8 / bw + latency_s
            points.append(
                {
                    "mode": mode,
                    "bandwidth_bps": bw,
                    "latency_s": latency_s,
                    "bytes": size,
                    "seconds": measured,
                    "predicted_seconds": predicted,
                    "error": measured / predicted - 1,
                    "effective_bps": size * 8 / max(1e-9, measured - latency_s),
                }
            )
    agreement = []
    for bw in speeds:
        by_mode = {p["mode"]: p for p in points if p["bandwidth_bps"] == bw}
        if "inprocess" in by_mode and "kernel" in by_mode:
            agreement.append(
                {"bandwidth_bps": bw, "kernel_over_inprocess": by_mode["kernel"]["seconds"] / by_mode["inprocess"]["seconds"]}
            )
    return {"points": points, "agreement": agreement, "notes": notes}


def _timed_pair(rank: int, topo: Topology, mode: str, size: int, reps: int) -> list[float]:
    """Rank 0 sends ``size`` bytes to rank 1, ``reps`` times after a warm-up. Rank 0 returns its
    start times, rank 1 the times it held the data (same machine clock)."""
    import torch
    import torch.distributed as dist

    with rank_comm(topo, mode) as (groups, comm):
        lane = groups.lanes[0]
        buf = torch.ones(size // 4)
        stamps = []
        for i in range(reps + 1):
            dist.barrier(group=lane.world)
            time.sleep(0.05)  # let the barrier's own messages drain off the link
            t = time.monotonic()
            if rank == 0:
                comm._p2p([(1, buf, None)], [], lane.world)
            else:
                comm._p2p([], [(0, buf)], lane.world)
                t = time.monotonic()
            if i:
                stamps.append(t)
        return stamps


# --------------------------------------------------------------------------- all-reduce


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


# --------------------------------------------------------------------------- wan sweep


def _ddp_steps(cfg: Config, steps: int, budget_s: float) -> int:
    """Steps for a ddp point: all of ``steps`` unless its wide-area time alone would pass ``budget_s``."""
    from geotrain.models import build_model, count_params

    link = cfg.topology.links.inter
    nbytes = 4 * count_params(build_model(cfg.model))  # per direction per step, hierarchical, 2 sites
    per_step = nbytes * 8 / link.bandwidth_bps + 2 * link.latency_s
    return max(10, min(steps, int(budget_s / per_step)))


def wan_config(algorithm: str, bandwidth_bps: float, latency_s: float, steps: int, extra: list[str] | None = None) -> Config:
    """The default config with ``algorithm`` ('streaming-eager': streaming with sync.eager) on the given link."""
    eager = algorithm == "streaming-eager"
    return load_config(
        None,
        [
            f"sync.algorithm={'streaming' if eager else algorithm}",
            f"sync.eager={str(eager).lower()}",
            "run.baseline=none",
            f"train.steps={steps}",
            "train.save_final=false",
            f"topology.links.inter.bandwidth_bps={bandwidth_bps}",
            f"topology.links.inter.latency_s={latency_s}",
            *(extra or []),
        ],
    )


def bench_wan(
    out: Path,
    speeds: list[float],
    latency_s: float = 0.04,
    algorithms: tuple[str, ...] = ("ddp", "diloco", "streaming", "streaming-eager"),
    steps: int = 150,
    ddp_budget_s: float = 60.0,
    extra: list[str] | None = None,
    timeline_bps: float | None = None,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train every algorithm at every speed (equal steps; ddp fewer where the link is too slow to
    finish in ``ddp_budget_s``) and collect utilisation, bytes and loss; then one streaming run
    with a timeline at ``timeline_bps``. ``extra`` overrides apply to every run (the CLI passes
    ``sync.tau``)."""
    from geotrain.launch import launch_local

    points = []
    t_start = time.perf_counter()
    for bw in speeds:
        for alg in algorithms:
            cfg = wan_config(alg, bw, latency_s, steps, extra)
            if alg == "ddp":
                cfg = wan_config(alg, bw, latency_s, _ddp_steps(cfg, steps, ddp_budget_s), extra)
            t0 = time.perf_counter()
            s = launch_local(cfg, out / f"{alg}-{bw:g}", console_print=None)
            points.append(
                {
                    "algorithm": alg,
                    "bandwidth_bps": bw,
                    "latency_s": latency_s,
                    "utilization": s["utilization"],
                    "inter_site_bytes": s["inter_site_bytes"],
                    "final_eval_loss": s["final_eval_loss"],
                    "steps": s["steps"],
                    "H": s["H"],
                    "fragments": s["fragments"],
                    "peak_inter_site_bytes_per_step": s["peak_inter_site_bytes_per_step"],
                    "wan_wait_seconds": s["wan_wait_seconds"],
                    "wall_seconds": s["wall_seconds"],
                }
            )
            progress(
                f"{alg:>9} @ {bw / 1e6:>6g} Mbit/s: utilisation {s['utilization']:.1%}, loss {s['final_eval_loss']:.4f}, "
                f"{s['inter_site_bytes'] / 1e6:.1f} MB ({time.perf_counter() - t0:.0f} s)"
            )
    timeline = None
    if timeline_bps is not None:
        cfg = wan_config("streaming", timeline_bps, latency_s, min(steps, 120), [*(extra or []), "train.timeline=true"])
        launch_local(cfg, out / "timeline-run", console_print=None)
        timeline = str(out / "timeline-run")
    return {
        "points": points,
        "latency_s": latency_s,
        "steps": steps,
        "timeline_run": timeline,
        "targets": wan_targets(points),
        "seconds": time.perf_counter() - t_start,
    }


def wan_targets(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, evaluated on the measured points."""
    by = {(p["algorithm"], p["bandwidth_bps"]): p for p in points}
    slow = sorted({bw for (alg, bw), p in by.items() if alg == "ddp" and p["utilization"] <= 0.20})
    out: dict[str, Any] = {"ddp_at_most_20pct_at_bps": slow}
    if slow and ("streaming", slow[-1]) in by and ("diloco", slow[-1]) in by:
        bw = slow[-1]  # the fastest link where ddp is at most 20% busy
        st, di = by[("streaming", bw)], by[("diloco", bw)]
        eager = by.get(("streaming-eager", bw))
        out.update(
            {
                "at_bps": bw,
                "streaming_eager_utilization": None if eager is None else eager["utilization"],
                "streaming_eager_loss_vs_diloco": None if eager is None else eager["final_eval_loss"] / di["final_eval_loss"] - 1,
                "streaming_utilization": st["utilization"],
                "diloco_utilization": di["utilization"],
                "ddp_utilization": by[("ddp", bw)]["utilization"],
                "streaming_loss_vs_diloco": st["final_eval_loss"] / di["final_eval_loss"] - 1,
                "utilization_met": st["utilization"] >= 0.95,
                "loss_met": abs(st["final_eval_loss"] / di["final_eval_loss"] - 1) <= 0.02,
            }
        )
    peaks = []
    for (alg, bw), p in by.items():
        if alg.startswith("streaming") and ("diloco", bw) in by:
            ratio = p["peak_inter_site_bytes_per_step"] / max(1, by[("diloco", bw)]["peak_inter_site_bytes_per_step"])
            peaks.append(
                {
                    "algorithm": alg,
                    "bandwidth_bps": bw,
                    "ratio": ratio,
                    "one_over_F": 1 / p["fragments"],
                    "met": ratio <= 1 / p["fragments"],
                }
            )
    out["peak_bytes_streaming_over_diloco"] = peaks
    return out


def plot_wan(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for alg in dict.fromkeys(p["algorithm"] for p in result["points"]):
        pts = sorted((p for p in result["points"] if p["algorithm"] == alg), key=lambda p: p["bandwidth_bps"])
        bws = [p["bandwidth_bps"] for p in pts]
        a.plot(bws, [100 * p["utilization"] for p in pts], "o-", label=alg)
        b.plot(bws, [p["inter_site_bytes"] / max(1, p["steps"]) / 1e6 for p in pts], "o-", label=alg)
    for ax in (a, b):
        ax.set_xscale("log")
        ax.set_xlabel(f"inter-site bandwidth (bit/s), latency {result['latency_s'] * 1e3:g} ms")
        ax.grid(alpha=0.3)
        ax.legend()
    a.set_ylabel("compute utilisation (%, min over ranks)")
    a.set_ylim(0, 105)
    b.set_yscale("log")
    b.set_ylabel("inter-site MB per inner step")
    fig.suptitle("geotrain bench wan: 2 sites x 2 workers, default model")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timeline(run_dir: Path, path: Path, window: tuple[float, float] | None = None) -> Path:
    """Per rank, bars of compute and of wide-area network activity over time (OUT/timeline/*.json)."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = sorted((run_dir / "timeline").glob("rank*.json"), key=lambda f: int(f.stem[4:]))
    ranks = [json.loads(f.read_text()) for f in files]
    end = max((b for r in ranks for _, b in r["compute"]), default=1.0)
    lo, hi = window or (end * 0.4, end * 0.4 + min(6.0, end * 0.6))
    fig, ax = plt.subplots(figsize=(11, 1 + 0.8 * len(ranks)))
    for i, r in enumerate(ranks):
        y = len(ranks) - 1 - i
        comp = [(a, b - a) for a, b in r["compute"] if b > lo and a < hi]
        net = [(a, b - a) for a, b in r["network"] if b > lo and a < hi]
        ax.broken_barh(comp, (y + 0.05, 0.4), facecolors="tab:blue", label="compute" if i == 0 else None)
        ax.broken_barh(net, (y + 0.5, 0.4), facecolors="tab:orange", alpha=0.6, label="wide-area transfer" if i == 0 else None)
    ax.set_yticks([len(ranks) - 1 - i + 0.5 for i in range(len(ranks))], [f"rank {r['rank']}" for r in ranks])
    ax.set_xlim(lo, hi)
    ax.set_xlabel("seconds since the first step")
    ax.legend(loc="upper right")
    ax.set_title("Streaming DiLoCo: fragments cross the WAN in the background while compute continues")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- tables


def _bps(v: float) -> str:
    for unit, f in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if v >= f:
            return f"{v / f:g} {unit}"
    return f"{v:g} bit/s"


def print_link(result: dict[str, Any], console: Any) -> None:
    from geotrain.bench import _table

    t = _table(
        "emulated link: one-way transfer time vs size/bandwidth + latency",
        ["mode", "link", "latency", "bytes", "measured", "predicted", "error", "effective"],
    )
    for p in result["points"]:
        t.add_row(
            p["mode"], _bps(p["bandwidth_bps"]), f"{p['latency_s'] * 1e3:g} ms", f"{p['bytes']:,}", f"{p['seconds'] * 1e3:.1f} ms",
            f"{p['predicted_seconds'] * 1e3:.1f} ms", f"{p['error']:+.1%}", _bps(p["effective_bps"]),
        )  # fmt: skip
    console.print(t)
    for a in result["agreement"]:
        console.print(f"{_bps(a['bandwidth_bps'])}: kernel / in-process transfer time = {a['kernel_over_inprocess']:.3f}")
    for note in result["notes"]:
        console.print(f"note: {note}")


def print_allreduce(result: dict[str, Any], console: Any) -> None:
    from geotrain.bench import _table

    pts = result["points"]
    t = _table(
        f"all-reduce over emulated links: {result['sites']} sites x {result['workers_per_site']} workers, "
        f"{_bps(pts[0]['link_bps'])}, {pts[0]['latency_s'] * 1e3:g} ms, {result['lanes']} lanes x {result['chunk_bytes'] >> 20} MiB chunks",
        ["algorithm", "size", "time", "α-β predicted", "busbw", "link utilisation", "inter-site bytes"],
    )
    for p in pts:
        t.add_row(
            p["algorithm"], f"{p['bytes'] / MIB:g} MiB", f"{p['seconds'] * 1e3:.0f} ms", f"{p['predicted_seconds'] * 1e3:.0f} ms",
            _bps(p["busbw_bps"]), f"{p['link_utilization']:.1%}", f"{p['inter_site_bytes'] / 1e6:.1f} MB",
        )  # fmt: skip
    console.print(t)
    for size in dict.fromkeys(p["bytes"] for p in pts):
        h = next(p for p in pts if p["bytes"] == size and p["algorithm"] == "hierarchical")
        f = next(p for p in pts if p["bytes"] == size and p["algorithm"] == "flat")
        console.print(
            f"{size / MIB:g} MiB: hierarchical {f['seconds'] / h['seconds']:.2f}x faster than flat "
            f"(α-β model: {f['predicted_seconds'] / h['predicted_seconds']:.2f}x)"
        )


def print_wan(result: dict[str, Any], console: Any) -> None:
    from geotrain.bench import _table

    t = _table(
        f"bench wan: latency {result['latency_s'] * 1e3:g} ms",
        ["link", "algorithm", "steps", "utilisation", "wide-area wait", "inter-site bytes", "peak bytes/step", "final eval loss"],
    )
    for p in result["points"]:
        t.add_row(
            _bps(p["bandwidth_bps"]), p["algorithm"], str(p["steps"]), f"{p['utilization']:.1%}", f"{p['wan_wait_seconds']:.1f} s",
            f"{p['inter_site_bytes'] / 1e6:.1f} MB", f"{p['peak_inter_site_bytes_per_step'] / 1e6:.2f} MB", f"{p['final_eval_loss']:.4f}",
        )  # fmt: skip
    console.print(t)
    tg = result["targets"]
    if "at_bps" in tg:
        console.print(
            f"at {_bps(tg['at_bps'])} (ddp {tg['ddp_utilization']:.1%}): streaming {tg['streaming_utilization']:.1%} "
            f"(target >= 95%: {'met' if tg['utilization_met'] else 'MISSED'}), diloco {tg['diloco_utilization']:.1%}; "
            f"streaming loss vs diloco {tg['streaming_loss_vs_diloco']:+.2%} (target within 2%: {'met' if tg['loss_met'] else 'MISSED'})"
        )
        if tg["streaming_eager_utilization"] is not None:
            console.print(
                f"  eager variant: utilisation {tg['streaming_eager_utilization']:.1%}, loss vs diloco {tg['streaming_eager_loss_vs_diloco']:+.2%}"
            )
    for p in tg["peak_bytes_streaming_over_diloco"]:
        console.print(
            f"{_bps(p['bandwidth_bps'])}: {p['algorithm']} peak bytes/step = {p['ratio']:.3f} x diloco's "
            f"(target <= 1/F = {p['one_over_F']:.3f}: {'met' if p['met'] else 'MISSED'})"
        )
    console.print(f"sweep took {result['seconds'] / 60:.1f} min")
