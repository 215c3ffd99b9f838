"""``geotrain report``: one self-contained HTML page for one run or several side by side.

It reads what a run leaves (``summary.json``, each rank's ``metrics/*.jsonl``, the checkpoint
folders) and shows: the config and what differs between runs; eval loss against tokens and
against wall time; per-site utilisation and wide-area wait over time; bytes per site and
compression; rounds committed, rolled back and healed with their causes; the guard's
rejections; the privacy budget; checkpoints; the planner's predictions beside the measurements
(runs whose settings ``sync.adapt`` chose). ``geotrain train`` writes ``OUT/report.html`` at the
end of every run.

Why Jinja2 and matplotlib's SVG, not a JavaScript charting library: the page must open anywhere
without a network, and stay small. Plotly's inlined library alone is 4.8 MB; SVG charts drawn by
matplotlib (already what ``loss.png`` uses) are inlined as markup, carry no script, and a
1,000-step run's page stays well under a megabyte. Jinja2 (autoescaped) builds the page from one
template (:mod:`geotrain.report.page`).
"""

from __future__ import annotations

import datetime
import io
import json
import re
from pathlib import Path
from typing import Any

import yaml

from geotrain.report.page import TEMPLATE
from geotrain.report.tables import human_bytes, verdict
from geotrain.report.trackers import flat_params

WINDOW = 10  # steps per point of the per-site charts
SECTIONS = [  # (id, title) of the page's sections, in order
    ("runs", "runs"),
    ("loss", "eval loss"),
    ("sites", "sites over time"),
    ("bytes", "bytes per link"),
    ("rounds", "rounds"),
    ("guard", "guard"),
    ("privacy", "privacy"),
    ("checkpoints", "checkpoints"),
    ("prediction", "prediction"),
]


