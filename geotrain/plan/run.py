"""Assemble a plan from a scenario: every section, the paper comparison, the report and plots."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from geotrain.errors import ConfigError
from geotrain.netsim.sizing import hosts_capacity, size_fat_tree, tier_ports
from geotrain.plan.architecture import architecture
from geotrain.plan.facility import Rack, compute_budget, facility
from geotrain.plan.layout import layout
from geotrain.plan.memory import memory
from geotrain.plan.scaling import LAWS, optimal
from geotrain.plan.scenario import PlanScenario
from geotrain.plan.step import step_times
from geotrain.plan.strategies import STREAMING_TABLE4, TARGETS, required_bps, strategies


def _rack(sc: PlanScenario) -> Rack:
    r = sc.facility.rack
    return Rack(
        name=r.name,
        gpus=r.gpus,
        price_usd=r.price_usd,
        power_watts=r.power_watts,
        dense_flops=tuple((k, v * 1e15) for k, v in r.dense_pflops.items()),
        hbm_bytes=r.hbm_tb * 1e12,
        scale_up_bytes_per_s=r.scale_up_gbytes_per_s * 1e9,
        nic_bps=r.nic_gbps * 1e9,
    )


def _get(d: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def run_plan(sc: PlanScenario) -> dict[str, Any]:
    t0 = time.perf_counter()
    rack = _rack(sc)
    f = sc.facility
    budget_usd = f.budget_usd if f.racks is None else f.racks * rack.price_usd / f.compute_share
    try:
        fac = facility(budget_usd, f.compute_share, rack, f.precision, f.sparsity, f.non_compute_overhead)
    except ValueError as exc:  # e.g. a budget that buys no rack: the input's fault, reported as such
        raise ConfigError(f"facility: {exc}") from None
    flops = compute_budget(fac["peak_flops"], sc.budget.utilization, sc.budget.months)
    all_laws = {law: optimal(law, flops, sc.budget.tokens_per_param) for law in LAWS}
    scal = all_laws[sc.budget.law]
    m = sc.model
    arch = architecture(m.layers, m.hidden, m.heads, m.vocab, m.seq_len)
    p = sc.precision
    mem = memory(
        arch["params"],
        m.layers,
        m.hidden,
        m.heads,
        m.seq_len,
        m.micro_batch,
        p.weight_bytes,
        p.grad_bytes,
        p.optimizer_bytes,
        p.activation_bytes,
        p.recompute,
    )
    static = mem["params_bytes"] + mem["grads_bytes"] + mem["optimizer_bytes"]
    lay = layout(
        m.layers, static, mem["activations_bytes"], fac["racks"], rack.gpus, rack.hbm_bytes, sc.parallel.tensor_parallel_max
    )
    notes: list[str] = list(arch["notes"])
    step: dict[str, Any] | None = None
    if lay["fits"]:
        step = step_times(
            arch,
            lay,
            fac["gpu_peak_flops"],
            sc.parallel.mfu,
            p.wire_bytes,
            p.grad_bytes,
            m.micro_batch,
            rack.scale_up_bytes_per_s,
            rack.nic_bps / 8,
            rack.gpus,
            sc.sites.count,
            sc.sites.rtt_ms / 1e3,
            None if sc.sites.wan_budget_ms is None else sc.sites.wan_budget_ms / 1e3,
        )
        if lay["memory_per_gpu_bytes"] > lay["gpu_hbm_bytes"]:
            notes.append(
                f"per-GPU memory {lay['memory_per_gpu_bytes'] / 1e9:.0f} GB exceeds one GPU's "
                f"{lay['gpu_hbm_bytes'] / 1e9:.0f} GB; the layout fits the rack's pooled HBM only"
            )
    else:
        notes.append(f"model does not fit: {lay['reason']}")
    # network: one fat tree per site for the GPUs it holds
    n = sc.network
    hosts_per_site = -(-fac["gpus"] // sc.sites.count)
    try:
        tree = size_fat_tree(
            hosts_per_site,
            n.radix,
            n.tiers,
            oversubscription=n.oversubscription,
            ports=n.ports,
            port_bps=rack.nic_bps,
            rails=n.rails,
        ).to_dict()
        tree["fits"] = True
        tree["links"] = tree["switch_links"]
    except ValueError as exc:
        tree = {"fits": False, "reason": str(exc), "tiers": n.tiers, "hosts": hosts_per_site}
        notes.append(f"scale-out network: {exc}")
    network = {
        "hosts_per_site": hosts_per_site,
        "fat_tree": tree,
        "two_tier_hosts_full": hosts_capacity(tier_ports(n.radix, 2)),
        "two_tier_hosts_4to1": hosts_capacity(tier_ports(n.radix, 2, [4.0])),
    }
    s = sc.strategies
    step_s = s.step_seconds or (3 * step["layer_forward_seconds"] * m.layers if step else 1.0)
    strat = strategies(
        s.params or arch["params"],
        s.layers or m.layers,
        step_s,
        sc.sites.count,
        sc.sites.link_gbps * 1e9,
        sc.sites.rtt_ms / 1e3,
        s.H,
        s.tau,
        s.bits,
        s.target,
    )
    out: dict[str, Any] = {
        "scenario": sc.name,
        "facility": fac,
        "budget": {"compute_flops": flops, "months": sc.budget.months, "utilization": sc.budget.utilization},
        "scaling": scal,
        "scaling_all_laws": all_laws,
        "model": arch,
        "memory": mem,
        "layout": lay,
        "step": step,
        "network": network,
        "strategies": strat["rows"],
        "strategy_params": {
            "params": s.params or arch["params"],
            "step_seconds": step_s,
            "fragments": strat["fragments"],
            "tau": strat["tau"],
            "H": s.H,
            "link_bps": sc.sites.link_gbps * 1e9,
            "rtt_s": sc.sites.rtt_ms / 1e3,
        },
        "recommendation": strat["recommendation"],
        "notes": notes,
    }
    if s.compare_streaming_table4:
        out["streaming_table4"] = _table4(s)
    if sc.paper is not None:
        rows = []
        for key, theirs in sc.paper.figures.items():
            ours = _get(out, key)
            rows.append(
                {
                    "key": key,
                    "paper": theirs,
                    "ours": ours,
                    "ratio": (ours / theirs) if isinstance(ours, (int, float)) and theirs else None,
                }
            )
        out["paper"] = {"source": sc.paper.source, "figures": rows, "notes": sc.paper.notes}
    out["elapsed_seconds"] = time.perf_counter() - t0
    return out


def _table4(s: Any) -> list[dict[str, Any]]:
    """Our closed form on Streaming DiLoCo's Table 4 settings (2 sites, H=100, 3-layer fragments)."""
    sizes = {"1B": (1e9, 24), "10B": (10e9, 48), "100B": (100e9, 108)}  # layer counts assumed (not in the table)
    rows = []
    for name, (params, layers) in sizes.items():
        ref: dict[str, Any] = STREAMING_TABLE4[name]
        for alg in ("dp", "diloco", "streaming", "streaming_fp4"):
            ours = [
                required_bps(alg, t, params, ref["step_s"], 2, 0.0, s.H, -(-layers // 3), s.tau, s.bits) / 1e9 for t in TARGETS
            ]
            rows.append({"model": name, "algorithm": alg, "theirs_gbps": list(ref[alg]), "ours_gbps": ours})
    return rows


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if x == 0 or 1e-3 <= abs(x) < 1e6:
            return f"{x:,.4g}"
        return f"{x:.4g}"
    if isinstance(x, int):
        return f"{x:,}" if abs(x) < 1e9 else f"{x:.4g}"
    return str(x)


def print_plan(out: dict[str, Any], console: Console) -> None:
    console.print(f"[bold]geotrain plan: {out['scenario']}[/bold]")

    def section(title: str, rows: list[tuple[str, Any]]) -> None:
        t = Table(title=title, title_justify="left", show_header=False)
        t.add_column("quantity")
        t.add_column("value", justify="right")
        for k, v in rows:
            t.add_row(k, _fmt(v))
        console.print(t)

    f = out["facility"]
    section(
        "1. Facility",
        [
            ("compute budget (USD)", f["compute_usd"]),
            ("racks", f["racks"]),
            ("GPUs", f["gpus"]),
            ("compute power (W)", f["power_watts"]),
            ("with non-compute overhead (W)", f["total_power_watts"]),
            (f"peak FLOP/s ({f['precision']}{', sparse' if f['sparsity'] else ''})", f["peak_flops"]),
            ("HBM (bytes)", f["hbm_bytes"]),
        ],
    )
    b, sl = out["budget"], out["scaling"]
    section(
        "2. Budget and scaling law",
        [
            ("compute budget (FLOPs)", b["compute_flops"]),
            ("law", sl["law"]),
            ("constants", ", ".join(f"{k}={_fmt(v)}" for k, v in sl["constants"].items())),
            ("compute-optimal parameters", sl["params"]),
            ("tokens", sl["tokens"]),
            ("tokens per parameter", sl["tokens_per_param"]),
            ("predicted loss", sl["loss"]),
        ],
    )
    t = Table(title="   every law at this budget", title_justify="left")
    for c in ("law", "parameters", "tokens", "tokens/param", "loss"):
        t.add_column(c, justify="right")
    for law, r in out["scaling_all_laws"].items():
        t.add_row(law, _fmt(r["params"]), _fmt(r["tokens"]), _fmt(r["tokens_per_param"]), _fmt(r["loss"]))
    console.print(t)
    a = out["model"]
    section(
        "3. Architecture",
        [
            ("layers x hidden x heads", f"{a['layers']} x {a['hidden']} x {a['heads']}"),
            ("parameters", a["params"]),
            ("forward FLOPs per layer (one sequence)", a["layer_forward_flops"]),
            ("forward FLOPs per sequence", a["model_forward_flops_per_sequence"]),
            ("training FLOPs per token", a["training_flops_per_token"]),
        ],
    )
    mm = out["memory"]
    section(
        "4. Memory (whole model)",
        [
            ("weights", mm["params_bytes"]),
            ("gradients", mm["grads_bytes"]),
            ("optimizer", mm["optimizer_bytes"]),
            ("activations", mm["activations_bytes"]),
            ("total", mm["total_bytes"]),
        ],
    )
    lay = out["layout"]
    if lay["fits"]:
        section(
            "5. 3D-parallel layout",
            [
                ("layers per rack (same layer, different replicas)", lay["layers_per_rack"]),
                ("tensor parallel", lay["tensor_parallel"]),
                ("pipeline parallel", lay["pipeline_parallel"]),
                ("data parallel (replicas)", lay["data_parallel"]),
                ("memory per layer (bytes)", lay["memory_per_layer_bytes"]),
                ("memory per GPU (bytes)", lay["memory_per_gpu_bytes"]),
                ("scale-out DP peers", lay["dp_peers_scale_out"]),
            ],
        )
    else:
        console.print(f"[bold red]5. 3D-parallel layout: DOES NOT FIT[/bold red]: {lay['reason']}")
    st = out["step"]
    if st:
        section("6. Step time and communication (seconds)", [(k.replace("_", " "), v) for k, v in st.items()])
    nt = out["network"]
    ft = nt["fat_tree"]
    section(
        "7. Scale-out network per site",
        [("hosts per site", nt["hosts_per_site"]), ("fits", ft["fits"])]
        + (
            [
                ("tiers", ft["tiers"]),
                ("switch boxes", ft["switches"]),
                ("chips", ft["chips"]),
                ("switch links", ft["switch_links"]),
                ("optics (USD)", ft["optics_usd"]),
            ]
            if ft["fits"]
            else [("reason", ft["reason"])]
        )
        + [("two tiers at this radix: full bisection", nt["two_tier_hosts_full"]), ("two tiers, 4:1", nt["two_tier_hosts_4to1"])],
    )
    t = Table(title="8. Low-communication strategies across sites (required Gbit/s for utilisation)", title_justify="left")
    for c in ("algorithm", "bits", "H", "fragments", "90%", "95%", "99%", "predicted on this link"):
        t.add_column(c, justify="right")
    for r in out["strategies"]:
        req = [v / 1e9 for v in r["required_bps"].values()]
        t.add_row(
            r["algorithm"],
            _fmt(r["bits"]),
            _fmt(r["H"]),
            _fmt(r["fragments"]),
            *(_fmt(x) for x in req),
            f"{r['predicted_utilization']:.1%}",
        )
    console.print(t)
    rec = out["recommendation"]
    console.print(
        f"Recommendation: [bold]{rec['algorithm']}[/bold], H={rec['H']}, fragments={rec['fragments']}, codec {rec['codec']}: "
        f"predicted utilisation {rec['predicted_utilization']:.1%} "
        f"({'meets' if rec['meets_target'] else 'MISSES'} the {rec['target']:.0%} target)"
    )
    if "streaming_table4" in out:
        t = Table(title="Streaming DiLoCo Table 4 (theirs) vs our closed form, Gbit/s for 90/95/99%", title_justify="left")
        for c in ("model", "algorithm", "theirs", "ours"):
            t.add_column(c, justify="right")
        for r in out["streaming_table4"]:
            t.add_row(
                r["model"],
                r["algorithm"],
                " / ".join(f"{x:g}" for x in r["theirs_gbps"]),
                " / ".join(f"{x:.1f}" for x in r["ours_gbps"]),
            )
        console.print(t)
    if "paper" in out:
        t = Table(title=f"Ours vs the paper ({out['paper']['source']})", title_justify="left")
        for c in ("quantity", "paper", "ours", "ours / paper"):
            t.add_column(c, justify="right" if c != "quantity" else "left")
        for r in out["paper"]["figures"]:
            t.add_row(r["key"], _fmt(r["paper"]), _fmt(r["ours"]), f"{r['ratio']:.3f}" if r["ratio"] is not None else "-")
        console.print(t)
        for note in out["paper"]["notes"]:
            console.print(f"  note: {note}", highlight=False)
    for note in out["notes"]:
        console.print(f"  [yellow]warning:[/yellow] {note}", highlight=False)
    console.print(f"elapsed {out['elapsed_seconds'] * 1e3:.1f} ms")


def plot_plan(sc: PlanScenario, out: dict[str, Any], directory: Path) -> list[Path]:
    """model size vs training months (paper Figure 1a) and bandwidth vs utilisation per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    directory.mkdir(parents=True, exist_ok=True)
    months = np.arange(1, 25)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    peak = out["facility"]["peak_flops"]
    for law in LAWS:
        ax.plot(
            months,
            [
                optimal(law, compute_budget(peak, sc.budget.utilization, float(mo)), sc.budget.tokens_per_param)["params"] / 1e12
                for mo in months
            ],
            label=law,
            lw=2.5 if law == sc.budget.law else 1.2,
        )
    ax.set_xlabel("training months")
    ax.set_ylabel("compute-optimal parameters (T)")
    ax.set_title(f"{sc.name}: model size vs training time")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    p1 = directory / "model_size_vs_months.png"
    fig.savefig(p1, dpi=120)
    plt.close(fig)
    sp = out["strategy_params"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    us = np.linspace(0.5, 0.995, 60)
    for alg in ("dp", "diloco", "streaming", "streaming_fp4"):
        bps = [
            required_bps(
                alg,
                u,
                sp["params"],
                sp["step_seconds"],
                sc.sites.count,
                sp["rtt_s"],
                sp["H"],
                sp["fragments"],
                sp["tau"],
                sc.strategies.bits,
            )
            / 1e9
            for u in us
        ]
        ax.plot(bps, us * 100, label=alg)
    ax.axvline(sp["link_bps"] / 1e9, color="k", ls="--", lw=1, label="this link")
    ax.set_xscale("log")
    ax.set_xlabel("inter-site bandwidth (Gbit/s)")
    ax.set_ylabel("compute utilisation (%)")
    ax.set_title(f"{sc.name}: bandwidth needed per strategy")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    p2 = directory / "bandwidth_vs_utilization.png"
    fig.savefig(p2, dpi=120)
    plt.close(fig)
    return [p1, p2]
