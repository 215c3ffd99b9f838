"""``geotrain plan``'s console report and plots (the numbers come from :mod:`.run`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from geotrain.plan.facility import compute_budget
from geotrain.plan.scaling import LAWS, optimal
from geotrain.plan.scenario import PlanScenario
from geotrain.plan.strategies import required_bps


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
    _print_layout(out, section, console)
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


def _print_layout(out: dict[str, Any], section: Any, console: Console) -> None:
    lay, found = out["layout"], out.get("search")
    if not lay["fits"]:
        console.print(f"[bold red]5. 3D-parallel layout: DOES NOT FIT[/bold red]: {lay['reason']}")
    elif lay["policy"] == "paper":
        section(
            "5. 3D-parallel layout (policy: paper)",
            [
                ("layers per rack (same layer, different replicas)", lay["layers_per_rack"]),
                ("tensor parallel", lay["tensor_parallel"]),
                ("pipeline parallel", lay["pipeline_parallel"]),
                ("data parallel (replicas)", lay["data_parallel"]),
                ("memory per layer (bytes)", lay["memory_per_layer_bytes"]),
                ("memory per GPU (bytes)", lay["memory_per_gpu_bytes"]),
                ("scale-out DP peers", lay["dp_peers_scale_out"]),
                ("micro-batches per step (global batch)", lay["micro_batches"]),
                ("pipeline bubble", f"{lay['bubble_fraction']:.1%}"),
                ("step time (s)", lay["step_seconds"]),
            ],
        )
    else:
        section(
            "5. 3D-parallel layout (policy: search; the best by step time)",
            [
                (
                    "tensor x pipeline x data parallel",
                    f"{lay['tensor_parallel']} x {lay['pipeline_parallel']} x {lay['data_parallel']}",
                ),
                ("layers per stage", lay["layers_per_stage"]),
                ("micro-batches x sequences each", f"{lay['micro_batches']} x {lay['micro_batch_size']}"),
                ("activation recomputation", lay["recompute"]),
                ("optimizer sharding", lay["shard_optimizer"]),
                ("GPUs used", lay["gpus_used"]),
                ("memory per GPU (bytes)", lay["memory_per_gpu_bytes"]),
                ("one GPU's HBM (bytes)", lay["gpu_hbm_bytes"]),
                ("step time (s)", lay["step_seconds"]),
                ("pipeline bubble", f"{lay['bubble_fraction']:.1%}"),
                ("exposed DP communication (s)", lay["dp_exposed_seconds"] + lay["fsdp_gather_exposed_seconds"]),
                ("model FLOPs utilisation", f"{lay['model_flops_utilization']:.1%}"),
            ],
        )
    if not found:
        return
    t = Table(title=f"   the best {len(found['best'])} of {found['fitting']:,} fitting layouts", title_justify="left")
    for c in ("TP", "PP", "DP", "micro-batches", "recompute", "GPUs", "GB per GPU", "bubble", "step s", "vs best"):
        t.add_column(c, justify="right")
    for r in found["best"]:
        t.add_row(
            *(
                _fmt(r[k])
                for k in ("tensor_parallel", "pipeline_parallel", "data_parallel", "micro_batches", "recompute", "gpus_used")
            ),
            f"{r['memory_per_gpu_bytes'] / 1e9:.1f}",
            f"{r['bubble_fraction']:.1%}",
            _fmt(r["step_seconds"]),
            f"{r['seconds_per_token'] / found['best'][0]['seconds_per_token']:.3f}x",
        )
    console.print(t)
    rej = "; ".join(f"{why}: {n:,}" for why, n in found["rejected"].items()) or "none"
    console.print(f"   {found['evaluated']:,} layouts costed, {found['fitting']:,} fit; rejected: {rej}", highlight=False)
    rule = found["paper_rule"]
    if "layers_per_rack" not in rule:  # the rule itself found no layout
        console.print(f"   the paper's rule: {rule['reason']}", highlight=False)
        return
    if not rule["fits"]:
        verdict = f"rejected: {rule['reason']}"
    elif found["best"]:
        verdict = f"fits; {rule['seconds_per_token'] / found['best'][0]['seconds_per_token']:.3f}x the best's step time"
    else:
        verdict = "fits"
    console.print(
        f"   the paper's rule: {rule['layers_per_rack']} layers per rack x TP {rule['tensor_parallel']} "
        f"({rule['idle_gpus_per_rack']} GPUs idle per rack): {verdict}",
        highlight=False,
    )


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
