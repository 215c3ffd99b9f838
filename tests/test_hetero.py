"""Sites of different sizes: rank arithmetic, collectives against torch.distributed, and DiLoCo
with H=1 against DDP end to end (real processes, Gloo on 127.0.0.1)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from geotrain.comm.topology import Topology
from geotrain.config import CODEC_BITS, TopologyConfig, load_config
from geotrain.errors import LaunchError
from geotrain.launch.local import launch_local
from tests.helpers import PLAIN_SGD, TINY, run_ranks

# timing-sensitive runs (relative speeds, time limits, measured links) are marked `timing`: the test
# command runs them after the others, one at a time, with no other test loading the machine; the
# equalities (H=1 DiLoCo == DDP, H2=H1 tiers == flat, collectives == torch) run with the others
TIMING = pytest.mark.timing

UNEQUAL = "topology.sites=[{name: A, workers: 3}, {name: B, workers: 2}, {name: C, workers: 1}]"
ONE_SITE = "topology.sites=[{name: A, workers: 6}]"
H1 = ["sync.algorithm=diloco", "sync.H=1", "sync.outer_lr=1.0", "sync.outer_momentum=0.0", "sync.nesterov=false"]


def _topology(workers: list[int]) -> Topology:
    cfg = TopologyConfig.model_validate({"sites": [{"name": f"s{i}", "workers": w} for i, w in enumerate(workers)]})
    return Topology.from_config(cfg)


def test_rank_arithmetic_of_unequal_sites() -> None:
    t = _topology([3, 2, 1])
    assert t.world_size == 6 and not t.uniform and t.carriers == 1
    assert [t.site_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 2]
    assert [t.info(r).local_rank for r in range(6)] == [0, 1, 2, 0, 1, 0]
    assert t.site_ranks(1) == [3, 4] and t.inter_ranks(0) == [0, 3, 5] and t.inter_ranks(1) == []
    assert t.describe() == "3 sites (s0x3, s1x2, s2x1), world 6"
    u = _topology([4, 2])
    assert u.carriers == 2 and u.inter_ranks(1) == [1, 5] and u.inter_ranks(3) == []
    with pytest.raises(ValueError):
        t.info(6)


def _unequal_rank(rank: int, workers: list[int]) -> dict:
    import torch.distributed as dist

    from geotrain.codecs import build_codec
    from geotrain.comm.collectives import Collectives
    from geotrain.comm.groups import ProcessGroups

    topo = _topology(workers)
    groups = ProcessGroups.build(topo, "gloo", timeout_s=60)
    errors: list = []
    site = topo.site_of(rank)
    try:
        for n in (1, 5, 1000, 4099):
            gen = [torch.Generator().manual_seed(100 * n + r) for r in range(topo.world_size)]
            values = [torch.randn(n, generator=g) for g in gen]
            for how in ("hierarchical", "flat"):
                x, ref = values[rank].clone(), values[rank].clone()
                dist.all_reduce(ref)
                Collectives(groups).all_reduce(x, how)
                if not torch.allclose(x, ref, atol=1e-5):
                    errors.append((how, n))
            # across sites: the input is identical inside a site; the sum is over sites
            x = values[topo.first_rank(site)].clone()
            ref = sum(values[topo.first_rank(s)] for s in range(topo.num_sites))
            comm = Collectives(groups)
            comm.all_reduce_across_sites(x)
            if not torch.allclose(x, ref, atol=1e-5):
                errors.append(("across", n))
            # and through a codec: every rank of every site ends with the same values
            y = values[topo.first_rank(site)].clone()
            Collectives(groups).all_reduce_across_sites(y, build_codec("int8"))
            got = [torch.empty_like(y) for _ in range(topo.world_size)]
            dist.all_gather(got, y)
            if any(not torch.equal(g, got[0]) for g in got) or not torch.allclose(y, ref, atol=0.1 * ref.abs().max()):
                errors.append(("int8", n))
        # control values in one hop: every rank gets every site's row
        rows = Collectives(groups).gather_sites(torch.tensor([float(site), 10.0 + site], dtype=torch.float64))
        if rows.tolist() != [[float(s), 10.0 + s] for s in range(topo.num_sites)]:
            errors.append(("gather_sites", rows.tolist()))
        return {"errors": errors, "inter": comm.stats.inter_bytes}
    finally:
        groups.destroy()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [[3, 2, 1], [1, 3], [4, 2]])
def test_collectives_over_unequal_sites_match_torch(workers: list[int]) -> None:
    results = run_ranks(sum(workers), _unequal_rank, workers)
    assert all(not r["errors"] for r in results), [r["errors"] for r in results]
    topo = _topology(workers)
    for r, res in enumerate(results):  # only the carrying local ranks send across sites
        carries = topo.info(r).local_rank < topo.carriers
        assert (res["inter"] > 0) == carries, (r, res["inter"])


def _run(tmp: Path, name: str, overrides: list[str]) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg = load_config(None, TINY + PLAIN_SGD + ["train.steps=4", "run.baseline=none", "topology.links.emulate=off", *overrides])
    summary = launch_local(cfg, tmp / name, console_print=None)
    return summary, torch.load(tmp / name / "final_model.pt")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_unequal_sites_diloco_h1_plain_sgd_equals_ddp(tmp_path: Path) -> None:
    """Sites of 3, 2 and 1 workers: DiLoCo with H=1, plain SGD and outer SGD at lr 1 without
    momentum, token-weighted, is DDP over the same 6 workers, which is DDP in one site of 6."""
    one, one_w = _run(tmp_path, "one", [ONE_SITE, "sync.algorithm=ddp"])
    ddp, ddp_w = _run(tmp_path, "ddp", [UNEQUAL, "sync.algorithm=ddp"])
    dil, dil_w = _run(tmp_path, "diloco", [UNEQUAL, *H1])
    for k in one_w:
        torch.testing.assert_close(ddp_w[k], one_w[k], rtol=1e-5, atol=1e-6, msg=k)
        torch.testing.assert_close(dil_w[k], one_w[k], rtol=1e-5, atol=1e-6, msg=k)
    assert one["final_eval_loss"] < one["eval_curve"][0]["eval_loss"]  # the model moved
    assert len(set(dil["global_param_hash"].values())) == 1 and dil["hashes_agree_within_sites"]
    assert dil["workers_per_site"] == [3, 2, 1] and dil["inter_site_bytes"] > 0
    # equal weighting is not DDP: site C's one worker would count as much as site A's three
    eq, eq_w = _run(tmp_path, "equal", [UNEQUAL, *H1, "sync.weight_by_tokens=false"])
    assert any(not torch.allclose(eq_w[k], one_w[k], rtol=1e-5, atol=1e-6) for k in one_w)


@TIMING
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_adaptive_rounds_follow_measured_speed_and_end_on_one_model(tmp_path: Path) -> None:
    """Site B is emulated at a quarter speed: lock-step runs H steps everywhere and A waits at every
    boundary; adaptive gives B about H/4 steps per round from the rates measured in the run."""
    sites = "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1, compute_speed: 0.25}]"
    common = [sites, "sync.H=8", "train.steps=40", "train.eval_every=16", "sync.algorithm=diloco"]
    lock, _ = _run(tmp_path, "lock", common)
    a, b = lock["per_site"]
    assert a["steps"] == b["steps"] == 40
    # B sleeps three times its own measured compute after each step, so its steps take 4x its
    # compute: load shared by both sites cannot bring the ratio under 2 (A's compute would have to
    # average twice B's)
    assert b["step_seconds"] > 2.0 * a["step_seconds"]
    ad, _ = _run(tmp_path, "adaptive", [*common, "sync.pace=adaptive"])
    a, b = ad["per_site"]
    # a 1-step calibration round, then rounds budgeted for H steps of the fastest site (at most 1.5 H)
    assert ad["rounds"] == 6 and 1 + 5 * 5 <= a["steps"] <= 1 + 5 * 12, a  # at most ceil(1.5 H) per round
    # about H/4 per round for B (1 to 4 here) once the rates are measured on budgeted rounds: the first
    # budget comes from the calibration round's one step, the run's first, whose warm-up can stretch
    # it so far that both sites run to the cap (seen under a parallel test run; docs/PACE.md)
    rounds = [p["steps"] for p in ad["pace"]]
    assert all(1 <= s[1] <= 4 and s[1] < s[0] for s in rounds[2:]), rounds
    assert 1 + 5 <= b["steps"] <= 1 + 12 + 4 * 4, b
    # the pace log has every boundary: each site's steps (they add up) and the next budget, with the reason
    assert [sum(p["steps"][i] for p in ad["pace"]) for i in range(2)] == [a["steps"], b["steps"]]
    assert all(p["why"].startswith("budget") and p["next_budget_s"] > 0 for p in ad["pace"])
    assert len(set(ad["global_param_hash"].values())) == 1 and ad["hashes_agree_within_sites"]
    # tokens count what every site ran: workers x steps x batch x block
    assert ad["tokens"] == (a["steps"] + b["steps"]) * 4 * 16
    assert [p["eval_loss"] for p in ad["eval_curve"]][-1] == ad["final_eval_loss"]
    assert ad["final_eval_loss"] < ad["eval_curve"][0]["eval_loss"]


@TIMING
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_adaptive_rounds_checkpoint_at_round_boundaries_and_resume_on_the_measured_pace(tmp_path: Path) -> None:
    """Adaptive pace with checkpoints: sites run different steps, so a checkpoint is taken at a
    round boundary (every checkpoint.every / H rounds), its folder named by the leading site's
    step, each rank's file holding its own step. A run resumed from it starts from the clock it
    saved (the measured rates and the next round's budget, no calibration round again) and runs
    the rounds left, to one model."""
    sites = "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1, compute_speed: 0.25}]"
    common = [sites, "sync.H=8", "train.steps=40", "train.eval_every=0", "sync.algorithm=diloco", "sync.pace=adaptive"]
    full, _ = _run(tmp_path, "full", [*common, "checkpoint.every=16", f"checkpoint.dir={tmp_path / 'ckpt'}"])
    folders = sorted((tmp_path / "ckpt").glob("step-*"))
    assert folders, "no checkpoint"
    first = folders[0]
    for folder in folders:  # each named by the leading site's step at its boundary
        steps = [torch.load(folder / f"rank{r}.pt", weights_only=False)["step"] for r in range(2)]
        assert max(steps) == int(folder.name.split("-")[1]), (folder.name, steps)
    # B, slower, had run fewer steps by the last one (at the first, both may be at the round's cap:
    # the calibration round times one step, the run's first, whose warm-up can inflate the first budget)
    assert steps[1] < steps[0], steps
    clock = torch.load(first / "rank0.pt", weights_only=False)["sync"]["clock"]
    rounds_then = len(clock["history"])
    assert rounds_then % 2 == 0 and clock["budget_s"] > 0  # every 16 / 8 = 2 rounds; a budgeted next round
    resumed, _ = _run(tmp_path, "resumed", [*common, f"checkpoint.resume={first}"])
    assert resumed["rounds"] == full["rounds"] == 6  # the calibration round is not run again
    assert resumed["pace"][:rounds_then] == full["pace"][:rounds_then]  # the measured pace carried over
    at_first = [torch.load(first / f"rank{r}.pt", weights_only=False)["step"] for r in range(2)]
    assert all(p["steps"] > s for p, s in zip(resumed["per_site"], at_first, strict=True))
    assert len(set(resumed["global_param_hash"].values())) == 1 and resumed["hashes_agree_within_sites"]


@TIMING
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_streaming_with_adaptive_pace_ends_each_slot_with_one_fragment_and_resumes_on_the_measured_pace(
    tmp_path: Path,
) -> None:
    """Streaming DiLoCo under adaptive pace: each slot of H/F lock-step steps is a round of the
    pace clock and ends with one fragment's sync on every site. B, at a quarter of the speed, runs
    fewer steps per slot; A's two ranks vote on ending each slot on the training thread while the
    exchange thread sums fragments. A checkpoint at a slot end resumes on the measured pace."""
    sites = "topology.sites=[{name: A, workers: 2}, {name: B, workers: 1, compute_speed: 0.25}]"
    common = [sites, "sync.algorithm=streaming", "sync.fragments=2", "sync.tau=1", "sync.H=8", "train.steps=40"]
    common += ["train.eval_every=16", "sync.pace=adaptive"]
    full, _ = _run(tmp_path, "full", [*common, "checkpoint.every=16", f"checkpoint.dir={tmp_path / 'ckpt'}"])
    a, b = full["per_site"]
    slots = full["pace"]
    # the calibration slot and 2 x ceil(40 / 8) slots, then fragment 0 (unsynced since slot 10) once more
    assert len(slots) == 11 and full["rounds"] == 12, (len(slots), full["rounds"])
    assert [sum(p["steps"][i] for p in slots) for i in range(2)] == [a["steps"], b["steps"]]
    assert all(s["steps"][1] <= s["steps"][0] for s in slots[3:]) and b["steps"] < a["steps"], slots
    assert all(s["steps"][1] >= 1 and s["steps"][0] <= 6 for s in slots[1:])  # at most ceil(1.5 x 4) per slot
    assert full["tokens"] == (2 * a["steps"] + b["steps"]) * 4 * 16
    assert len(set(full["global_param_hash"].values())) == 1 and full["hashes_agree_within_sites"]
    assert full["final_eval_loss"] < full["eval_curve"][0]["eval_loss"]
    first = sorted((tmp_path / "ckpt").glob("step-*"))[0]
    saved = torch.load(first / "rank0.pt", weights_only=False)["sync"]
    assert saved["slots"] % 4 == 0 and len(saved["clock"]["history"]) == saved["slots"]  # every 16 x 2 / 8 slots
    resumed, _ = _run(tmp_path, "resumed", [*common, f"checkpoint.resume={first}"])
    assert resumed["rounds"] == 12 and resumed["pace"][: saved["slots"]] == slots[: saved["slots"]]
    assert len(set(resumed["global_param_hash"].values())) == 1 and resumed["hashes_agree_within_sites"]


@TIMING
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_time_limit_ends_every_site_at_one_round_boundary(tmp_path: Path) -> None:
    s, _ = _run(tmp_path, "t", [UNEQUAL, "sync.algorithm=diloco", "sync.H=4", "train.steps=100000", "train.max_seconds=3"])
    steps = {p["steps"] for p in s["per_site"]}
    assert len(steps) == 1 and steps.pop() % 4 == 0 and s["rounds"] * 4 == s["steps"] < 100000
    assert len(set(s["global_param_hash"].values())) == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["sync.pace=adaptive", "sync.algorithm=ddp"], "sync.algorithm: DDP exchanges every step: it has no rounds to pace"),
        (["train.max_seconds=5", "sync.algorithm=ddp"], "sync.algorithm: DDP exchanges every step: it has no rounds to pace"),
        (
            ["sync.pace=adaptive", "sync.algorithm=streaming", "sync.eager=true"],
            "sync.eager: the eager step applies this site's share",
        ),
        (["topology.sites=[{name: A, workers: 1, compute_speed: 0}]"], "compute_speed"),
        (
            [UNEQUAL, "privacy.dp.unit=site", "privacy.dp.noise_multiplier=1"],
            "privacy.dp.unit: site-level DP's noise is calibrated to one clipped update per site, and sites of different sizes",
        ),
    ],
)
def test_bad_heterogeneous_configs_are_refused_in_one_line(overrides: list[str], message: str) -> None:
    from geotrain.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


TIERED = (
    "topology:\n"
    "  sites: [{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}, {name: D, workers: 1}]\n"
    "  regions:\n"
    "    - {name: eu, sites: [A, B], link: {bandwidth_bps: 1.0e+10, latency_s: 0.001}}\n"
    "    - {name: us, sites: [C, D], link: {bandwidth_bps: 1.0e+10, latency_s: 0.001}}\n"
)


def _tiered(tmp: Path, name: str, overrides: list[str]) -> tuple[dict, dict[str, torch.Tensor]]:
    f = tmp / f"{name}.yaml"
    f.write_text(TIERED)
    base = ["train.steps=16", "sync.H=2", "guard.enabled=false", "run.baseline=none", "topology.links.emulate=off"]
    cfg = load_config(f, TINY + base + overrides)
    summary = launch_local(cfg, tmp / name, console_print=None)
    return summary, torch.load(tmp / name / "final_model.pt")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tiers_with_h2_equal_to_h1_are_flat_diloco_and_cut_slow_tier_bytes(tmp_path: Path) -> None:
    flat, flat_w = _tiered(tmp_path, "flat", [])
    # the outer optimizer in each region (momentum per region, linear in the pseudo-gradients, and
    # every round starts from one model) or only across regions (plain averaging in the region):
    # with H2 = H1 both are flat DiLoCo, to rounding: the sums run in another order over 8 rounds
    # of Nesterov (1.3e-6 at most on this machine, in a bias of 0.0125: atol 1e-6 failed here); a
    # misplaced outer step moves the model by the inner updates' scale, lr x steps = 6e-3
    for outer in ("region", "world"):
        one, one_w = _tiered(tmp_path, f"one-{outer}", ["sync.region_every=1", f"sync.tier_outer={outer}"])
        for k in flat_w:
            torch.testing.assert_close(one_w[k], flat_w[k], rtol=1e-5, atol=1e-5, msg=f"{outer}: {k}")
        assert one["inter_region_bytes"] == flat["inter_region_bytes"] > 0
        assert one["rounds"] == one["region_rounds"] == flat["rounds"] == 8
    losses = {}
    for outer in ("region", "world", "both"):
        four, _ = _tiered(tmp_path, f"four-{outer}", ["sync.region_every=4", f"sync.tier_outer={outer}"])
        assert four["region_rounds"] == 8 and four["rounds"] == 2
        assert flat["inter_region_bytes"] == 4 * four["inter_region_bytes"]  # only the world tier crosses regions
        assert four["inter_site_bytes"] > four["inter_region_bytes"]  # the region tier runs on the fast links
        assert len(set(four["global_param_hash"].values())) == 1
        losses[outer] = four["final_eval_loss"]
    assert len(set(losses.values())) == 3, losses  # three different arrangements


@TIMING
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tiers_with_adaptive_pace_weigh_each_site_by_its_own_steps(tmp_path: Path) -> None:
    """Tiers with adaptive pace: D runs at a quarter speed, so every region round (on the pace
    clock's budget: one control exchange of steps and rates, a few bytes across regions) gives it
    fewer steps than C; region averages weigh each site by its steps, world averages by its steps
    since the last world round; the run ends at a world round, on one model."""
    slow_d = "topology.sites.3.compute_speed=0.25"
    s, _ = _tiered(tmp_path, "paced", ["sync.region_every=2", "sync.pace=adaptive", "sync.H=8", "train.steps=48", slow_d])
    pace = s["pace"]
    # a calibration round and 48 / 8 budgeted ones: 7 region rounds; world rounds after the 2nd,
    # 4th and 6th, and one to close the run after the 7th (the round engine closes it at once: the
    # engine before it ran an 8th region round of no steps first)
    assert len(pace) == s["region_rounds"] == 7 and all(sum(p["steps"]) > 0 for p in pace) and s["rounds"] == 4
    assert any(p["steps"][3] < p["steps"][2] for p in pace[1:]), pace  # D ran fewer steps than C
    a, b, c, d = (p["steps"] for p in s["per_site"])
    assert [sum(p["steps"][i] for p in pace) for i in range(4)] == [a, b, c, d] and d < c
    assert len(set(s["global_param_hash"].values())) == 1 and s["hashes_agree_within_sites"]


@TIMING
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tiers_with_network_adaptation_choose_the_world_tiers_period_and_codec(tmp_path: Path) -> None:
    """sync.adapt over tiers chooses the slow tier's settings: the world rounds' period (a whole
    number of region rounds) and codec, from the cross-region link measured in each world round
    (here 10 Mbit/s against regions on 10 Gbit/s); the region tier keeps H and its codec."""
    from geotrain.plan.strategies import choose_round

    slow = ["topology.links.emulate=inprocess", "topology.links.inter.bandwidth_bps=1e7", "train.steps=24"]
    adapt = ["sync.region_every=2", "sync.adapt={target: 0.9, H_min: 2, H_max: 12}"]
    s, _ = _tiered(tmp_path, "adapt", [*slow, *adapt])
    log = s["adapt"]
    assert log and log[0]["H"] == 4 and log[0]["codec"] == "none"  # H x region_every at first
    for prev, a in zip(log, log[1:], strict=False):
        assert a["H"] == 2 * max(1, round(prev["next"]["H"] / 2))  # whole region rounds of H = 2
        assert a["codec"] == prev["next"]["codec"]
    first = log[0]
    codecs = {c: float(CODEC_BITS[c]) for c in ("none", "bf16", "int8", "fp4")}
    # the formula's ring is over the 2 regions (a region's sites hold one update, which crosses once)
    assert first["next"] == choose_round(
        first["link_bps"], s["params"], max(first["step_s"]), 2, first["rtt_s"], 2, 12, codecs, 0.9
    )
    # the cross-region link (10 Mbit/s), not the regions' own (10 Gbit/s); the ring over regions
    # models the world tier's exchange only roughly (13.6 Mbit/s measured once)
    assert 5e6 <= first["link_bps"] <= 2.5e7
    assert first["changed"] and s["rounds"] < s["region_rounds"] // 2  # longer world periods than the first
    assert len(set(s["global_param_hash"].values())) == 1


@TIMING
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_time_limit_ends_a_tiered_run_at_a_world_round(tmp_path: Path) -> None:
    """train.max_seconds with two tiers: the sites agree on the time at world rounds (the only
    exchange every site is in), so every site stops after the same world round, on one model."""
    s, _ = _tiered(tmp_path, "timed", ["sync.region_every=2", "train.steps=100000", "train.max_seconds=3"])
    steps = {p["steps"] for p in s["per_site"]}
    assert len(steps) == 1 and s["steps"] == steps.pop() < 100000
    assert s["steps"] == 2 * s["region_rounds"] == 4 * s["rounds"] and s["rounds"] >= 1  # H = 2, H2 = 4
    assert len(set(s["global_param_hash"].values())) == 1


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_streaming_tiers_sync_each_fragment_in_its_region_and_resume_exactly(tmp_path: Path) -> None:
    """Streaming DiLoCo in two tiers: each fragment syncs in its region at its staggered step and
    across regions every region_every of its region syncs. With region_every 1 and the outer
    optimizer at the world tier it is flat Streaming DiLoCo up to rounding; with 2 it sends fewer
    bytes between regions, ends on one model, and resumes from a checkpoint (taken with a
    fragment's merge still pending) bit for bit."""
    common = ["sync.algorithm=streaming", "sync.fragments=2", "sync.tau=1", "sync.H=4", "model.n_layer=2", "train.steps=18"]
    flat, flat_w = _tiered(tmp_path, "flat", common)
    one, one_w = _tiered(tmp_path, "one", [*common, "sync.region_every=1", "sync.tier_outer=world"])
    for k in flat_w:
        torch.testing.assert_close(one_w[k], flat_w[k], rtol=1e-5, atol=2e-6, msg=k)
    assert one["rounds"] == one["region_rounds"] == flat["rounds"] == 10  # 9 staggered syncs, then the last fragment
    ckpt = ["checkpoint.every=6", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    two, two_w = _tiered(tmp_path, "two", [*common, "sync.region_every=2", *ckpt])
    assert two["region_rounds"] == 10 and two["rounds"] == 6  # each fragment: 2 of its 4 region syncs, then the last
    assert two["inter_region_bytes"] < 0.7 * one["inter_region_bytes"]
    assert len(set(two["global_param_hash"].values())) == 1 and two["hashes_agree_within_sites"]
    assert two["final_eval_loss"] < two["eval_curve"][0]["eval_loss"]
    resumed, resumed_w = _tiered(
        tmp_path, "resumed", [*common, "sync.region_every=2", f"checkpoint.resume={tmp_path / 'ckpt' / 'step-00000006'}"]
    )
    assert (resumed["rounds"], resumed["region_rounds"]) == (6, 10)
    for k in two_w:
        assert torch.equal(resumed_w[k], two_w[k]), k


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_guard_leaves_a_nan_update_out_of_its_region_round(tmp_path: Path) -> None:
    """guard.enabled with two tiers: B's update of region round 3 is NaN (fault.nan); the norms are
    exchanged inside region eu, B is left out of that round, A's update alone moves eu's model,
    and every site ends on one finite model. Without the guard the NaN reaches the model and the
    run stops on a NaN loss."""
    s, w = _tiered(tmp_path, "guarded", ["sync.region_every=2", "guard.enabled=true", "fault.nan=[B@3]"])
    assert s["guard_rejections"] == {"A": 0, "B": 1, "C": 0, "D": 0}
    assert [(e["site"], e["round"]) for e in s["guard_events"]] == [("B", 3)] and "non-finite" in s["guard_events"][0]["why"]
    assert s["rounds_rolled_back"] == 0 and len(set(s["global_param_hash"].values())) == 1
    assert all(torch.isfinite(t).all() for t in w.values()) and math.isfinite(s["final_eval_loss"])
    with pytest.raises(LaunchError):
        _tiered(tmp_path, "unguarded", ["sync.region_every=2", "fault.nan=[B@3]"])
    assert "loss is nan" in (tmp_path / "unguarded" / "logs" / "rank0.log").read_text()


@pytest.mark.parametrize(
    ("regions", "overrides", "message"),
    [
        ("[{name: eu, sites: [A, X]}, {name: us, sites: [B]}]", [], "unknown site 'X'"),
        ("[{name: eu, sites: [A, B]}, {name: us, sites: [B]}]", [], "the site 'B' is already in region 'eu'"),
        ("[{name: eu, sites: [A]}]", [], "every site must be in a region (B in none)"),
        ("[{name: eu, sites: [A]}, {name: eu, sites: [B]}]", [], "the region 'eu' is given twice"),
        ("[]", ["sync.region_every=2"], "sync.region_every: needs at least two topology.regions"),
        (
            "[{name: eu, sites: [A]}, {name: us, sites: [B]}]",
            ["sync.region_every=2", "sync.codec=powersgd"],
            "sync.codec: PowerSGD's low-rank factors are one sum over every site's matrices, and a region round sums a region's",
        ),
    ],
)
def test_bad_region_configs_are_refused_in_one_line(regions: str, overrides: list[str], message: str) -> None:
    from geotrain.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(None, [f"topology.regions={regions}", *overrides])
    assert message in str(err.value) and "\n" not in str(err.value)
