"""Benchmarks of the cross-organisation mode (``geotrain bench privacy``).

* overhead — secure vs plain aggregation of the same pseudo-gradient (default model size) over
  real Gloo ranks and an emulated link, measured side by side in one run: inter-site bytes,
  aggregation seconds, CPU seconds, and the round time (H inner steps of the default model,
  timed concurrently in the same ranks, plus the aggregation);
* key agreement — per-site CPU time and bytes of the protocol's set-up (keys, Shamir shares,
  pairwise seeds) and of the masking, for growing numbers of sites, complete vs SecAgg+ graph;
* quality — eval loss of the default model on 4 sites: no privacy, secure aggregation, and
  secure aggregation + DP at two ε values (plus site-level DP), trained with the real launcher.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from geotrain.bench.common import link_topology
from geotrain.comm.procs import run_ranks
from geotrain.comm.session import rank_comm

TARGETS = {"bytes_ratio": 1.1, "round_time_ratio": 1.3}


def _step_seconds(steps: int) -> float:
    """Median seconds of one inner step of the default model in this process."""
    from geotrain.config import load_config
    from geotrain.data import build_rank_data
    from geotrain.models import build_model
    from geotrain.run.optim import build_optimizer

    cfg = load_config(None, ["train.eval_batches=1"])
    model = build_model(cfg.model)
    data = build_rank_data(cfg.data, 0, [1], cfg.model.block_size, cfg.train.batch_size, 1, 0)
    opt, _ = build_optimizer(cfg.optim, model, cfg.train.steps)
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        x, y = data.train.next()
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def _overhead_rank(rank: int, sites: int, numel: int, reps: int, bandwidth: float, latency: float, step_reps: int) -> dict:
    import torch.distributed as dist

    from geotrain.config import PrivacyConfig
    from geotrain.privacy.aggregation import PrivateAggregation

    topo = link_topology(sites, 1, bandwidth, latency)
    out: dict[str, Any] = {"plain": [], "secure": [], "cpu_plain": [], "cpu_secure": [], "bytes_plain": 0, "bytes_secure": 0}
    with rank_comm(topo, "inprocess") as (groups, comm):
        aggs = {
            mode: PrivateAggregation(PrivacyConfig(secure_aggregation=mode == "secure"), comm, 0, 1, None)
            for mode in ("plain", "secure")
        }
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank)) * 1e-2
        for i in range(reps + 1):  # the first of each is a warm-up
            for mode in ("plain", "secure") if i % 2 == 0 else ("secure", "plain"):
                dist.barrier(group=groups.world)
                time.sleep(0.05)
                b0, c0, t0 = comm.stats.inter_bytes, time.process_time(), time.perf_counter()
                aggs[mode].average(x.clone(), i)
                t1, c1 = time.perf_counter(), time.process_time()
                if i:
                    out[mode].append(t1 - t0)
                    out[f"cpu_{mode}"].append(c1 - c0)
                    out[f"bytes_{mode}"] += comm.stats.inter_bytes - b0
        dist.barrier(group=groups.world)
        out["step_seconds"] = _step_seconds(step_reps)  # every rank at once, as in a run
    return out


def bench_overhead(
    sites: int = 4,
    reps: int = 5,
    bandwidth_bps: float = 1e9,
    latency_s: float = 0.02,
    H: int = 50,
    step_reps: int = 20,
    numel: int | None = None,
) -> dict[str, Any]:
    """Secure vs plain aggregation of a default-model-sized vector (or ``numel`` values)."""
    from geotrain.config import ModelConfig
    from geotrain.models import build_model, count_params

    numel = numel or count_params(build_model(ModelConfig()))
    ranks = run_ranks(sites, _overhead_rank, sites, numel, reps, bandwidth_bps, latency_s, step_reps, timeout=900)
    med = {m: statistics.median(max(r[m][i] for r in ranks) for i in range(reps)) for m in ("plain", "secure")}
    cpu = {m: statistics.median(statistics.mean(r[f"cpu_{m}"]) for r in ranks) for m in ("plain", "secure")}
    by = {m: sum(r[f"bytes_{m}"] for r in ranks) / reps for m in ("plain", "secure")}
    step = statistics.median(r["step_seconds"] for r in ranks)
    rounds = {m: H * step + med[m] for m in ("plain", "secure")}
    checks = {
        "bytes_ratio": by["secure"] / by["plain"],
        "aggregation_time_ratio": med["secure"] / med["plain"],
        "cpu_ratio": cpu["secure"] / max(cpu["plain"], 1e-9),
        "round_time_ratio": rounds["secure"] / rounds["plain"],
    }
    return {
        "sites": sites,
        "params": numel,
        "link": {"bandwidth_bps": bandwidth_bps, "latency_s": latency_s},
        "H": H,
        "reps": reps,
        "aggregation_seconds": med,
        "cpu_seconds_per_site": cpu,
        "inter_site_bytes_per_round": by,
        "step_seconds": step,
        "round_seconds": rounds,
        "checks": checks,
        "targets": TARGETS,
        "met": {k: checks[k] <= v for k, v in TARGETS.items()},
    }


def bench_key_agreement(sizes: tuple[int, ...] = (4, 8, 16), numel: int | None = None, reps: int = 3) -> dict[str, Any]:
    """Per-site cost of a round's set-up and masking, in one process (the crypto, not the network)."""
    from geotrain.config import ModelConfig
    from geotrain.config.privacy import sparse_degree
    from geotrain.models import build_model, count_params
    from geotrain.privacy.masking import (
        SHARE_BYTES,
        Participant,
        default_threshold,
        encode_fixed,
        neighbours,
    )

    numel = numel or count_params(build_model(ModelConfig()))
    q = encode_fixed(torch.randn(numel) * 1e-2, 20, 1.0)
    rows = []
    for n in sizes:
        for graph in ("complete", "sparse"):
            degree = n - 1 if graph == "complete" else sparse_degree(n)
            t = default_threshold(n, graph)
            setup, masking = [], []
            for _ in range(reps):
                nb = neighbours(n, graph, degree, b"bench")
                ps = [Participant(u, n, 0, nb, t, b"bench") for u in range(n)]
                t0 = time.process_time()
                keys = [p.public_keys() for p in ps]
                for p in ps:
                    for v, k in enumerate(keys):
                        p.receive_keys(v, k)
                msgs = [p.make_shares() for p in ps]
                for u, m in enumerate(msgs):
                    for v, blob in m.items():
                        ps[v].receive_shares(u, blob)
                for p in ps:
                    for v in nb[p.me]:
                        p.pair_seed(v)
                setup.append((time.process_time() - t0) / n)
                t0 = time.process_time()
                ps[0].mask(q)
                masking.append(time.process_time() - t0)
            real_degree = len(neighbours(n, graph, degree, b"bench")[0])
            setup_bytes = 96 * (n - 1) + Participant.share_message_bytes() * real_degree
            reveal_bytes = (n + n * (1 + SHARE_BYTES)) * (n - 1)  # flags + revealed shares
            rows.append(
                {
                    "sites": n,
                    "graph": graph,
                    "neighbours": real_degree,
                    "threshold": t,
                    "setup_cpu_seconds_per_site": statistics.median(setup),
                    "masking_cpu_seconds_per_site": statistics.median(masking),
                    "setup_bytes_per_site": setup_bytes,
                    "unmask_bytes_per_site": reveal_bytes,
                    "payload_bytes_per_site": round(2 * (n - 1) / n * 4 * numel),
                }
            )
    return {"params": numel, "rows": rows}