def _records(run_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """(the run's folder, its run record) for every run in a ``geotrain train`` output folder."""
    f = run_dir / "summary.json"
    try:
        s = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{run_dir}: no readable summary.json ({exc})") from None
    runs = s.get("runs") if isinstance(s.get("runs"), list) else None
    if not runs:
        return [(run_dir, s)]
    return [(run_dir / r["algorithm"] if len(runs) > 1 else run_dir, {**r, **_elastic_extras(s)}) for r in runs]


def _elastic_extras(s: dict[str, Any]) -> dict[str, Any]:
    """An elastic run's merged record keeps failures and round counts beside its runs."""
    keys = ("failures", "survivors", "rounds_committed", "rounds_split", "consistent", "seconds_lost")
    return {k: s[k] for k in keys if k in s}


def _metrics(d: Path, rank: int) -> list[dict[str, Any]]:
    """A rank's per-step records, every incarnation's in order (``rank{r}.jsonl``, ``rank{r}.{k}.jsonl``)."""
    files = sorted(
        (d / "metrics").glob(f"rank{rank}*.jsonl"),
        key=lambda f: int(f.stem.split(".")[1]) if "." in f.stem else 0,
    )
    out = []
    for f in files:
        if f.stem.split(".")[0] != f"rank{rank}":
            continue
        for line in f.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a torn last line
                continue
    return out


def _first_ranks(rec: dict[str, Any]) -> dict[str, int]:
    """Each site's first rank (ranks are numbered site by site)."""
    first: dict[str, int] = {}
    for r in rec.get("per_rank", []):
        first.setdefault(r["site"], r["rank"])
    if not first:
        workers = rec.get("workers_per_site", 1)
        per = workers if isinstance(workers, list) else [workers] * len(rec.get("sites", []))
        at = 0
        for site, w in zip(rec.get("sites", []), per, strict=False):
            first[site], at = at, at + int(w)
    return first


def _site_rows(rec: dict[str, Any]) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for r in rec.get("per_rank", []):
        s = rows.setdefault(
            r["site"],
            {"site": r["site"], "inter_site_bytes": 0, "inter_site_raw_bytes": 0, "intra_site_bytes": 0, "utilization": 1.0},
        )
        s["inter_site_bytes"] += r["inter_site_bytes"]
        s["inter_site_raw_bytes"] += r.get("inter_site_raw_bytes", r["inter_site_bytes"])
        s["intra_site_bytes"] += r["intra_site_bytes"]
        s["utilization"] = min(s["utilization"], r["utilization"])
    for s in rows.values():
        s["compression"] = s["inter_site_raw_bytes"] / s["inter_site_bytes"] if s["inter_site_bytes"] else None
    return list(rows.values())


def _checkpoints(d: Path, rec: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    cfg = rec.get("config", {}).get("checkpoint", {})
    roots = []
    if cfg.get("dir"):
        roots = [Path(str(cfg["dir"]).replace("{site}", site)).expanduser() for site in rec.get("sites", [])]
        roots = list(dict.fromkeys(roots))
    else:
        roots = [d / "checkpoints"]
    rows = []
    for root in roots:
        for step_dir in sorted(root.glob("step-*")) if root.is_dir() else []:
            files = [f for f in step_dir.rglob("*") if f.is_file()]
            manifest = step_dir / "manifest.json"
            try:
                listed = json.loads(manifest.read_text())["files"]
                missing = [n for n in listed if not (step_dir / n).is_file()]
                state = "complete" if not missing else f"{len(missing)} listed file(s) not here (another site's disk?)"
            except (OSError, ValueError, KeyError, TypeError):
                state = "none: incomplete"
            rows.append(
                {
                    "step": int(step_dir.name.split("-")[1]) if step_dir.name[5:].isdigit() else step_dir.name,
                    "path": str(step_dir),
                    "files": len(files),
                    "mb": sum(f.stat().st_size for f in files) / 1e6,
                    "manifest": state,
                }
            )
    every = cfg.get("every", 0)
    note = (
        "No checkpoints were written (checkpoint.every is 0)." if not every else f"None found under {', '.join(map(str, roots))}."
    )
    return rows, note


def _predictions(rec: dict[str, Any]) -> list[dict[str, Any]]:
    log = rec.get("adapt") or []
    rows = []
    for prev, a in zip([None, *log], log, strict=False):
        predicted = None if prev is None else prev["next"].get("predicted_utilization")
        measured = min(a["utilization"]) if a.get("utilization") else None
        rows.append(
            {
                "round": a["round"],
                "H": a.get("H"),
                "codec": a.get("codec"),
                "predicted": "—" if predicted is None else f"{predicted:.1%}",
                "measured": "—" if measured is None else f"{measured:.1%}",
            }
        )
    return rows


def collect(paths: list[Path]) -> list[dict[str, Any]]:
    """Every run of ``paths`` (``geotrain train`` output folders), with what the page shows."""
    runs = []
    many = len(paths) > 1
    for p in paths:
        records = _records(p)
        for d, rec in records:
            alg = rec.get("algorithm", "?")
            label = f"{p.name}/{alg}" if many and len(records) > 1 else p.name if many else alg
            hashes = rec.get("global_param_hash", {})
            first = _first_ranks(rec)
            failures = [
                {
                    "site": f.get("site"),
                    "kind": f.get("kind"),
                    "step": f.get("step", "—"),
                    "detected": _fmt(f.get("detection_seconds")),
                    "excluded": _fmt(f.get("excluded_after_seconds")),
                    "healed": _fmt(f.get("healed_after_seconds")),
                }
                for f in rec.get("failures", [])
            ]
            checkpoints, note = _checkpoints(d, rec)
            runs.append(
                {
                    "label": label,
                    "dir": d,
                    "record": rec,
                    "algorithm": alg,
                    "sites": ", ".join(rec.get("sites", [])),
                    "identical": len(set(hashes.values())) <= 1,
                    "config": rec.get("config", {}),
                    "config_yaml": yaml.safe_dump(rec.get("config", {}), sort_keys=False),
                    "site_rows": _site_rows(rec),
                    "metrics": {site: _metrics(d, r) for site, r in first.items()},
                    "failures": failures,
                    "lost_sites": ", ".join(rec.get("lost_sites", [])) or "—",
                    "guard_rejections": sorted(rec.get("guard_rejections", {}).items()),
                    "guard_events": rec.get("guard_events", []),
                    "secagg": rec.get("secagg", False),
                    "dp_unit": rec.get("dp_unit", "none"),
                    "checkpoints": checkpoints,
                    "checkpoint_note": note,
                    "predictions": _predictions(rec),
                    "values": {
                        **rec,
                        "merges": len(rec.get("pace", [])) if rec.get("config", {}).get("sync", {}).get("quorum") else None,
                    },
                }
            )
    return runs


def _fmt(x: Any) -> str:
    return "—" if x is None else f"{x:.2f}"


def _svg(fig: Any) -> str:
    """A matplotlib figure as inline SVG markup: no XML prolog, namespaces or metadata (whose
    URLs are identifiers, never fetched, but a page with no URL at all is easier to trust)."""
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    plt.close(fig)
    svg = buf.getvalue()
    svg = svg[svg.index("<svg") :]
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    return re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", svg)


def _done(fig: Any, axes: list[Any], xlabel: str, ylabels: list[str]) -> str:
    """Label, grid and legend ``axes``, and the figure as SVG."""
    for ax, ylabel in zip(axes, ylabels, strict=True):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return _svg(fig)


def _charts(runs: list[dict[str, Any]]) -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    charts: dict[str, Any] = {}
    for key, xlabel in (("tokens", "tokens (all ranks)"), ("wall", "seconds since the first step")):
        fig, ax = plt.subplots(figsize=(8, 3.6))
        for r in runs:
            curve = r["record"].get("eval_curve", [])
            rank0: list[dict[str, Any]] = next(iter(r["metrics"].values()), [])
            elapsed = {m["step"]: m.get("elapsed_seconds") for m in rank0}
            xs = [p["tokens"] if key == "tokens" else (elapsed.get(p["step"]) or 0.0) for p in curve]
            ax.plot(xs, [p["eval_loss"] for p in curve], marker="o", markersize=3, label=r["label"])
        charts[f"loss_{key}"] = _done(fig, [ax], xlabel, ["held-out loss"])
    charts["sites"] = []
    for r in runs:
        fig, (u, w) = plt.subplots(1, 2, figsize=(10, 3.2))
        for site, ms in r["metrics"].items():
            steps = [m for m in ms if "step_seconds" in m]
            xs, util, wait = [], [], []
            for i in range(0, len(steps), WINDOW):
                win = steps[i : i + WINDOW]
                total = sum(m["step_seconds"] for m in win)
                waited = sum(m.get("wait_seconds", 0.0) for m in win)
                xs.append(win[-1]["step"])
                util.append(100 * (1 - waited / total) if total > 0 else 100.0)
                wait.append(1000 * waited / len(win))
            u.plot(xs, util, label=site)
            w.plot(xs, wait, label=site)
        u.set_ylim(0, 105)
        charts["sites"].append(_done(fig, [u, w], "step", ["computing (%)", "wide-area wait per step (ms)"]))
    fig, ax = plt.subplots(figsize=(8, 3.2))
    styles = ["-", "--", ":", "-."]
    for r in runs:  # sites of one run often send alike: each its own dash and width, so none hides another
        for k, (site, ms) in enumerate(r["metrics"].items()):
            ys = [m.get("inter_site_bytes", 0) / 1e6 for m in ms]
            ax.plot(
                [m["step"] for m in ms],
                ys,
                label=f"{r['label']} {site}",
                linestyle=styles[k % len(styles)],
                linewidth=2.6 - 0.6 * (k % 4),
            )
    charts["bytes"] = _done(fig, [ax], "step", ["inter-site MB sent (site's first rank)"])
    charts["epsilon"] = None
    if any("epsilon" in m for r in runs for ms in r["metrics"].values() for m in ms):
        fig, ax = plt.subplots(figsize=(8, 3.2))
        for r in runs:
            ms = next(iter(r["metrics"].values()), [])
            ax.plot([m["step"] for m in ms if "epsilon" in m], [m["epsilon"] for m in ms if "epsilon" in m], label=r["label"])
        charts["epsilon"] = _done(fig, [ax], "step", ["ε spent"])
    return charts


def _cell(r: dict[str, Any], key: str, fmt: str = ",", src: dict[str, Any] | None = None, scope: str = "") -> Any:
    """A table cell holding ``src[key]`` (default the run's values), formatted, with its
    full-precision value in ``data-value`` for whoever reads the page back."""
    from markupsafe import Markup, escape

    v = (src if src is not None else r["values"]).get(key)
    number = isinstance(v, int | float) and not isinstance(v, bool)
    if fmt == "bytes":
        shown = human_bytes(float(v)) if number else "—" if v is None else str(v)  # type: ignore[arg-type]
    else:
        shown = "—" if v is None else format(v, fmt) if number else str(v)
    name = f"{scope}:{key}" if scope else key
    return Markup(
        f'<td data-run="{escape(r["label"])}" data-key="{escape(name)}" data-value="{escape(json.dumps(v))}">{escape(shown)}</td>'
    )


def write_report(paths: list[Path], out: Path) -> Path:
    """Write the page for the runs in ``paths`` to ``out``; returns ``out``.

    Raises:
        ValueError: a path holds no readable ``summary.json`` (the message names it).
    """
    from jinja2 import Environment

    runs = collect(paths)
    # a run and its baseline: the primary against the baseline, as the CLI says; more runs: each against the first
    pairs = [(runs[0], runs[1])] if len(runs) == 2 else [(r, runs[0]) for r in runs[1:]]
    verdicts = [
        verdict(a["record"], b["record"], (a["label"], b["label"]))
        for a, b in pairs
        if all(x["record"].get(k) is not None for x in (a, b) for k in ("final_eval_loss", "wall_seconds"))
    ]
    flat = [flat_params(r["config"]) for r in runs]
    keys = sorted({k for f in flat for k in f})
    differ = [(k, [f.get(k, "—") for f in flat]) for k in keys if len({f.get(k) for f in flat}) > 1]
    env = Environment(autoescape=True)
    page = env.from_string(TEMPLATE).render(
        title=", ".join(r["label"] for r in runs),
        written=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        sources=[str(p) for p in paths],
        sections=SECTIONS,
        runs=runs,
        differ=differ,
        verdicts=verdicts,
        charts=_charts(runs),
        window=WINDOW,
        cell=_cell,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    return out
