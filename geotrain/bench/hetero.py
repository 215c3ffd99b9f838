"""``geotrain bench hetero``: sites of different speeds for the same wall-clock time.

Four sites of one worker on 1 Gbit/s, 20 ms links, emulated at compute speeds 1, 1, 0.5 and
0.25 (``topology.sites[].compute_speed``: pacing, see docs/PACE.md). Each mode trains the
default model with DiLoCo for ``seconds`` of training (``train.max_seconds``: every site stops
at the same round boundary), then evaluates the global model:

* ``sync``: lock-step DiLoCo, H inner steps on every site; the fast sites wait at each boundary;
* ``adaptive``: ``sync.pace=adaptive``, each site runs about H · rate_s / rate_max steps per
  round from the rates measured in the run;
* ``async``: asynchronous quorum rounds (``sync.quorum``): a round merges as soon as one site
  has delivered; a late site's update is merged later with a staleness discount, and the late
  site goes on at once. Every site runs H steps per round;
* ``async-q2``: the same with a quorum of 2 and a 1 s grace window (the two fast sites wait for
  each other);
* ``async-dyn``: ``async`` with dynamic local updates (``sync.pace=adaptive`` with ``sync.quorum``): the
  syncer gives each site about H · rate_s / rate_max steps per round from the rates it measured,
  so every site delivers about as often;
* ``async-kill``: ``async`` where the launcher SIGKILLs fast site B at its step 1,100 (about a
  third of the way, mid-round): B is late forever, the other three train on (not in the default
  modes: ``--modes async,async-kill``);
* ``async-rejoin``: ``async-kill`` where the launcher starts B again 10 s after the kill
  (``fault.restart_after``): B rejoins through the run's store, heals from the syncer's model and
  trains on from its last delivered round;
* ``async-int8``: ``async`` with ``sync.codec=int8``: updates and answers cross encoded (for slow
  links: ``--set topology.links.inter.bandwidth_bps=2e7``).

It writes ``runs: [{mode, seed, site, utilization, steps, step_seconds}]`` and
``eval_loss: {mode: mean over seeds}``, with the targets evaluated on them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from geotrain.bench.common import table
from geotrain.config import Config, load_config

SPEEDS = (1.0, 1.0, 0.5, 0.25)
MODES = {
    "sync": ["sync.pace=lockstep"],
    "adaptive": ["sync.pace=adaptive"],
    "async": ["sync.pace=lockstep", "sync.quorum={sites: 1, grace_s: 0}"],
    "async-q2": ["sync.pace=lockstep", "sync.quorum={sites: 2, grace_s: 1.0}"],
    "async-dyn": ["sync.pace=adaptive", "sync.quorum={sites: 1, grace_s: 0}"],
    "async-kill": ["sync.pace=lockstep", "sync.quorum={sites: 1, grace_s: 0}", "fault.kill=[B@1100]"],
    "async-rejoin": ["sync.pace=lockstep", "sync.quorum={sites: 1, grace_s: 0}", "fault.kill=[B@1100]", "fault.restart_after=10"],
    "async-int8": ["sync.pace=lockstep", "sync.quorum={sites: 1, grace_s: 0}", "sync.codec=int8"],
}
DEFAULT_MODES = ("sync", "adaptive", "async", "async-q2", "async-dyn")


def hetero_config(mode: str, seconds: float, H: int, seed: int, extra: list[str] | None = None) -> Config:
    sites = ", ".join(f"{{name: {n}, workers: 1, compute_speed: {s}}}" for n, s in zip("ABCD", SPEEDS, strict=True))
    return load_config(
        None,
        [
            f"topology.sites=[{sites}]",
            "topology.links.inter.bandwidth_bps=1e9",
            "topology.links.inter.latency_s=0.02",
            "sync.algorithm=diloco",
            *MODES[mode],
            f"sync.H={H}",
            "train.steps=1000000",
            f"train.max_seconds={seconds}",
            "train.eval_every=1000000",  # evaluate at the start and the end only
            "optim.schedule=constant",  # no step-count-dependent schedule: the sites run different step counts
            f"train.seed={seed}",
            "train.save_final=false",
            "run.baseline=none",
            *(extra or []),
        ],
    )


def bench_hetero(
    out: Path,
    seconds: float = 90.0,
    H: int = 50,
    seeds: tuple[int, ...] = (0,),
    extra: list[str] | None = None,
    progress: Callable[[str], None] = print,
    modes: tuple[str, ...] = DEFAULT_MODES,
) -> dict[str, Any]:
    from geotrain.launch.local import launch_local

    t_start = time.perf_counter()
    runs: list[dict[str, Any]] = []
    losses: dict[str, list[float]] = {m: [] for m in modes}
    walls: dict[str, list[float]] = {m: [] for m in modes}
    merges: list[dict[str, Any]] = []  # async modes: the syncer's merges, per seed
    for seed in seeds:
        for mode in modes:
            s = launch_local(hetero_config(mode, seconds, H, seed, extra), out / f"{mode}-{seed}", console_print=None)
            losses[mode].append(s["final_eval_loss"])
            walls[mode].append(s["wall_seconds"])
            if mode.startswith("async"):
                stale = [x for m in s["pace"] for x in m["staleness"]]
                merges.append(
                    {
                        "mode": mode,
                        "seed": seed,
                        "merges": sum(1 for m in s["pace"] if m["kind"] in ("quorum", "final") and m["sites"]),
                        "updates": len(stale),
                        "staleness_mean": sum(stale) / max(1, len(stale)),
                        "staleness_max": max(stale, default=0),
                        "lost_sites": s["lost_sites"],
                        "inter_site_bytes": s["inter_site_bytes"],
                        "compression_ratio": s["compression_ratio"],
                        # sites lost and taken back, with the syncer's clock (s) and reason
                        "events": [
                            {k: m[k] for k in ("kind", "t", "sites", "why")}
                            for m in s["pace"]
                            if m["kind"] in ("lost", "rejoined")
                        ],
                    }
                )
            for site in s["per_site"]:  # a lost site (async-kill) has no row
                speed = SPEEDS["ABCD".index(site["site"])]
                runs.append({"mode": mode, "seed": seed, "compute_speed": speed, "rounds": s["rounds"], **site})
            busy = ", ".join(f"{p['site']} {p['utilization']:.0%}" for p in s["per_site"])
            progress(f"{mode:>8} seed {seed}: loss {s['final_eval_loss']:.4f}, {s['rounds']} rounds, busy {busy}")
    eval_loss = {m: sum(v) / len(v) for m, v in losses.items()}
    return {
        "seconds": seconds,
        "H": H,
        "modes": list(modes),
        "seeds": list(seeds),
        "speeds": list(SPEEDS),
        "link": _link(hetero_config(modes[0], seconds, H, seeds[0], extra)),  # after any --set
        "runs": runs,
        "merges": merges,
        "eval_loss": eval_loss,
        "eval_loss_per_seed": losses,
        "wall_seconds": {m: sum(v) / len(v) for m, v in walls.items()},
        "targets": hetero_targets(runs, eval_loss),
        "bench_seconds": time.perf_counter() - t_start,
    }


def _link(cfg: Config) -> dict[str, float]:
    inter = cfg.topology.links.inter
    return {"bandwidth_bps": inter.bandwidth_bps, "latency_s": inter.latency_s}


def hetero_targets(runs: list[dict[str, Any]], eval_loss: dict[str, float]) -> dict[str, Any]:
    """The issue's targets on the measured runs."""
    out: dict[str, Any] = {}
    fast = [r for r in runs if r["mode"] == "sync" and r["compute_speed"] == max(SPEEDS)]
    if fast:
        out["sync_fast_sites_max_utilization"] = max(r["utilization"] for r in fast)
        out["sync_fast_sites_met"] = out["sync_fast_sites_max_utilization"] <= 0.40
    for mode in eval_loss:
        if mode == "sync":
            continue
        least = min(r["utilization"] for r in runs if r["mode"] == mode)
        out[f"{mode}_min_utilization"] = least
        out[f"{mode}_busy_met"] = least >= 0.90
        if "sync" in eval_loss:
            out[f"{mode}_loss_vs_sync"] = eval_loss[mode] / eval_loss["sync"] - 1
            out[f"{mode}_loss_met"] = eval_loss[mode] < eval_loss["sync"]
    return out