def quality_runs(eps_low: float, eps_high: float) -> list[tuple[str, list[str]]]:
    secure = ["privacy.secure_aggregation=true"]
    example = ["privacy.dp.unit=example", "privacy.dp.clip_norm=1.0"]
    return [
        ("no privacy", []),
        ("secure aggregation", secure),
        (f"secagg + example DP ε={eps_high:g}", [*secure, *example, f"privacy.dp.epsilon={eps_high}"]),
        (f"secagg + example DP ε={eps_low:g}", [*secure, *example, f"privacy.dp.epsilon={eps_low}"]),
        (
            f"secagg + site DP ε={eps_high:g}",
            [*secure, "privacy.dp.unit=site", "privacy.dp.clip_norm=1.0", f"privacy.dp.epsilon={eps_high}"],
        ),
    ]


FOUR_SITES = [f"topology.sites=[{', '.join(f'{{name: {s}, workers: 1}}' for s in 'ABCD')}]"]


def bench_quality(
    out: Path,
    extra: list[str] | None = None,
    eps_low: float = 2.0,
    eps_high: float = 8.0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    from geotrain.config import load_config
    from geotrain.launch.local import launch_local

    say = progress or (lambda _m: None)
    points = []
    for label, overrides in quality_runs(eps_low, eps_high):
        cfg = load_config(None, [*FOUR_SITES, *(extra or []), *overrides, "run.baseline=none", "train.save_final=false"])
        say(f"{label}: {cfg.train.steps} steps on 4 sites")
        s = launch_local(
            cfg, out / label.replace(" ", "_").replace("=", "").replace("+", "").replace("ε", "eps"), console_print=None
        )
        points.append(
            {
                "label": label,
                "final_eval_loss": s["final_eval_loss"],
                "secagg": s["secagg"],
                "dp_unit": s.get("dp_unit", "none"),
                "epsilon": s.get("epsilon"),
                "delta": s.get("delta"),
                "noise_multiplier": s.get("noise_multiplier"),
                "clip_norm": s.get("clip_norm"),
                "steps": s["steps"],
                "rounds": s["rounds"],
                "dropouts": s.get("dropouts", 0),
                "inter_site_bytes": s["inter_site_bytes"],
                "wall_seconds": s["wall_seconds"],
                "identical": len(set(s["global_param_hash"].values())) == 1,
            }
        )
    return {"points": points}


def print_privacy(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    if "overhead" in result:
        o = result["overhead"]
        t = Table(
            title=f"secure vs plain aggregation: {o['sites']} sites, {o['params']:,} parameters, "
            f"{o['link']['bandwidth_bps'] / 1e9:g} Gbit/s, {o['link']['latency_s'] * 1e3:g} ms, H={o['H']}"
        )
        for c in ("", "plain", "secure", "ratio", "target"):
            t.add_column(c, justify="right")
        rows = [
            ("inter-site bytes / round", o["inter_site_bytes_per_round"], "bytes_ratio", "{:,.0f}"),
            ("aggregation seconds", o["aggregation_seconds"], "aggregation_time_ratio", "{:.3f}"),
            ("CPU seconds / site", o["cpu_seconds_per_site"], "cpu_ratio", "{:.3f}"),
            ("round seconds (H steps + aggregation)", o["round_seconds"], "round_time_ratio", "{:.2f}"),
        ]
        for name, vals, key, fmt in rows:
            target = o["targets"].get(key)
            mark = "" if target is None else (f"≤ {target} " + ("met" if o["met"][key] else "MISSED"))
            t.add_row(name, fmt.format(vals["plain"]), fmt.format(vals["secure"]), f"{o['checks'][key]:.3f}×", mark)
        console.print(t)
    if "key_agreement" in result:
        k = result["key_agreement"]
        t = Table(title=f"secure aggregation set-up and masking per site ({k['params']:,} parameters)")
        for c in (
            "sites",
            "graph",
            "neighbours",
            "t",
            "set-up CPU ms",
            "masking CPU ms",
            "set-up bytes",
            "unmask bytes",
            "payload bytes",
        ):
            t.add_column(c, justify="right")
        for r in k["rows"]:
            t.add_row(
                str(r["sites"]),
                r["graph"],
                str(r["neighbours"]),
                str(r["threshold"]),
                f"{r['setup_cpu_seconds_per_site'] * 1e3:.1f}",
                f"{r['masking_cpu_seconds_per_site'] * 1e3:.1f}",
                f"{r['setup_bytes_per_site']:,}",
                f"{r['unmask_bytes_per_site']:,}",
                f"{r['payload_bytes_per_site']:,}",
            )
        console.print(t)
    if "quality" in result:
        t = Table(title="eval loss of the default model on 4 sites (equal steps unless an ε budget stopped the run)")
        for c in ("run", "final eval loss", "ε (δ=1e-5)", "noise mult.", "clip", "steps", "identical"):
            t.add_column(c, justify="right")
        for p in result["quality"]["points"]:
            eps = "–" if p["epsilon"] is None else f"{p['epsilon']:.2f}"
            nm = "–" if p["noise_multiplier"] is None else f"{p['noise_multiplier']:.3f}"
            clip = "–" if p["clip_norm"] is None else f"{p['clip_norm']:g}"
            t.add_row(
                p["label"], f"{p['final_eval_loss']:.4f}", eps, nm, clip, str(p["steps"]), "yes" if p["identical"] else "NO"
            )
        console.print(t)
