"""``geotrain bench place``: ``geotrain place``'s predictions against runs of the configs it writes.

For each pool (a slow site pair; unequal sites), on this machine under in-process link emulation:

1. calibrate: the naive config (every site, pool order, one ring) with links off, a few rounds:
   each site's measured compute seconds per inner step give ``job.step_s`` at speed 1;
2. place the pool with that step time: the chosen placement, its predictions, its config;
3. run the chosen config and the naive one (same H and codec) with the links emulated;
4. compare predicted with measured: each site's utilisation (compute / wall), the bytes each
   directed link carried per round, tokens per second; and the chosen run against the naive one.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from geotrain.bench.common import table
from geotrain.config import Config, load_config
from geotrain.plan.place_report import run_place
from geotrain.plan.pool import Pool

MODEL = ["model.n_layer=2", "model.n_embd=128", "model.n_head=2", "train.batch_size=4", "model.block_size=64"]
SLOWDOWN = 4  # an emulated accelerator of speed 1 is this many times slower than one core here
RUN = ["guard.enabled=false", "train.save_final=false", "run.baseline=none", "train.eval_every=0", "train.eval_batches=2"]
POOLS: dict[str, dict[str, Any]] = {
    "slow-pair": {  # four equal sites; A-B twenty times slower than the rest
        "sites": [{"name": n, "accelerators": 1} for n in "ABCD"],
        "links": {
            "default": {"bandwidth_bps": 1e8, "latency_s": 0.005},
            "pairs": [{"sites": ["A", "B"], "bandwidth_bps": 5e6, "latency_s": 0.005}],
        },
        "job": {"tokens": 256_000, "step_s": 1.0, "H": [10, 25, 50, 100], "codecs": ["none"], "tiers": False},
    },
    "unequal": {  # A, B fast; C four times slower, its data may not leave it
        "sites": [
            {"name": "A", "accelerators": 1},
            {"name": "B", "accelerators": 1},
            {"name": "C", "accelerators": 1, "speed": 0.25, "corpus": "CORPUS", "data_may_leave": False},
        ],
        "links": {"default": {"bandwidth_bps": 1e8, "latency_s": 0.01}},
        "job": {"tokens": 256_000, "step_s": 1.0, "H": [10, 25, 50, 100], "codecs": ["none"], "tiers": False},
    },
}


def _slowed(cfg: Config) -> Config:
    """``cfg`` with every site's accelerators :data:`SLOWDOWN` times slower than a core of this
    machine (``compute_speed``: sleeps, not computes), so the sites' processes do not contend for
    its cores and each site's step is as steady as a real accelerator's."""
    data = cfg.model_dump()
    for site in data["topology"]["sites"]:
        site["compute_speed"] /= SLOWDOWN
    return Config.model_validate(data)


def base_config(corpus: Path | None) -> Config:
    return load_config(None, [*MODEL, *RUN, "sync.algorithm=diloco", *([f"data.corpus={corpus}"] if corpus else [])])


def _pool(name: str, corpus: Path, step_s: float) -> Pool:
    data = POOLS[name]
    sites = [{**s, "corpus": str(corpus)} if s.get("corpus") else s for s in data["sites"]]
    return Pool.model_validate({**data, "sites": sites, "job": {**data["job"], "step_s": step_s}})


def _calibration(cfg: Config) -> Config:
    """``cfg`` (the naive placement) with the links off, 60 steps in rounds of 20, slowed as the runs are."""
    data = cfg.model_dump()
    data["topology"]["links"]["emulate"] = "off"
    data["train"]["steps"], data["sync"]["H"] = 60, 20
    return _slowed(Config.model_validate(data))


def _measured(s: dict[str, Any], rounds: int) -> dict[str, Any]:
    return {
        "utilization": {r["site"]: r["utilization"] for r in s["per_site"]},
        "link_bytes_per_round": {k: v / rounds for k, v in s["link_bytes"].items()},
        "tokens_per_second": s["tokens"] / s["wall_seconds"],
        "wall_seconds": s["wall_seconds"],
        "rounds": rounds,
        "final_eval_loss": s["final_eval_loss"],
    }


def _compare(pred: dict[str, Any], meas: dict[str, Any]) -> dict[str, Any]:
    util = {k: meas["utilization"][k] / v - 1 for k, v in pred["utilization"].items()}
    links = {k: meas["link_bytes_per_round"].get(k, 0.0) / v - 1 for k, v in pred["link_bytes_per_round"].items()}
    extra = {k: v for k, v in meas["link_bytes_per_round"].items() if k not in pred["link_bytes_per_round"]}
    return {
        "utilization_error": util,
        "max_utilization_error": max(abs(v) for v in util.values()),
        "link_bytes_error": links,
        "max_link_bytes_error": max((abs(v) for v in links.values()), default=0.0),
        "unpredicted_links": extra,
    }


def bench_place(
    out: Path,
    corpus: Path,
    pools: tuple[str, ...] = tuple(POOLS),
    progress: Callable[[str], None] = print,
    migration: bool = True,
) -> dict[str, Any]:
    from geotrain.launch.local import launch_local

    t0 = time.perf_counter()
    if not corpus.exists():  # the sites' data: a slice of the default corpus (site C's may not leave it)
        from geotrain.data.corpus import load_corpus

        corpus.parent.mkdir(parents=True, exist_ok=True)
        corpus.write_bytes(load_corpus(base_config(None).data)[:1_000_000])
    base = base_config(corpus)
    from geotrain.models.factory import build_model, count_params

    params, tps = count_params(build_model(base.model)), base.train.batch_size * base.model.block_size
    results = []
    for name in pools:
        # 1. calibrate the inner step (every site computing, as in the runs)
        pool = _pool(name, corpus, 1.0)
        cal = launch_local(_calibration(run_place(pool, params, tps, base)[2]), out / name / "calibrate", console_print=None)
        speed = {s.name: s.speed for s in pool.sites}
        step_s = statistics.median(r["step_seconds"] * speed[r["site"]] for r in cal["per_site"])
        # 2. place with the measured step
        pool = _pool(name, corpus, step_s)
        placed, chosen_cfg, naive_cfg = run_place(pool, params, tps, base)
        chosen_cfg, naive_cfg = _slowed(chosen_cfg), _slowed(naive_cfg)
        row: dict[str, Any] = {"pool": name, "step_s": step_s, "placed": placed}
        # 3. run both
        for kind, cfg, pred in (("chosen", chosen_cfg, placed["chosen"]), ("naive", naive_cfg, placed["naive"])):
            s = launch_local(cfg, out / name / kind, console_print=None)
            rounds = _exchanges(s)
            meas = _measured(s, rounds)
            pred_tps = pred["tokens_per_round"] / pred["round_s"]
            row[kind] = {
                "predicted": {
                    k: pred[k]
                    for k in ("utilization", "link_bytes_per_round", "round_s", "sync_s", "shape", "order", "pace", "H")
                },
                "predicted_tokens_per_second": pred_tps,
                "measured": meas,
                **_compare(pred, meas),
                "tokens_per_second_error": meas["tokens_per_second"] / pred_tps - 1,
            }
            progress(
                f"{name:>10} {kind:>6}: {pred['shape']} over {','.join(pred['order'])}, {pred['pace']}, H={pred['H']}: "
                f"utilisation {min(meas['utilization'].values()):.1%} measured vs {min(pred['utilization'].values()):.1%} "
                f"predicted; tokens/s {meas['tokens_per_second']:.0f} vs {pred_tps:.0f}"
            )
        row["chosen_over_naive_tokens_per_second"] = (
            row["chosen"]["measured"]["tokens_per_second"] / row["naive"]["measured"]["tokens_per_second"]
        )
        results.append(row)
    moved = bench_migration(out, corpus, progress=progress) if migration else None
    errs = [r[k]["max_utilization_error"] for r in results for k in ("chosen", "naive")]
    bytes_errs = [r[k]["max_link_bytes_error"] for r in results for k in ("chosen", "naive")]
    return {
        "pools": results,
        "target": 0.15,
        "max_utilization_error": max(errs),
        "max_link_bytes_error": max(bytes_errs),
        "within_target": max(errs) <= 0.15 and max(bytes_errs) <= 0.15,
        "migration": moved,
        "bench_seconds": time.perf_counter() - t0,
    }


def _exchanges(s: dict[str, Any]) -> int:
    """The sums across sites a run made: its rounds (the last, partial one included)."""
    return int(s["rounds"])


MIGRATE_AT = 110  # mid-round: C drains after the round that ends at step 125 (H=25)


def _elastic_config(corpus: Path, seed: int, migrate: bool) -> Config:
    sites = "[{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}]"
    cfg = load_config(
        None,
        [
            *MODEL,
            *RUN,
            f"data.corpus={corpus}",
            f"topology.sites={sites}",
            "topology.links.inter={bandwidth_bps: 1.0e+8, latency_s: 0.01}",
            "elastic.enabled=true",
            "sync.algorithm=diloco",
            "sync.H=25",
            "train.steps=300",
            f"train.seed={seed}",
            *([f'fault.migrate=["C@{MIGRATE_AT}"]'] if migrate else []),
        ],
    )
    return _slowed(cfg)


def bench_migration(
    out: Path, corpus: Path, seeds: tuple[int, ...] = (0, 1), progress: Callable[[str], None] = print
) -> dict[str, Any]:
    """An elastic run of three sites with site C's work moved mid-run (``fault.migrate``: it drains
    after a committed round and a new incarnation heals from a live site) against the same run
    without: the time one migration loses, per seed."""
    from geotrain.launch.local import launch_local

    runs = []
    for seed in seeds:
        pair = {}
        for migrate in (False, True):
            s = launch_local(_elastic_config(corpus, seed, migrate), out / f"migrate-{seed}-{migrate}", console_print=None)
            pair[migrate] = s
        stay, moved = pair[False], pair[True]
        (m,) = moved["failures"]
        folder = out / f"migrate-{seed}-True" / "elastic"
        drained = json.loads(next(folder.glob("drained-C.*.json")).read_text())
        rounds = [json.loads(x) for x in (folder / "rounds-A.jsonl").read_text().splitlines()]
        quorum = [r["quorum_s"] for r in rounds]
        after = next(r for r in rounds if r["step"] > drained["step"])  # the survivors' first round after the drain
        skipped = moved["per_site"]["C"]["started_at_step"] - drained["step"]
        runs.append(
            {
                "seed": seed,
                "drained_at_step": drained["step"],
                "healed_at_step": moved["per_site"]["C"]["started_at_step"],
                "steps_not_trained_by_C": skipped,
                "site_away_seconds": m["healed_after_seconds"],
                "survivors_next_quorum_wait_s": after["quorum_s"],
                "median_quorum_wait_s": statistics.median(quorum),
                "wall_seconds": stay["wall_seconds"],
                "wall_seconds_migrated": moved["wall_seconds"],
                "rounds_rolled_back": moved["rounds_rolled_back"],
                "consistent": moved["consistent"],
                "one_model": len(set(moved["global_param_hash"].values())) == 1,
                "final_eval_loss": {"stay": stay["final_eval_loss"], "migrated": moved["final_eval_loss"]},
            }
        )
        r = runs[-1]
        progress(
            f"migration seed {seed}: C drained at step {r['drained_at_step']}, healed at {r['healed_at_step']} "
            f"({r['site_away_seconds']:.2f} s away, {r['steps_not_trained_by_C']} steps not trained); survivors' next quorum "
            f"{r['survivors_next_quorum_wait_s']:.3f} s (median {r['median_quorum_wait_s']:.3f} s); wall {r['wall_seconds']:.1f} s "
            f"without, {r['wall_seconds_migrated']:.1f} s with; {r['rounds_rolled_back']} rolled back; one model: {r['one_model']}"
        )
    away = [r["site_away_seconds"] for r in runs]
    return {
        "sites": ["A", "B", "C"],
        "H": 25,
        "steps": 300,
        "migrate": f"C@{MIGRATE_AT}",
        "runs": runs,
        "site_away_seconds_mean": statistics.mean(away),
        "site_away_seconds_spread": (max(away) - min(away)) / 2,
        "steps_not_trained_by_C": [r["steps_not_trained_by_C"] for r in runs],
        "survivors_extra_wait_s": [r["survivors_next_quorum_wait_s"] - r["median_quorum_wait_s"] for r in runs],
    }


def print_place_bench(result: dict[str, Any], console: Any) -> None:
    t = table(
        "geotrain place: predicted vs measured (in-process link emulation)",
        [
            "pool",
            "run",
            "exchange",
            "util. pred",
            "util. meas",
            "max util. err",
            "max link-bytes err",
            "tokens/s pred",
            "tokens/s meas",
        ],
    )
    for r in result["pools"]:
        for kind in ("chosen", "naive"):
            x = r[kind]
            p = x["predicted"]
            t.add_row(
                r["pool"],
                kind,
                f"{p['shape']} {','.join(p['order'])} {p['pace']} H={p['H']}",
                f"{min(p['utilization'].values()):.1%}",
                f"{min(x['measured']['utilization'].values()):.1%}",
                f"{x['max_utilization_error']:.1%}",
                f"{x['max_link_bytes_error']:.1%}",
                f"{x['predicted_tokens_per_second']:.0f}",
                f"{x['measured']['tokens_per_second']:.0f}",
            )
    console.print(t)
    for r in result["pools"]:
        console.print(
            f"{r['pool']}: chosen / naive tokens per second (measured) = {r['chosen_over_naive_tokens_per_second']:.2f}x"
        )
