"""Readable report of a ``geotrain netsim`` result (rich tables on the console)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _n(x: float | None) -> str:
    if x is None:
        return "-"
    if abs(x) >= 1e9:
        return f"{x / 1e9:,.2f}B"
    if abs(x) >= 1e6:
        return f"{x / 1e6:,.2f}M"
    return f"{x:,.0f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:,.3f} ms"


def _tree_row(t: dict[str, Any]) -> list[str]:
    ports = " / ".join(f"{d}:{u}" for d, u in t["ports"][:-1])
    return [
        f"{t['tiers']} x radix {t['radix']} @ {t['port_bps'] / 1e9:g}G" + (f", {t['rails']} rails" if t["rails"] > 1 else ""),
        ports,
        _n(t["hosts"]),
        _n(t["hosts_capacity"]),
        " + ".join(_n(s) for s in t["switches_per_tier"]) + f" = {_n(t['switches'])}",
        _n(t["chips"]),
        _n(t["switch_links"]),
        "$" + _n(t["optics_usd"]),
    ]


def print_report(out: dict[str, Any], console: Console) -> None:
    """Print topology, sizing cases (ours beside the paper's), traffic, results and caveats."""
    console.print(f"[bold]geotrain netsim: {out['scenario']}[/bold]")
    cols = ["fabric", "down:up per tier", "hosts", "capacity", "switches per tier", "chips", "switch links", "optics"]
    t = Table(title="Fabric (port counting)", title_justify="left")
    for c in cols:
        t.add_column(c, justify="right" if c not in ("fabric",) else "left")
    t.add_row(*_tree_row(out["topology"]))
    console.print(t)

    if out["sizing"]:
        s = Table(title="Sizing cases: ours vs the paper", title_justify="left", show_lines=True)
        for c in ["case", "hosts (ours / paper)", "switches (ours / paper)", "chips", "switch links (ours / paper)", "optics"]:
            s.add_column(c)
        for case in out["sizing"]:
            o, p = case["ours"], case["paper"] or {}
            s.add_row(
                case["name"],
                f"{_n(o['hosts_capacity'] if p.get('hosts') else o['hosts'])} / {_n(p.get('hosts'))}",
                f"{_n(o['switches'])} / {_n(p.get('switches'))}",
                f"{_n(o['chips'])} / {_n(p.get('chips'))}",
                f"{_n(o['switch_links'])} / {_n(p.get('switch_links'))}",
                f"${_n(o['optics_usd'])} / " + (f"${_n(p['optics_usd'])}" if p.get("optics_usd") else "-"),
            )
        console.print(s)
        for case in out["sizing"]:
            if case["note"]:
                console.print(f"  [dim]{case['name']}:[/dim] {case['note']}", highlight=False)

    console.print("\nTraffic (one training step):" if len(out["traffic"]) > 1 else "")
    for tr in out["traffic"]:
        phases = "; ".join(
            f"{p['name']}: {p['flows']:,} flows x {_n(p['bytes_per_flow'])} B x{p['repeat']}" for p in tr["phases"]
        )
        where = phases if tr["on_fabric"] else "on the scale-up domain, not simulated on this fabric"
        times = f" x{tr['count']:,} per step" if tr["count"] > 1 else ""
        console.print(
            f"Traffic {tr['name']}: {tr['pattern']}, {_n(tr['message_bytes'])} bytes per host ({tr['message_from']}){times}; {where}",
            highlight=False,
        )

    r = Table(
        title="Synchronized phase per routing (mean over trials; FCT percentiles: one run of the costliest phase)",
        title_justify="left",
    )
    heads = ["routing", "makespan", "optimal", "x opt", "throughput", "busiest link", "links used", "p50 FCT", "p99 FCT", "wall"]
    for c in heads:
        r.add_column(c, justify="right" if c != "routing" else "left", no_wrap=True)
    for row in out["results"]:
        pct = row["fct_percentiles_seconds"]
        r.add_row(
            row["routing"],
            _ms(row["makespan_seconds"]),
            _ms(row["optimal_seconds"]),
            f"{row['ratio_to_optimal']:.2f}",
            f"{row['mean_throughput_fraction']:.1%}",
            f"{row['max_link_load']:.2f} flows",
            f"{row['switch_links_used_fraction']:.1%}",
            _ms(pct["50"]),
            _ms(pct["99"]),
            f"{row['wall_seconds']:.2f} s",
        )
    console.print(r)
    if len(out["results"][0]["per_traffic_seconds"]) > 1:
        per = Table(title="Per exchange, all its runs in one step (mean over trials)", title_justify="left")
        names = list(out["results"][0]["per_traffic_seconds"])
        per.add_column("routing")
        counts = {tr["name"]: tr["count"] for tr in out["traffic"]}
        for n in names:
            per.add_column(n, justify="right")
        for row in out["results"]:
            per.add_row(row["routing"], *(_ms(row["per_traffic_seconds"][n] * counts[n]) for n in names))
        console.print(per)

    paper = out.get("paper")
    if paper:
        by = {row["routing"]: row for row in out["results"]}
        p = Table(title=f"Ours vs the paper ({paper.get('source', '')})", title_justify="left")
        for c in ["quantity", "paper", "ours"]:
            p.add_column(c)
        first = out["results"][0]
        p.add_row("optimal completion", _ms(paper.get("optimal_seconds")), _ms(first["optimal_seconds"]))
        if "ecmp" in by:
            e = by["ecmp"]
            ratio = (
                (paper["ecmp_seconds"] / paper["optimal_seconds"])
                if paper.get("ecmp_seconds") and paper.get("optimal_seconds")
                else None
            )
            p.add_row("ECMP (single path)", _ms(paper.get("ecmp_seconds")), _ms(e["makespan_seconds"]))
            p.add_row("ECMP / optimal", f"{ratio:.1f}x" if ratio else "-", f"{e['ratio_to_optimal']:.2f}x")
        if "spray" in by and paper.get("multipath_within") is not None:
            p.add_row(
                "multipath vs optimal", f"within {paper['multipath_within']:.0%}", f"{by['spray']['ratio_to_optimal'] - 1:+.1%}"
            )
        console.print(p)
    console.print(f"[dim]Scope: {out['scope']}[/dim]", highlight=False)
    console.print(f"elapsed {out['elapsed_seconds']:.2f} s")
