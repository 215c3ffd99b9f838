"""What the benchmarks share: timing, tables, link topologies, ranks in namespaces."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from geotrain.comm.procs import run_ranks
from geotrain.comm.session import MIB
from geotrain.comm.topology import Topology
from geotrain.config import TopologyConfig

__all__ = ["MIB", "bps", "in_namespaces", "link_topology", "median_seconds", "table"]


def median_seconds(fn: Callable[[], Any], reps: int) -> float:
    """Median wall time of ``reps`` calls of ``fn`` after one warm-up call."""
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def table(title: str, columns: list[str]) -> Any:
    """A rich table with right-aligned columns."""
    from rich.table import Table

    t = Table(title=title)
    for col in columns:
        t.add_column(col, justify="right")
    return t


def link_topology(sites: int, workers: int, bandwidth_bps: float, latency_s: float, emulate: str = "inprocess") -> Topology:
    return Topology.from_config(
        TopologyConfig.model_validate(
            {
                "sites": [{"name": f"s{i}", "workers": workers} for i in range(sites)],
                "links": {"emulate": emulate, "inter": {"bandwidth_bps": bandwidth_bps, "latency_s": latency_s}},
            }
        )
    )


def in_namespaces(topo: Topology, mode: str, fn: Callable[..., Any], *args: Any, timeout: float = 600) -> list[Any]:
    """``run_ranks`` on loopback (inprocess) or with each rank in its site's namespace (kernel)."""
    world = topo.world_size
    if mode != "kernel":
        return run_ranks(world, fn, *args, timeout=timeout)
    from geotrain.comm.emulate.kernel import IFNAME, KernelLinks

    with KernelLinks(topo) as k:
        netns = [k.namespaces[topo.site_of(r)] for r in range(world)]
        return run_ranks(world, fn, *args, timeout=timeout, netns=netns, addrs=[k.address(0)], ifname=[IFNAME] * world)


def bps(v: float) -> str:
    for unit, f in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if v >= f:
            return f"{v / f:g} {unit}"
    return f"{v:g} bit/s"
