"""What a person sees at the end of ``geotrain train``: the side-by-side table and its comparison line."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from geotrain.report.summary import compare


def run_label(r: dict[str, Any]) -> str:
    """'ddp', 'diloco H=50', 'streaming H=100 F=4 + fp4'."""
    label = r["algorithm"]
    if r["algorithm"] != "ddp":
        label += f" H={r['H']}"
    if r["algorithm"] == "streaming":
        label += f" F={r.get('fragments', 1)}"
    if r.get("codec", "none") != "none":
        label += f" + {r['codec']}"
    return label


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB"


def human_bytes(n: float) -> str:
    """'812 B', '3.40 kB', '40.05 MB', '2.00 GB' (decimal units, as links are sold)."""
    for scale, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def verdict(primary: dict[str, Any], baseline: dict[str, Any], names: tuple[str, str] | None = None) -> str:
    """The comparison line: 'diloco vs ddp: eval loss +0.02%, 50.0x fewer inter-site bytes, wall
    time x0.60' (``names``: the runs' labels instead of their algorithms)."""
    c = compare(primary, baseline)
    ratio = c["inter_site_bytes_ratio"]
    a, b = names or (c["primary"], c["baseline"])
    return (
        f"{a} vs {b}: eval loss {100 * (c['eval_loss_ratio'] - 1):+.2f}%, "
        + (
            "no inter-site bytes"
            if not ratio
            else f"{ratio:,.1f}x fewer inter-site bytes"
            if ratio >= 1
            else f"{1 / ratio:,.1f}x more inter-site bytes"
        )
        + f", wall time x{c['wall_seconds_ratio']:.2f}"
    )


def print_table(runs: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="geotrain: runs side by side (equal tokens)")
    table.add_column("")
    for r in runs:
        table.add_column(run_label(r), justify="right")
    rows: list[tuple[str, Any]] = [
        ("final eval loss", lambda r: f"{r['final_eval_loss']:.4f}"),
        ("tokens", lambda r: f"{r['tokens']:,}"),
        ("inter-site bytes", lambda r: _mb(r["inter_site_bytes"])),
        ("compression (inter-site)", lambda r: f"{r.get('compression_ratio', 1.0):.2f}x"),
        ("peak inter-site bytes / step", lambda r: _mb(r.get("peak_inter_site_bytes_per_step", 0))),
        ("intra-site bytes", lambda r: _mb(r["intra_site_bytes"])),
        ("wall time", lambda r: f"{r['wall_seconds']:.1f} s"),
        ("compute / rank", lambda r: f"{r['compute_seconds']:.1f} s"),
        ("wide-area wait / rank", lambda r: f"{r.get('wan_wait_seconds', r['comm_wait_seconds']):.2f} s"),
        ("compute utilisation (min rank)", lambda r: f"{r['utilization']:.1%}" if "utilization" in r else "-"),
        (
            "global models identical",
            lambda r: "yes" if len(set(r["global_param_hash"].values())) == 1 and r["hashes_agree_within_sites"] else "NO",
        ),
    ]
    for name, fn in rows:
        table.add_row(name, *(fn(r) for r in runs))
    console.print(table)
    if len(runs) > 1:
        console.print(verdict(runs[0], runs[1]))
