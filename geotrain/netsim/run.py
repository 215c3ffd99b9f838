"""Run a ``geotrain netsim`` scenario: size the fabric, simulate every routing, report, plot.

JSON schema: docs/NETSIM.md. The "optimal" time of a phase is the cut bound: every flow split
evenly over all its shortest paths, which on a fat tree puts exactly (traffic leaving a subtree) /
(its up-links) on every up-link, the least any routing can; optimal = startup + busiest link's
bytes / its capacity + the longest base RTT. Spraying reaches it whenever the max-min allocation
of the sprayed flows is not itself the bottleneck (always for permutations on full bisection).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from geotrain.errors import ConfigError
from geotrain.netsim.engine import max_min_rates, simulate
from geotrain.netsim.fabric import Fabric, build_fabric
from geotrain.netsim.routing import FlowSet, route, spray
from geotrain.netsim.scenario import Scenario, TreeConfig
from geotrain.netsim.sizing import size_fat_tree
from geotrain.netsim.traffic import Phase, build_phases

SCOPE = (
    "Fluid flow-level model: rates are max-min fair and change only when a flow completes. It shows "
    "where routing wastes capacity (hash collisions) but not incast, PFC pauses, buffer occupancy, "
    "congestion-control dynamics (slow start, reaction delay), retransmissions or reordering; real "
    "single-path transports usually do worse than its ECMP figure, and real multipath ones a little "
    "worse than its spray figure."
)


def size_tree(t: TreeConfig) -> dict[str, Any]:
    return size_fat_tree(
        t.hosts,
        t.radix,
        t.tiers,
        oversubscription=t.oversubscription,
        ports=t.ports,
        port_bps=t.port_gbps * 1e9,
        rails=t.rails,
        transceiver_usd=t.cost.transceiver_usd,
        transceivers_per_link=t.cost.transceivers_per_link,
        host_links_optical=t.cost.host_links_optical,
        switch_usd=t.cost.switch_usd,
    ).to_dict()


@dataclass
class FlowRecord:
    """Every flow of one run of the costliest phase (first trial) and its completion time."""

    phase: str
    src: np.ndarray
    dst: np.ndarray
    size: np.ndarray
    fct: np.ndarray


@dataclass
class _RoutingRun:
    makespans: list[float] = field(default_factory=list)
    optimals: list[float] = field(default_factory=list)
    mains: list[dict[str, Any]] = field(default_factory=list)  # the costliest phase of every trial
    flows: FlowRecord | None = None  # first trial, the costliest phase
    seconds: float = 0.0

    def mean(self, key: str) -> float:
        return float(np.mean([m[key] for m in self.mains]))


def _on_rails(fabric: Fabric, make: Any, rails: int) -> FlowSet:
    """Route every flow once per rail (1/rails of its bytes on each independent plane)."""
    sets = [make() for _ in range(rails)]
    if rails == 1:
        return sets[0]
    base = sets[0]
    return FlowSet(
        size=np.concatenate([s.size for s in sets]),
        parent=np.concatenate([s.parent for s in sets]),
        hops=np.concatenate([s.hops for s in sets]),
        ent_flow=np.concatenate([s.ent_flow + r * base.num_flows for r, s in enumerate(sets)]),
        ent_link=np.concatenate([s.ent_link + r * fabric.num_links for r, s in enumerate(sets)]),
        ent_weight=np.concatenate([s.ent_weight for s in sets]),
        num_parents=base.num_parents,
    )


def _initial_rates(flows: FlowSet, cap: np.ndarray) -> np.ndarray:
    """Max-min rate of every traffic flow while all flows are active."""
    r = max_min_rates(flows.ent_flow, flows.ent_link, flows.ent_weight, cap, flows.num_flows)
    return np.bincount(flows.parent, r, minlength=flows.num_parents)


def _phase(
    sc: Scenario,
    fabric: Fabric,
    cap: np.ndarray,
    ph: Phase,
    routing: str,
    rng: np.random.Generator,
    yardstick: dict[tuple[int, int, int], tuple[float, np.ndarray]],
    key: tuple[int, int, int],
) -> dict[str, Any]:
    tr = sc.transport
    rails = sc.fabric.rails
    share = ph.size / rails

    # spraying holds the most routing entries: check the bound before building anything
    per_flow = max(2 + 2 * sum(fabric.planes[1:]), 2 * fabric.tiers * (tr.subflows if routing == "ecmp_subflows" else 1))
    need = ph.num_flows * rails * per_flow
    if need > sc.max_entries:
        raise ConfigError(
            f"max_entries: {ph.num_flows:,} flows on this fabric need up to {need:,} routing entries "
            f"(limit {sc.max_entries:,}); use fewer hosts or a smaller group_size"
        )
    ideal = None
    if key not in yardstick:  # the same phase under every routing: its yardstick is computed once
        ideal = _on_rails(fabric, lambda: spray(fabric, ph.src, ph.dst, share), rails)
        optimal = tr.startup_s + float((ideal.link_bytes(cap.size) / cap).max()) + float(2 * ideal.hops.max() * tr.hop_latency_s)
        # rates each flow gets with ideal spraying while all are active: the throughput yardstick
        yardstick[key] = (optimal, _initial_rates(ideal, cap))
    optimal, ideal_rate = yardstick[key]
    if routing == "spray":
        routed = ideal if ideal is not None else _on_rails(fabric, lambda: spray(fabric, ph.src, ph.dst, share), rails)
    else:
        routed = _on_rails(fabric, lambda: route(fabric, routing, ph.src, ph.dst, share, rng, tr.subflows), rails)
    res = simulate(routed, cap, tr.hop_latency_s, tr.startup_s)
    loads = routed.link_flows(cap.size)
    link_bytes = routed.link_bytes(cap.size)
    switch_links = np.tile(fabric.link_tier > 0, rails)
    used = link_bytes > 0
    drain = max(res.makespan - tr.startup_s, 1e-30)
    return {
        "makespan": res.makespan,
        "optimal": optimal,
        "fct": res.fct,
        "throughput": float(np.mean(res.initial_rate / ideal_rate)),
        "max_load": float(loads.max()),
        "used": float(used[switch_links].mean()) if switch_links.any() else 1.0,
        "util": float(np.mean(link_bytes[used] / (cap[used] * drain))),
    }


def run_scenario(sc: Scenario) -> tuple[dict[str, Any], dict[str, FlowRecord]]:
    """Size and simulate ``sc``. Returns (JSON-ready result, per-routing flows with completion times)."""
    t_start = time.perf_counter()
    f = sc.fabric
    fabric = build_fabric(f.hosts, f.tier_ports(), f.port_gbps * 1e9 / f.rails)
    cap = np.tile(fabric.link_cap, f.rails)
    topology = size_tree(f)
    topology["simulated"] = {"links": int(cap.size), "switches": fabric.num_switches * f.rails, "planes": f.rails}
    entries = sc.traffic
    results: list[dict[str, Any]] = []
    flows: dict[str, FlowRecord] = {}
    traffic_doc: list[dict[str, Any]] = [
        {
            "name": tr.name or tr.pattern,
            "pattern": tr.pattern,
            "message_bytes": tr.bytes,
            "message_from": "model" if tr.model is not None else "message_bytes",
            "count": tr.count,
            "on_fabric": tr.on_fabric,
            "phases": [],
        }
        for tr in entries
    ]
    yardstick: dict[tuple[int, int, int], tuple[float, np.ndarray]] = {}
    for routing in sc.transport.routings:
        run = _RoutingRun()
        per_entry = np.zeros((sc.trials, len(entries)))
        t0 = time.perf_counter()
        for trial in range(sc.trials):
            rng = np.random.default_rng([sc.seed, trial])
            makespan = optimal = 0.0
            main: tuple[float, dict[str, Any], Phase] | None = None
            for e, tr in enumerate(entries):
                if not tr.on_fabric:
                    continue
                phases = build_phases(tr.pattern, f.hosts, tr.bytes, rng, tr.group_size, tr.in_group_on_fabric)
                if not traffic_doc[e]["phases"]:
                    traffic_doc[e]["phases"] = [
                        {"name": p.name, "flows": p.num_flows, "bytes_per_flow": float(p.size[0]), "repeat": p.repeat}
                        for p in phases
                    ]
                outs = [_phase(sc, fabric, cap, p, routing, rng, yardstick, (e, trial, i)) for i, p in enumerate(phases)]
                per_entry[trial, e] = sum(o["makespan"] * p.repeat for o, p in zip(outs, phases, strict=True))
                makespan += tr.count * per_entry[trial, e]
                optimal += tr.count * sum(o["optimal"] * p.repeat for o, p in zip(outs, phases, strict=True))
                for o, p in zip(outs, phases, strict=True):
                    cost = o["makespan"] * p.repeat * tr.count
                    if main is None or cost > main[0]:
                        main = (cost, o, p)
            assert main is not None  # the scenario has an exchange on the fabric
            run.makespans.append(makespan)
            run.optimals.append(optimal)
            run.mains.append(main[1])
            if run.flows is None:
                run.flows = FlowRecord(main[2].name, main[2].src, main[2].dst, main[2].size, main[1]["fct"])
        run.seconds = time.perf_counter() - t0
        assert run.flows is not None
        flows[routing] = run.flows
        mk, opt = float(np.mean(run.makespans)), float(np.mean(run.optimals))
        results.append(
            {
                "routing": routing,
                "makespan_seconds": mk,
                "makespan_seconds_min": float(np.min(run.makespans)),
                "makespan_seconds_max": float(np.max(run.makespans)),
                "optimal_seconds": opt,
                "ratio_to_optimal": mk / opt,
                "per_traffic_seconds": {
                    traffic_doc[e]["name"]: float(per_entry[:, e].mean()) for e, tr in enumerate(entries) if tr.on_fabric
                },
                "mean_throughput_fraction": run.mean("throughput"),
                "max_link_load": run.mean("max_load"),
                "switch_links_used_fraction": run.mean("used"),
                "mean_link_utilization": run.mean("util"),
                "fct_percentiles_seconds": {str(q): float(np.percentile(run.flows.fct, q)) for q in (1, 10, 50, 90, 99, 100)},
                "trials": sc.trials,
                "wall_seconds": run.seconds,
            }
        )
    out: dict[str, Any] = {
        "scenario": sc.name,
        "topology": topology,
        "sizing": [
            {"name": c.name, "ours": size_tree(c), "paper": c.paper.model_dump() if c.paper else None, "note": c.note}
            for c in sc.sizing
        ],
        "traffic": traffic_doc,
        "transport": sc.transport.model_dump(),
        "results": results,
        "paper": sc.paper.model_dump() if sc.paper else None,
        "scope": SCOPE,
        "elapsed_seconds": time.perf_counter() - t_start,
    }
    return out, flows


def write_flows_csv(flows: dict[str, FlowRecord], path: Path) -> None:
    """One line per flow and routing: routing, phase, src, dst, bytes, fct_seconds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write("routing,phase,src,dst,bytes,fct_seconds\n")
        for routing, rec in flows.items():
            for s, d, b, t in zip(rec.src.tolist(), rec.dst.tolist(), rec.size.tolist(), rec.fct.tolist(), strict=True):
                f.write(f"{routing},{rec.phase},{s},{d},{b:.6g},{t:.9g}\n")


def plot_fct_cdf(flows: dict[str, FlowRecord], path: Path, title: str) -> None:
    """CDF of flow completion times per routing (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for routing, rec in flows.items():
        x = np.sort(rec.fct) * 1e3
        ax.step(x, np.arange(1, x.size + 1) / x.size, where="post", label=routing)
    ax.set_xlabel("flow completion time (ms)")
    ax.set_ylabel("fraction of flows")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
