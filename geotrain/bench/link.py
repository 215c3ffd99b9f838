"""``geotrain bench link``: one buffer sent from site A to site B over an emulated link; the time
from the sender's start to the receiver holding the data (both read the same CLOCK_MONOTONIC, so
no ack is needed), against size/bandwidth + latency, at several speeds, in-process and (as
root) kernel mode.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from geotrain.bench.common import bps, in_namespaces, link_topology, table
from geotrain.comm.session import rank_comm
from geotrain.comm.topology import Topology


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
            sender, receiver = in_namespaces(topo, mode, _timed_pair, topo, mode, size, reps)
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


def print_link(result: dict[str, Any], console: Any) -> None:
    t = table(
        "emulated link: one-way transfer time vs size/bandwidth + latency",
        ["mode", "link", "latency", "bytes", "measured", "predicted", "error", "effective"],
    )
    for p in result["points"]:
        t.add_row(
            p["mode"], bps(p["bandwidth_bps"]), f"{p['latency_s'] * 1e3:g} ms", f"{p['bytes']:,}", f"{p['seconds'] * 1e3:.1f} ms",
            f"{p['predicted_seconds'] * 1e3:.1f} ms", f"{p['error']:+.1%}", bps(p["effective_bps"]),
        )  # fmt: skip
    console.print(t)
    for a in result["agreement"]:
        console.print(f"{bps(a['bandwidth_bps'])}: kernel / in-process transfer time = {a['kernel_over_inprocess']:.3f}")
    for note in result["notes"]:
        console.print(f"note: {note}")
