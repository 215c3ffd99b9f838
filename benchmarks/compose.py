"""Capabilities together, measured side by side (docs/COMPOSE.md).

1. **Pairs.** The 16 settings of issue 41 on three sites of two workers: how many of the 119
   pairs load, and which are refused with what line.
2. **Elastic rounds sum like lock-step rounds.** ``geotrain train`` (default model, 3 sites of
   2, 1 and 1 workers, H = 10) with each codec, once with elastic rounds and once lock-step, in
   one run of this script: final eval loss, inter-site bytes, compression. The same for Streaming
   DiLoCo with int8 (2 fragments, tau 2), and elastic rounds under secure aggregation.
3. **Layouts.** The same run replicated and under FSDP (3 sites of 2 workers): asynchronous
   quorum rounds with SparseLoCo (bytes), and secure aggregation with site-level DP's clip
   biting (final loss, which must be equal). Items 2 and 3 alone: ``--only codecs``.
4. **Example-level DP inside sites** (``--only example-dp`` runs this part alone): DP-SGD with
   its clip biting and no noise, replicated (Opacus's per-example gradients) and under FSDP
   (ghost norms, two passes a step), beside FSDP without DP: final loss (equal in both layouts)
   and compute seconds per step (what the second pass costs).
5. **Quorum rounds in two tiers** (``--only quorum-tiers``): four sites in two regions, one site
   at 0.35 speed, 8 s of training on an emulated 100 Mbit/s, 30 ms link between regions, two
   seeds: lock-step tiers against a syncer per region with quorums of one site and world rounds
   every second merge (tokens trained, eval loss, utilisation, bytes across regions).
6. **Streaming DiLoCo in quorum rounds** (``--only quorum-streaming``): three sites, C at 0.35
   speed, 8 s, the same link, two seeds: lock-step Streaming DiLoCo (2 fragments, τ = 2) against
   its fragment syncs as quorum deliveries (quorums of one).
7. **Elastic rounds in two tiers** (``--only elastic-tiers``): three sites, A alone in region us,
   B and C in region eu, an emulated 100 Mbit/s, 30 ms link between regions: flat lock-step
   DiLoCo, lock-step tiers and elastic tiers (world round every second region round; final loss,
   bytes across regions, wall time), then elastic tiers with int8 while C and then A are killed
   and restarted (heal sources, rounds rolled back, one model at the end).
8. **Quorum rounds in elastic mode** (``--only elastic-quorum``): three sites, C at 0.35 speed, 8 s,
   an emulated 100 Mbit/s, 30 ms link, two seeds: lock-step DiLoCo, quorum rounds of 2 of 3 with a
   syncer, and the same as elastic rounds (no syncer): tokens, loss, utilisation, bytes, and how
   many of C's updates came late and still counted.
9. **Elastic Streaming DiLoCo overlaps like lock-step** (``--only elastic-streaming``): two sites of
   two workers (and of one), Streaming DiLoCo (H = 20, 2 fragments, tau = 2) on an emulated
   100 Mbit/s, 30 ms link, lock-step against elastic rounds, two seeds: compute utilisation (the
   target: within 5 points), wall time, final loss (equal: the rounds sum the same updates).

Prints a table, writes JSON.

    python benchmarks/compose.py [--steps 60] [--only pairs|codecs|example-dp|quorum-tiers|quorum-streaming|elastic-tiers|elastic-quorum|elastic-streaming]
        [--json benchmarks/results/compose.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

UNEQUAL = "topology.sites=[{name: A, workers: 2}, {name: B, workers: 1}, {name: C, workers: 1}]"
SLOW = "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1, compute_speed: 0.35}]"
THREE = "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}]"
FOUR = "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}, {name: D, workers: 1}]"
REGIONS = (
    "topology.regions=[{name: eu, sites: [A, B], link: {bandwidth_bps: 1.0e+10, latency_s: 0.001}}, "
    "{name: us, sites: [C, D], link: {bandwidth_bps: 1.0e+10, latency_s: 0.001}}]"
)
EVEN = "topology.sites=[{name: A, workers: 2}, {name: B, workers: 2}, {name: C, workers: 2}]"


def pairs() -> dict[str, Any]:
    from tests.test_combinations import combinations as enumerate_combinations

    tried, refused = enumerate_combinations(2)
    return {"tried": tried, "refused": len(refused), "refusals": {f"{a} + {b}": why for (a, b), why in sorted(refused.items())}}


def train(out: Path, overrides: list[str]) -> dict[str, Any]:
    from geotrain.config import load_config
    from geotrain.launch.local import launch_local

    summary: dict[str, Any] = launch_local(load_config(None, overrides), out, console_print=None)
    return summary


def row(s: dict[str, Any]) -> dict[str, Any]:
    return {
        "final_eval_loss": s["final_eval_loss"],
        "inter_site_bytes": s["inter_site_bytes"],
        "compression_ratio": s["compression_ratio"],
        "one_model": len(set(s["global_param_hash"].values())) == 1,
    }


def example_dp(tmp: Path, base: list[str]) -> dict[str, Any]:
    """DP-SGD inside sites in both layouts, with FSDP without DP beside them (part 4)."""
    dp = ["privacy.dp.unit=example", "privacy.dp.noise_multiplier=0", "privacy.dp.clip_norm=0.05"]
    runs: dict[str, Any] = {}
    for name, extra in (
        ("example_dp_clip_replicate", dp),
        ("example_dp_clip_fsdp", [*dp, "sync.within_site=fsdp"]),
        ("no_dp_fsdp", ["sync.within_site=fsdp"]),
    ):
        s = train(tmp / name, [EVEN, *base, *extra])
        runs[name] = {**row(s), "compute_s_per_step": s["compute_seconds"] / s["steps"]}
    return runs


def lockstep_vs_quorum(tmp: Path, name: str, setting: list[str], seconds: float = 8.0) -> dict[str, Any]:
    """``setting`` lock-step and in quorum rounds of one site, equal wall time (8 s), an emulated
    100 Mbit/s, 30 ms link, two seeds (parts 5 and 6)."""
    common = [*setting, "train.steps=100000", f"train.max_seconds={seconds}", "optim.schedule=constant"]
    common += ["train.eval_every=0", "run.baseline=none", "topology.links.emulate=inprocess"]
    common += ["topology.links.inter.bandwidth_bps=1e8", "topology.links.inter.latency_s=0.03"]
    runs: dict[str, Any] = {}
    for seed in (1234, 1235):
        for mode, extra in (("lockstep", []), ("quorum", ["sync.quorum={sites: 1, grace_s: 0}"])):
            s = train(tmp / f"{name}-{mode}-{seed}", [*common, *extra, f"train.seed={seed}"])
            runs[f"{name}-{mode}-seed{seed}"] = {
                **row(s),
                "tokens": s["tokens"],
                "utilization": s["utilization"],
                "inter_region_bytes": s["inter_region_bytes"],
                "peak_inter_site_bytes_per_step": s["peak_inter_site_bytes_per_step"],
                "steps": [p["steps"] for p in s["per_site"]],
            }
    return runs


def quorum_tiers(tmp: Path) -> dict[str, Any]:
    """Lock-step tiers against quorum rounds in two tiers (part 5)."""
    slow = FOUR.replace("{name: D, workers: 1}", "{name: D, workers: 1, compute_speed: 0.35}")
    return lockstep_vs_quorum(tmp, "tiers", [slow, REGIONS, "sync.H=10", "sync.region_every=2"])


def quorum_streaming(tmp: Path) -> dict[str, Any]:
    """Lock-step Streaming DiLoCo against its fragments in quorum rounds (part 6)."""
    stream = ["sync.algorithm=streaming", "sync.H=20", "sync.fragments=2", "sync.tau=2"]
    return lockstep_vs_quorum(tmp, "streaming", [SLOW, *stream])


def elastic_tiers(tmp: Path, base: list[str]) -> dict[str, Any]:
    """Flat DiLoCo, lock-step tiers and elastic tiers side by side, then elastic tiers with two
    sites killed and restarted (part 7)."""
    regions = (
        "topology.regions=[{name: us, sites: [A]}, {name: eu, sites: [B, C], link: {bandwidth_bps: 1.0e+9, latency_s: 0.001}}]"
    )
    link = ["topology.links.emulate=inprocess", "topology.links.inter.bandwidth_bps=1e8", "topology.links.inter.latency_s=0.03"]
    common = [THREE, regions, *link, *base]
    runs: dict[str, Any] = {}
    kills = ["sync.codec=int8", "train.steps=160", 'fault.kill=["C@35", "A@75"]', "fault.restart_after=0.5"]
    for name, extra in (
        ("flat-lockstep", []),
        ("tiers-lockstep", ["sync.region_every=2"]),
        ("tiers-elastic", ["sync.region_every=2", "elastic.enabled=true"]),
        ("tiers-elastic-int8-C-and-A-killed", ["sync.region_every=2", "elastic.enabled=true", *kills]),
    ):
        out = tmp / name
        s = train(out, [*common, *extra])
        runs[name] = {**row(s), "inter_region_bytes": s["inter_region_bytes"], "wall_seconds": s["wall_seconds"]}
        if "elastic.enabled=true" in extra:
            runs[name].update(
                survivors=s["survivors"],
                rounds_committed=s["rounds_committed"],
                rounds_rolled_back=s["rounds_rolled_back"],
                consistent=s["consistent"],
                heals=[
                    ln.split("] ", 1)[1]
                    for f in sorted((out / "logs").glob("*.1.log"))
                    for ln in f.read_text().splitlines()
                    if "healed from" in ln
                ],
            )
    return runs


def elastic_quorum(tmp: Path) -> dict[str, Any]:
    """Lock-step DiLoCo, quorum rounds of 2 of 3 with a syncer, and the same quorum rounds as
    elastic rounds (no syncer), C at 0.35 speed, 8 s each, an emulated 100 Mbit/s, 30 ms link, two
    seeds (part 8): tokens, loss, utilisation, bytes; in elastic mode how many of C's committed
    rounds carried a late update of its own."""
    common = [SLOW, "sync.H=10", "train.steps=100000", "train.max_seconds=8", "optim.schedule=constant"]
    common += ["train.eval_every=0", "run.baseline=none", "topology.links.emulate=inprocess"]
    common += ["topology.links.inter.bandwidth_bps=1e8", "topology.links.inter.latency_s=0.03"]
    quorum = "sync.quorum={sites: 2}"
    runs: dict[str, Any] = {}
    for seed in (1234, 1235):
        for mode, extra in (("lockstep", []), ("syncer-quorum", [quorum]), ("elastic-quorum", [quorum, "elastic.enabled=true"])):
            out = tmp / f"{mode}-{seed}"
            s = train(out, [*common, *extra, f"train.seed={seed}"])
            steps = s["per_site"] if isinstance(s["per_site"], list) else list(s["per_site"].values())
            r = runs[f"{mode}-seed{seed}"] = {
                **row(s),
                "tokens": s["tokens"],
                "steps": [p["steps"] for p in steps],
                "utilization": s["utilization"],
                "wall_seconds": s["wall_seconds"],
            }
            if mode == "elastic-quorum":
                recs = [json.loads(x) for x in (out / "elastic" / "rounds-C.jsonl").read_text().splitlines() if x]
                r.update(
                    consistent=s["consistent"],
                    rounds_committed=s["rounds_committed"],
                    rounds_rolled_back=s["rounds_rolled_back"],
                    C_late_updates=sum(1 for x in recs if x["outcome"] == "committed" and x.get("late")),
                    C_rounds_committed=sum(1 for x in recs if x["outcome"] == "committed"),
                )
    return runs


def codec_runs(tmp: Path, base: list[str]) -> dict[str, Any]:
    """Lock-step against elastic rounds per codec (unequal sites), and the quorum + SparseLoCo and
    secure-aggregation runs in both layouts: the sections ``elastic_vs_lockstep`` and ``layouts``."""
    runs: dict[str, dict[str, Any]] = {}
    for codec in ("none", "int8", "sparseloco"):
        for mode in ("lockstep", "elastic"):
            name = f"{codec}-{mode}"
            extra = [f"sync.codec={codec}", f"elastic.enabled={mode == 'elastic'}"]
            runs[name] = row(train(tmp / name, [UNEQUAL, *base, *extra]))
    streaming = ["sync.algorithm=streaming", "sync.fragments=2", "sync.tau=2", "sync.codec=int8"]
    for mode in ("lockstep", "elastic"):  # each fragment's sync one elastic round, merged tau steps later
        name = f"streaming-int8-{mode}"
        runs[name] = row(train(tmp / name, [UNEQUAL, *base, *streaming, f"elastic.enabled={mode == 'elastic'}"]))
    # masked in the int32 ring, each site's part weighted by its share of the largest site's tokens
    masked = ["elastic.enabled=true", "privacy.secure_aggregation=true"]
    runs["secagg-elastic"] = row(train(tmp / "secagg-elastic", [UNEQUAL, *base, *masked]))
    layouts: dict[str, dict[str, Any]] = {}
    for layout in ("replicate", "fsdp"):
        within = f"sync.within_site={layout}"
        q = train(tmp / f"quorum-{layout}", [EVEN, *base, within, "sync.quorum={sites: 2}", "sync.codec=sparseloco"])
        layouts[f"quorum_sparseloco_{layout}"] = row(q)
        private = [
            "privacy.secure_aggregation=true",
            "privacy.dp.unit=site",
            "privacy.dp.noise_multiplier=0",
            "privacy.dp.clip_norm=0.05",
        ]
        p = train(tmp / f"secagg-{layout}", [EVEN, *base, within, *private])
        layouts[f"secagg_site_dp_clip_{layout}"] = row(p)
    return {"elastic_vs_lockstep": runs, "layouts": layouts}


def elastic_streaming(tmp: Path, steps: int = 300) -> dict[str, Any]:
    """Lock-step against elastic Streaming DiLoCo, each exchange beside tau steps of compute, at
    100 Mbit/s and 30 ms (part 9): utilisation, wall time, final loss, per layout and seed."""
    common = ["sync.algorithm=streaming", "sync.H=20", "sync.fragments=2", "sync.tau=2", f"train.steps={steps}"]
    common += ["train.eval_every=0", "run.baseline=none", "topology.links.emulate=inprocess"]
    common += ["topology.links.inter.bandwidth_bps=1e8", "topology.links.inter.latency_s=0.03"]
    runs: dict[str, Any] = {}
    for layout, workers, seeds in (("2x2", 2, (1234, 1235)), ("2x1", 1, (1234,))):
        sites = f"topology.sites=[{{name: A, workers: {workers}}}, {{name: B, workers: {workers}}}]"
        for seed in seeds:
            for mode, extra in (("lockstep", []), ("elastic", ["elastic.enabled=true"])):
                s = train(tmp / f"{layout}-{mode}-{seed}", [sites, *common, *extra, f"train.seed={seed}"])
                runs[f"{layout}-{mode}-seed{seed}"] = {
                    **row(s),
                    "utilization": s["utilization"],
                    "wall_seconds": s["wall_seconds"],
                    "wan_wait_seconds": s.get("wan_wait_seconds"),
                }
            lock, el = runs[f"{layout}-lockstep-seed{seed}"], runs[f"{layout}-elastic-seed{seed}"]
            el["utilization_gap_points"] = round(100 * (lock["utilization"] - el["utilization"]), 2)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    parts = ["pairs", "codecs", "example-dp", "quorum-tiers", "quorum-streaming", "elastic-tiers", "elastic-quorum"]
    parts += ["elastic-streaming"]
    ap.add_argument("--only", choices=parts, default=None)
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/compose.json"))
    a = ap.parse_args()
    result: dict[str, Any] = {"pairs": pairs(), "steps": a.steps}
    print(f"pairs: {result['pairs']['refused']} of {result['pairs']['tried']} refused")
    base = [f"train.steps={a.steps}", "sync.H=10", "train.eval_every=0", "run.baseline=none"]
    if a.only == "codecs":
        with tempfile.TemporaryDirectory() as tmp:
            result.update(codec_runs(Path(tmp), base))
    if a.only == "example-dp":
        with tempfile.TemporaryDirectory() as tmp:
            result["example_dp"] = example_dp(Path(tmp), base)
    if a.only == "quorum-tiers":
        with tempfile.TemporaryDirectory() as tmp:
            result["quorum_tiers"] = quorum_tiers(Path(tmp))
    if a.only == "quorum-streaming":
        with tempfile.TemporaryDirectory() as tmp:
            result["quorum_streaming"] = quorum_streaming(Path(tmp))
    if a.only == "elastic-tiers":
        with tempfile.TemporaryDirectory() as tmp:
            result["elastic_tiers"] = elastic_tiers(Path(tmp), base)
    if a.only == "elastic-quorum":
        with tempfile.TemporaryDirectory() as tmp:
            result["elastic_quorum"] = elastic_quorum(Path(tmp))
    if a.only == "elastic-streaming":
        with tempfile.TemporaryDirectory() as tmp:
            result["elastic_streaming"] = elastic_streaming(Path(tmp))
    if a.only is None:
        with tempfile.TemporaryDirectory() as tmp:
            result.update(codec_runs(Path(tmp), base))
            # Streaming DiLoCo at lock-step and under adaptive pace, one site at 0.35 speed: each slot of
            # H/F steps is a round of the pace clock, ending with one fragment's sync
            paced: dict[str, dict[str, Any]] = {}
            for pace in ("lockstep", "adaptive"):
                name = f"streaming-{pace}-slow-site"
                s = train(
                    Path(tmp) / name,
                    [SLOW, *base, "sync.algorithm=streaming", "sync.fragments=2", "sync.tau=2", f"sync.pace={pace}"],
                )
                paced[name] = {**row(s), "steps": [x["steps"] for x in s["per_site"]], "wall_seconds": s["wall_seconds"]}
            result["streaming_pace"] = paced
            # Streaming DiLoCo in two tiers (regions A, B and C, D): each fragment syncs in its region at its
            # staggered step, across regions every region_every of them; region_every 1 with the outer
            # optimizer at the world tier is flat Streaming DiLoCo up to rounding
            tiered: dict[str, dict[str, Any]] = {}
            stream = ["sync.algorithm=streaming", "sync.fragments=2", "sync.tau=2"]
            for name, extra in (
                ("streaming-flat", []),
                ("streaming-tiers-every-1-world", ["sync.region_every=1", "sync.tier_outer=world"]),
                ("streaming-tiers-every-3", ["sync.region_every=3"]),
            ):
                s = train(Path(tmp) / name, [FOUR, REGIONS, *base, *stream, *extra])
                tiered[name] = {**row(s), "inter_region_bytes": s["inter_region_bytes"], "world_rounds": s["rounds"]}
            result["streaming_tiers"] = tiered
            # network adaptation on an emulated 10 Mbit/s, 20 ms link: lock-step rounds agree on the measurements
            # in a control exchange, elastic rounds through the claims of each round's meeting (one round later),
            adapted: dict[str, dict[str, Any]] = {}
            link = ["topology.links.emulate=inprocess", "topology.links.inter.bandwidth_bps=1e7"]
            link += ["topology.links.inter.latency_s=0.02", "sync.H=5", "sync.adapt={target: 0.9, H_min: 2, H_max: 20}"]
            # (quorum rounds of 2 of 3: the syncer chooses from each site's own link, a star)
            modes = {"lockstep": [], "elastic": ["elastic.enabled=true"], "quorum": ["sync.quorum={sites: 2}"]}
            for mode, extra in modes.items():
                s = train(Path(tmp) / f"adapt-{mode}", [THREE, *base, *link, *extra])
                log = s["adapt"]
                links = [min(a["link_bps"]) if isinstance(a["link_bps"], list) else a["link_bps"] for a in log]
                adapted[f"adapt-{mode}"] = {
                    **row(s),
                    "rounds": s["rounds"],
                    "choices": [[a.get("round", a.get("version")), a["next"]["H"], a["next"]["codec"]] for a in log],
                    "link_mbps": [round(b / 1e6, 3) for b in links if b],
                    "rtt_ms": [round(1e3 * a["rtt_s"], 1) for a in log],
                }
            result["adapt"] = adapted
            result["example_dp"] = example_dp(Path(tmp), base)
            result["quorum_tiers"] = quorum_tiers(Path(tmp))
            result["quorum_streaming"] = quorum_streaming(Path(tmp))
            result["elastic_tiers"] = elastic_tiers(Path(tmp), base)
            result["elastic_quorum"] = elastic_quorum(Path(tmp))
            result["elastic_streaming"] = elastic_streaming(Path(tmp))
        print(f"{'run':34} {'final eval loss':>16} {'inter-site bytes':>17} {'compression':>12} {'one model':>10}")
        every = {
            **result["elastic_vs_lockstep"],
            **result["layouts"],
            **result["streaming_pace"],
            **result["streaming_tiers"],
            **result["adapt"],
            **result["example_dp"],
        }
        for name, r in every.items():
            print(
                f"{name:34} {r['final_eval_loss']:16.4f} {r['inter_site_bytes']:17,} "
                f"{r['compression_ratio']:11.2f}x {'yes' if r['one_model'] else 'NO':>10}"
            )
        for name, r in result["streaming_pace"].items():
            print(f"{name:34} steps per site {r['steps']}, {r['wall_seconds']:.1f} s")
        for name, r in result["streaming_tiers"].items():
            print(f"{name:34} inter-region bytes {r['inter_region_bytes']:,}, world rounds {r['world_rounds']}")
        for name, r in result["adapt"].items():
            print(f"{name:34} (round, H, codec) chosen {r['choices']}; link Mbit/s {r['link_mbps']}; rtt ms {r['rtt_ms']}")
    for name, r in {**result.get("quorum_tiers", {}), **result.get("quorum_streaming", {})}.items():
        print(
            f"{name:34} final eval loss {r['final_eval_loss']:.4f}, tokens {r['tokens']:,}, steps per site {r['steps']}, "
            f"utilisation {r['utilization']:.1%}, across regions {r['inter_region_bytes']:,} B, one model {r['one_model']}"
        )
    for name, r in result.get("elastic_tiers", {}).items():
        print(
            f"{name:34} final eval loss {r['final_eval_loss']:.4f}, across regions {r['inter_region_bytes']:,} B, "
            f"{r['wall_seconds']:.1f} s, one model {r['one_model']}" + (f", heals {r['heals']}" if "heals" in r else "")
        )
    for name, r in result.get("elastic_quorum", {}).items():
        late = f", C's late updates {r['C_late_updates']} of {r['C_rounds_committed']}" if "C_late_updates" in r else ""
        print(
            f"{name:34} final eval loss {r['final_eval_loss']:.4f}, tokens {r['tokens']:,}, steps per site {r['steps']}, "
            f"utilisation {r['utilization']:.1%}, {r['inter_site_bytes']:,} B, one model {r['one_model']}{late}"
        )
    for name, r in result.get("elastic_streaming", {}).items():
        gap = f", {r['utilization_gap_points']:.1f} points under lock-step" if "utilization_gap_points" in r else ""
        print(
            f"{name:34} final eval loss {r['final_eval_loss']:.5f}, utilisation {r['utilization']:.1%}{gap}, "
            f"{r['wall_seconds']:.1f} s, one model {r['one_model']}"
        )
    for name, r in result.get("example_dp", {}).items():
        print(f"{name:34} final eval loss {r['final_eval_loss']:.6f}, compute {r['compute_s_per_step']:.3f} s/step")
    if a.only is not None and a.json.exists():  # one part alone: the other recorded runs stay
        result = {**json.loads(a.json.read_text()), **result}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