def print_hetero(result: dict[str, Any], console: Any) -> None:
    t = table(
        f"bench hetero: 4 sites x 1 worker, speeds {result['speeds']}, {result['link']['bandwidth_bps'] / 1e6:g} Mbit/s "
        f"{result['link']['latency_s'] * 1e3:g} ms, {result['seconds']:g} s each, H={result['H']}",
        ["mode", "seed", "site", "speed", "steps", "s/step", "utilisation"],
    )
    for r in result["runs"]:
        t.add_row(
            r["mode"], str(r["seed"]), r["site"], f"{r['compute_speed']:g}", str(r["steps"]), f"{r['step_seconds']:.3f}",
            f"{r['utilization']:.1%}",
        )  # fmt: skip
    console.print(t)
    tg, loss, modes = result["targets"], result["eval_loss"], result["modes"]
    if "sync_fast_sites_met" in tg:
        console.print(
            f"sync: fast sites at most {tg['sync_fast_sites_max_utilization']:.1%} busy "
            f"(expected <= 40%: {'yes' if tg['sync_fast_sites_met'] else 'NO'}); eval loss {loss['sync']:.4f}"
        )
    for mode in modes:
        if mode == "sync":
            continue
        vs = (
            f" vs sync {loss['sync']:.4f} ({tg[f'{mode}_loss_vs_sync']:+.2%}; target lower: {'met' if tg[f'{mode}_loss_met'] else 'MISSED'})"
            if "sync" in loss
            else ""
        )
        console.print(
            f"{mode}: every site >= {tg[f'{mode}_min_utilization']:.1%} busy (target >= 90%: "
            f"{'met' if tg[f'{mode}_busy_met'] else 'MISSED'}); eval loss {loss[mode]:.4f}{vs}"
        )
    for m in result.get("merges", []):
        console.print(
            f"{m['mode']} seed {m['seed']}: {m['merges']} merges of {m['updates']} updates, staleness mean "
            f"{m['staleness_mean']:.2f}, max {m['staleness_max']}"
            + (
                f"; {m['inter_site_bytes'] / 1e6:.1f} MB across sites (compression {m['compression_ratio']:.2f}x)"
                if "inter_site_bytes" in m
                else ""
            )
            + (f"; lost {', '.join(m['lost_sites'])} (late forever)" if m.get("lost_sites") else "")
            + "".join(f"; {e['kind']} site {e['sites'][0]} at {e['t']:.1f} s" for e in m.get("events", []))
        )
    console.print(f"bench took {result['bench_seconds'] / 60:.1f} min")


def plot_hetero(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    seed, modes = result["seeds"][0], result["modes"]
    width = 0.8 / len(modes)
    for k, mode in enumerate(modes):
        rows = [r for r in result["runs"] if r["mode"] == mode and r["seed"] == seed]
        xs = ["ABCD".index(r["site"]) + k * width for r in rows]
        a.bar(xs, [100 * r["utilization"] for r in rows], width, label=mode)
        b.bar(xs, [r["steps"] for r in rows], width, label=f"{mode} (mean loss {result['eval_loss'][mode]:.3f})")
    labels = [f"{n}\nspeed {s:g}" for n, s in zip("ABCD", result["speeds"], strict=True)]
    for ax in (a, b):
        ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(labels))], labels)
        ax.legend()
        ax.grid(alpha=0.3, axis="y")
    a.axhline(90, color="gray", ls="--", lw=1)
    a.set_ylabel("busy (%): compute / wall")
    a.set_ylim(0, 105)
    b.set_ylabel(f"inner steps in {result['seconds']:g} s")
    fig.suptitle(f"geotrain bench hetero (seed {seed}): lock-step, adaptive and asynchronous rounds")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
