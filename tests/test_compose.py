"""Capabilities together, named: elastic rounds carry codecs and sites of different sizes, quorum
rounds carry FSDP shards, secure aggregation and site DP meet elastic rounds, pace and
adaptation (real processes on 127.0.0.1, a site killed mid-round). The whole matrix of pairs
and triples: tests/test_combinations.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from geotrain.config import CODEC_BITS
from geotrain.plan.strategies import choose_round
from tests.helpers import read_summary, train_cli
from tests.test_elastic import records, told

THREE_UNEQUAL = "topology:\n  sites: [{name: A, workers: 2}, {name: B, workers: 1}, {name: C, workers: 1}]\n"
ELASTIC = ["elastic.enabled=true", "sync.H=10", "train.eval_every=0"]
ALL_THREE = ["elastic.min_sites=3"]  # the live sites pause while one is down: a test of healing, not of a race with the end


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_elastic_int8_sites_of_different_sizes_kill_restart_heal(tmp_path: Path) -> None:
    """Elastic rounds with int8 across sites of 2, 1 and 1 workers (token-weighted): B is
    SIGKILLed between the reduce-scatter and the all-gather, the round rolls back everywhere, B's
    new incarnation heals from a live site and every site ends on one model."""
    out = tmp_path / "run"
    train_cli(
        out, [*ELASTIC, "sync.codec=int8", "train.steps=70", 'fault.kill=["B@30"]', "fault.restart_after=0.5"], THREE_UNEQUAL
    )
    s = read_summary(out)
    assert s["survivors"] == ["A", "B", "C"] and s["consistent"] and s["hashes_agree_within_sites"]
    assert len(set(s["global_param_hash"].values())) == 1
    assert s["rounds_rolled_back"] >= 1 and s["per_site"]["B"]["started_at_step"] > 30
    a = records(out, "A")
    committed = [r for r in a if r["outcome"] == "committed"]
    # token weights: A's 2 workers count twice (10 steps a round): 20 + 10 + 10 when all contribute
    assert any(r["weight"] == 40.0 and r["contributors"] == 3 for r in committed)
    healed = next(r for r in a if "B" in r["healers"] and r["outcome"] == "committed")
    assert healed["contributors"] == 2 and healed["weight"] == 30.0
    # int8 on the wire: about 4x fewer bytes than the fp32 rings of the same rounds (healing aside)
    assert s["compression_ratio"] > 1.5


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_elastic_rounds_sum_like_lock_step_rounds(tmp_path: Path) -> None:
    """Without failures, elastic rounds with SparseLoCo (a gather codec with error feedback) over
    sites of different sizes end where lock-step rounds end: the same final loss and the same
    codec bytes (frames add only their tags). (int8, a scatter codec, is checked by the kill test
    above against its compression; its sums equal lock-step's to the last digit in a manual run.)"""
    base = ["sync.H=10", "train.steps=40", "train.eval_every=0"]
    for codec in ("sparseloco",):
        runs = {}
        for elastic in ("true", "false"):
            out = tmp_path / f"{codec}-{elastic}"
            train_cli(out, [*base, f"sync.codec={codec}", f"elastic.enabled={elastic}"], THREE_UNEQUAL)
            runs[elastic] = read_summary(out)
        e, lock = runs["true"], runs["false"]
        assert e["final_eval_loss"] == pytest.approx(lock["final_eval_loss"], rel=1e-4), codec
        assert e["inter_site_bytes"] == pytest.approx(lock["inter_site_bytes"], rel=0.05), codec
        assert e["compression_ratio"] == pytest.approx(lock["compression_ratio"], rel=0.05), codec
        assert json.dumps(e["global_param_hash"]).count(next(iter(e["global_param_hash"].values()))) == 3


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.timing  # (B must come back before the others end: a race a loaded machine can lose)
def test_quorum_rounds_fsdp_sparseloco_a_site_killed_comes_back(tmp_path: Path) -> None:
    """Asynchronous quorum rounds over FSDP shards (2 workers per site) with SparseLoCo both ways:
    each site's ranks gather its whole pseudo-gradient for the leader, which sends it encoded, and
    cut the syncer's answer back into their shards. B is SIGKILLed at step 30 and started again:
    its new ranks rejoin from the syncer's model, and all three sites end on one model."""
    three = "topology:\n  sites: [{name: A, workers: 2}, {name: B, workers: 2}, {name: C, workers: 2}]\n"
    overrides = [
        "sync.within_site=fsdp",
        "sync.quorum={sites: 2}",
        "sync.codec=sparseloco",
        "sync.H=10",
        "train.steps=160",  # long enough that B, killed at 30, is back before the others end
        "train.eval_every=0",
        "fault.kill=[B@30]",
        "fault.restart_after=0.5",
    ]
    proc = train_cli(out := tmp_path / "run", overrides, three)
    s = read_summary(out)
    kinds = [m["kind"] for m in s["pace"]]
    assert "lost" in kinds and "rejoined" in kinds[kinds.index("lost") :]
    assert "rejoined the asynchronous rounds" in proc.stdout
    assert len(set(s["global_param_hash"].values())) == 1 and s["hashes_agree_within_sites"]
    # SparseLoCo both ways; the rejoin's model and the last answer cross in fp32 (about 10x over 80 steps, more over 160)
    assert s["compression_ratio"] > 5
    assert math.isfinite(s["final_eval_loss"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_elastic_fsdp_int8_a_site_killed_heals_from_live_shards(tmp_path: Path) -> None:
    """Elastic rounds over FSDP shards (2 workers per site) with int8: each rank carries its own
    shard across sites; B is SIGKILLed between the reduce-scatter and the all-gather, the round
    rolls back everywhere, and B's new incarnation heals each rank from the same local rank of a
    live site (model, inner AdamW and outer state as shards). Every rank of every site ends on
    one model."""
    three = "topology:\n  sites: [{name: A, workers: 2}, {name: B, workers: 2}, {name: C, workers: 2}]\n"
    out = tmp_path / "run"
    # B's new incarnation (two ranks, FSDP) took 5.5 s to come back on a loaded machine, after A and C had
    # finished 40 steps: with min_sites 3 they pause for it, so it heals while they are live, whatever the load
    overrides = [*ELASTIC, *ALL_THREE, "sync.within_site=fsdp", "sync.codec=int8", "train.steps=60", 'fault.kill=["B@20"]']
    proc = train_cli(out, [*overrides, "fault.restart_after=0.5"], three)
    s = read_summary(out)
    assert s["survivors"] == ["A", "B", "C"] and s["consistent"] and s["hashes_agree_within_sites"], told(out)
    assert len(set(s["global_param_hash"].values())) == 1
    assert s["rounds_rolled_back"] >= 1 and s["per_site"]["B"]["started_at_step"] > 20
    healed = [r for r in records(out, "B") if "B" in r["healers"]]
    assert healed and healed[-1]["outcome"] == "committed"
    assert proc.stdout.count("healed from") >= 1
    assert s["compression_ratio"] > 1.5


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_elastic_fsdp_streaming_int8_a_site_killed_heals_from_live_shards(tmp_path: Path) -> None:
    """Issue 41's first named test: elastic rounds, FSDP (2 workers per site), Streaming DiLoCo
    (2 fragments, tau 2) and int8 together on 3 sites. Each fragment's sync is one elastic round.
    B is SIGKILLed between the reduce-scatter and the all-gather of a fragment's round: the round
    rolls back that fragment everywhere, and B's new incarnation, which syncs no fragment yet,
    heals each rank from the same local rank of a live site and takes the round's fragment. Every
    fragment with unsynced steps gets a last round, and every rank of every site ends on one model."""
    three = "topology:\n  sites: [{name: A, workers: 2}, {name: B, workers: 2}, {name: C, workers: 2}]\n"
    out = tmp_path / "run"
    streaming = ["sync.algorithm=streaming", "sync.fragments=2", "sync.tau=2"]
    overrides = [
        *ELASTIC,
        *ALL_THREE,
        *streaming,
        "sync.within_site=fsdp",
        "sync.codec=int8",
        "train.steps=60",
        'fault.kill=["B@30"]',
    ]
    proc = train_cli(out, [*overrides, "fault.restart_after=0.5"], three)
    s = read_summary(out)
    assert s["survivors"] == ["A", "B", "C"] and s["consistent"] and s["hashes_agree_within_sites"]
    assert len(set(s["global_param_hash"].values())) == 1
    assert s["rounds_rolled_back"] >= 1 and s["per_site"]["B"]["started_at_step"] > 30
    a = records(out, "A")
    assert [r["step"] for r in a if r["outcome"] == "committed"][:3] == [5, 10, 15]  # one fragment every H/F steps
    assert [r["step"] for r in a][-2:] == [60, 60]  # the last sync of each fragment
    healed = [r for r in records(out, "B") if "B" in r["healers"]]
    assert healed and healed[-1]["outcome"] == "committed"
    assert proc.stdout.count("healed from") >= 1
    assert s["compression_ratio"] > 1.3  # int8 (healing's state crosses in fp32)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_secure_aggregation_in_elastic_rounds_a_site_drops_out_mid_round(tmp_path: Path) -> None:
    """Issue 41's secure aggregation + elastic test: every round's parts are masked with a seed per
    pair of admitted sites (from their fresh X25519 keys of that round), so the masks cancel only
    in the sum of every site. B is SIGKILLed between the reduce-scatter and the all-gather: that
    round rolls back everywhere (its sum is never used); A and C pause while only two sites are
    up (a sum of two shows each the other's update); B's new incarnation heals and the three
    sites end on one model. Without failures the masked rounds end where plain elastic rounds end (fixed point)."""
    three = "topology:\n  sites: [{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}]\n"
    runs = {}
    for name, extra in [("plain", []), ("masked", ["privacy.secure_aggregation=true"])]:
        train_cli(out := tmp_path / name, [*ELASTIC, "train.steps=40", *extra], three)
        runs[name] = read_summary(out)
    assert runs["masked"]["final_eval_loss"] == pytest.approx(runs["plain"]["final_eval_loss"], rel=1e-5)
    # ... and not bit for bit: the masked sums are fixed point (an fp32 ring would give the same bits);
    # the models, not the loss, which can round to the same float (it did: 4.688839554786682 both)
    assert runs["masked"]["global_param_hash"] != runs["plain"]["global_param_hash"]
    assert runs["masked"]["inter_site_bytes"] == runs["plain"]["inter_site_bytes"]  # int32 in the ring, as fp32
    out = tmp_path / "kill"
    overrides = [*ELASTIC, "privacy.secure_aggregation=true", "train.steps=60", 'fault.kill=["B@30"]']
    proc = train_cli(out, [*overrides, "fault.restart_after=2"], three)
    s = read_summary(out)
    assert s["survivors"] == ["A", "B", "C"] and s["consistent"]
    assert len(set(s["global_param_hash"].values())) == 1
    assert s["rounds_rolled_back"] >= 1 and s["per_site"]["B"]["started_at_step"] > 30
    a = records(out, "A")
    assert all(len(r["admitted"]) == 3 for r in a if r["outcome"] == "committed")  # never fewer than 3 in a sum
    # below 3 sites a round would show each site the other's update: A and C paused for B
    assert next(r for r in a if r["step"] == 40)["quorum_s"] > 1.0
    healed = [r for r in records(out, "B") if "B" in r["healers"]]
    assert healed and healed[-1]["outcome"] == "committed"
    assert proc.stdout.count("healed from") >= 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_site_level_dp_in_elastic_rounds_stops_every_site_at_its_budget(tmp_path: Path) -> None:
    """Issue 42's last part: site-level DP in the authenticated (elastic) mode, with secure
    aggregation. Each site clips its whole update and adds noise of z · clip / √3 (a round holds 3
    sites at least), and each round it sends an update is one step of its accountant. With z = 1
    and an ε budget that fits 2 rounds (7.08 after 2, 9.01 after 3), every site stops after its
    second round, with its last partial round not released, and all end on one model."""
    three = "topology:\n  sites: [{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}]\n"
    dp = ["privacy.dp.unit=site", "privacy.dp.noise_multiplier=1.0", "privacy.dp.clip_norm=0.05", "privacy.dp.epsilon=8"]
    out = tmp_path / "run"
    train_cli(out, [*ELASTIC, "privacy.secure_aggregation=true", *dp, "train.steps=40"], three)
    s = read_summary(out)
    assert len(set(s["global_param_hash"].values())) == 1 and s["consistent"]
    assert s["dp_unit"] == "site" and s["noise_multiplier"] == 1.0 and s["clip_norm"] == 0.05
    for site in s["per_site"].values():  # each site's own accountant: 2 rounds of z = 1
        assert site["epsilon"] == pytest.approx(7.0774, abs=1e-3) and site["epsilon"] <= 8
    assert s["privacy_stopped_at_step"] == 20
    assert [r["outcome"] for r in records(out, "A")][:2] == ["committed", "committed"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_secure_aggregation_over_sites_of_different_sizes_is_token_weighted(tmp_path: Path) -> None:
    """Secure aggregation on sites of 2, 1 and 1 workers: the carrying ranks mask their parts,
    each site's update scaled by its tokens over the largest site's (public weights) and the sum
    divided by the survivors' weights. The run ends where the token-weighted plain run ends, up
    to fixed-point rounding; the site's extra rank takes the carriers' survivors."""
    base = ["sync.H=10", "train.steps=30", "train.eval_every=0", "run.baseline=none"]
    plain_out, secure_out = tmp_path / "plain", tmp_path / "secure"
    train_cli(plain_out, base, THREE_UNEQUAL)
    train_cli(secure_out, [*base, "privacy.secure_aggregation=true"], THREE_UNEQUAL)
    plain, secure = read_summary(plain_out), read_summary(secure_out)
    assert secure["secagg"] and secure["dropouts"] == 0
    assert len(set(secure["global_param_hash"].values())) == 1 and secure["hashes_agree_within_sites"]
    assert secure["final_eval_loss"] == pytest.approx(plain["final_eval_loss"], abs=2e-3)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_network_adaptation_under_secure_aggregation_chooses_h_only(tmp_path: Path) -> None:
    """sync.adapt with secure aggregation on a 300 kbit/s link: the adapter raises H, and never
    picks a codec (masked fixed-point values cannot be compressed). The same run without secure
    aggregation picks fp4 from its first measurement (checked by hand for this test: 0.005 s a
    step, 88 KB a round)."""
    three = "topology:\n  sites: [{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}]\n"
    link = ["sync.adapt={target: 0.9, H_max: 20}", "topology.links.inter.bandwidth_bps=3e5"]
    train_cli(
        out := tmp_path / "run",
        ["sync.H=10", "train.steps=40", "train.eval_every=0", *link, "privacy.secure_aggregation=true"],
        three,
    )
    s = read_summary(out)
    assert s["secagg"] and len(set(s["global_param_hash"].values())) == 1
    assert all(a["codec"] == a["next"]["codec"] == "none" for a in s["adapt"])
    assert s["adapt"][0]["next"]["H"] == 20


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_secure_aggregation_with_adaptive_pace_weights_each_round_by_its_steps(tmp_path: Path) -> None:
    """Adaptive pace with secure aggregation: a site at a third of the speed runs fewer inner steps
    a round, every round's masked sum completes with no dropout, and every site ends on one model.
    (The weighted sum itself is checked against the plain run in the unequal-sites test above; here
    the weights are the rounds' public steps, from the same ``site_weights`` as plain rounds.)"""
    three = "topology:\n  sites: [{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1, compute_speed: 0.33}]\n"
    overrides = ["sync.H=10", "train.steps=40", "train.eval_every=0", "sync.pace=adaptive", "privacy.secure_aggregation=true"]
    train_cli(out := tmp_path / "run", overrides, three)
    s = read_summary(out)
    assert s["secagg"] and s["dropouts"] == 0 and len(set(s["global_param_hash"].values())) == 1
    rounds = s["pace"]
    assert any(r["steps"][2] < r["steps"][0] for r in rounds[1:]), rounds  # the slow site ran fewer steps


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.timing  # (relative speeds: see tests/test_hetero.py)
def test_elastic_rounds_with_adaptive_pace_a_site_killed_heals_and_the_slow_site_runs_fewer_steps(tmp_path: Path) -> None:
    """Adaptive pace in elastic rounds: each site claims its measured rate in the round's meeting
    and every site takes the round's time budget from the fastest claim, so C, at a third of the
    speed, runs fewer steps a round and its update weighs by its tokens; B is SIGKILLed mid-run,
    heals from a live site (taking its round count) and all three end on one model, on the
    same number of rounds."""
    three = "topology:\n  sites: [{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1, compute_speed: 0.33}]\n"
    overrides = [*ELASTIC, "sync.pace=adaptive", "train.steps=60", 'fault.kill=["B@25"]', "fault.restart_after=0.5"]
    train_cli(out := tmp_path / "run", overrides, three)
    s = read_summary(out)
    assert s["survivors"] == ["A", "B", "C"] and s["consistent"], s["failures"]
    assert len(set(s["global_param_hash"].values())) == 1
    site = s["per_site"]
    assert site["B"]["started_at_step"] > 0  # (the source's step: with adaptive pace it may be below B's 25)
    assert site["C"]["steps"] < site["A"]["steps"], site  # the slow site ran fewer steps
    assert len({v["rounds"] for v in site.values()}) == 1, site  # and the same rounds
    committed = [r for r in records(out, "A") if r["outcome"] == "committed" and r["contributors"] == 3]
    # token weights: a round's total is the steps its sites ran (one worker each), not 3 plain votes
    # (the calibration round runs one step on each)
    assert committed[0]["weight"] == 3 and len(committed) > 1 and all(r["weight"] > 3 for r in committed[1:]), committed
    assert any(r["outcome"] == "committed" and "B" in r["healers"] for r in records(out, "A"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_site_that_heals_in_the_last_paced_round_is_done_with_the_others(tmp_path: Path) -> None:
    """Adaptive pace in elastic rounds ends on rounds (the calibration round and ceil(steps / H)
    more). With elastic.min_sites=3 the others wait for B, killed in the last round (the second:
    the calibration round is step 1), and B heals in it. B then holds the others' round count, so
    it is done too: no step of its own, no round alone after the others ended (it ran one, on
    another model, before the round limit was applied after a heal)."""
    three = "topology:\n  sites: [{name: A, workers: 1, compute_speed: 0.5}, {name: B, workers: 1}, {name: C, workers: 1, compute_speed: 0.5}]\n"
    overrides = [*ELASTIC, *ALL_THREE, "sync.pace=adaptive", "train.steps=10", 'fault.kill=["B@3"]', "fault.restart_after=0.5"]
    train_cli(out := tmp_path / "run", overrides, three)
    s = read_summary(out)
    assert s["survivors"] == ["A", "B", "C"] and s["consistent"], told(out)
    site = s["per_site"]
    assert {v["rounds"] for v in site.values()} == {2}, site
    assert site["B"]["steps"] == site["B"]["started_at_step"] > 0, site  # it healed at the end: nothing left to run
    b = records(out, "B")
    assert [r["outcome"] for r in b][-1] == "committed" and b[-1]["healers"] == ["B"], b  # the heal round is its last


@pytest.mark.slow
@pytest.mark.timing
@pytest.mark.timeout(300)
def test_elastic_rounds_adapt_to_the_measured_link_from_claims_and_a_healed_site_takes_the_choice(tmp_path: Path) -> None:
    """Network adaptation in elastic rounds: each site claims, in a round's meeting, what it
    measured in its last committed round (a ping around the ring, bytes, seconds, steps), and every
    admitted site chooses the next H and codec from the same claims with the planner's formula.
    On an emulated 1 Mbit/s, 20 ms link the choice compresses; B is SIGKILLed mid-run and heals,
    taking the H and codec in force from its source, and all three end on one model."""
    lo, hi, target = 2, 20, 0.9
    overrides = [
        *ELASTIC, "sync.H=5", "train.steps=60", "topology.links.emulate=inprocess", "topology.links.inter.bandwidth_bps=1e6",
        "topology.links.inter.latency_s=0.02", f"sync.adapt={{target: {target}, H_min: {lo}, H_max: {hi}}}",
        'fault.kill=["B@25"]', "fault.restart_after=0.5",
    ]  # fmt: skip
    three = "topology:\n  sites: [{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}]\n"
    train_cli(out := tmp_path / "run", overrides, three)
    s = read_summary(out)
    assert s["survivors"] == ["A", "B", "C"] and s["consistent"], s["failures"]
    assert len(set(s["global_param_hash"].values())) == 1
    logs = {site: json.loads((out / "elastic" / f"summary-{site}.json").read_text())["adapt"] for site in "ABC"}
    codecs = {c: float(CODEC_BITS[c]) for c in ("none", "bf16", "int8", "fp4")}
    for a in logs["A"]:  # the planner's choice for the link the claims describe (a ring of the claiming sites)
        n = len(a["ping_s"])
        # a ping to the next site and its echo back, each 20 ms: at least one round trip for every
        # site (two hops the same way round once gave one hop, 21 ms, to the site that started last)
        assert a["rtt_s"] == min(a["ping_s"]) and 0.039 <= a["rtt_s"] < 0.2
        assert a["next"] == choose_round(a["link_bps"], s["params"], max(a["step_s"]), n, a["rtt_s"], lo, hi, codecs, target)
    assert logs["A"] and any(a["next"]["codec"] != "none" for a in logs["A"])  # 1 Mbit/s: it compresses
    by_round = {site: {a["round"]: a["next"] for a in log} for site, log in logs.items()}
    assert by_round["A"] == by_round["C"]  # the same claims, the same choice
    assert all(by_round["A"][r] == n for r, n in by_round["B"].items() if r in by_round["A"])  # B before and after it healed
    assert any(r["outcome"] == "committed" and "B" in r["healers"] for r in records(out, "A"))


FOUR_TIERS = (
    "topology:\n  sites: [{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}, {name: D, workers: 1}]\n"
    "  regions: [{name: eu, sites: [A, B, C]}, {name: us, sites: [D]}]\n"
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_secure_aggregation_in_both_tiers_a_site_drops_out_of_each(tmp_path: Path) -> None:
    """Tiers with secure aggregation: region rounds mask over the region's three sites, world
    rounds over all four; the us region's one site sums nothing in its region rounds. Without a
    dropout the masked run ends where the plain tiered run ends (fixed point), and the region
    rounds stay off the slow links. B drops out of region round 1 and of world round 1 after key
    agreement: the region round, below its threshold, rolls back in B's region only; the world
    round completes with the survivors, B's masks removed with their shares. A last world round
    that fails leaves every site on the world model before it."""
    base = ["sync.H=5", "sync.region_every=2", "train.steps=20", "train.eval_every=0"]
    masked = ["privacy.secure_aggregation=true"]
    runs = {}
    for name, extra in (("plain", []), ("masked", masked), ("dropout", [*masked, 'privacy.inject=["B@1:drop"]'])):
        train_cli(out := tmp_path / name, [*base, *extra], FOUR_TIERS)
        runs[name] = read_summary(out)
        assert len(set(runs[name]["global_param_hash"].values())) == 1, name
    plain, secure = runs["plain"], runs["masked"]
    assert secure["secagg"] and secure["dropouts"] == 0 and secure["rounds_rolled_back"] == 0
    assert secure["final_eval_loss"] == pytest.approx(plain["final_eval_loss"], rel=1e-5)
    assert 0 < secure["inter_region_bytes"] < 1.2 * plain["inter_region_bytes"]  # world rounds only cross regions
    audit = [json.loads(line) for line in (tmp_path / "dropout" / "audit.jsonl").read_text().splitlines()]
    region = [a for a in audit if a["kind"] == "round" and a["tier"] == "region"]
    world = [a for a in audit if a["kind"] == "round" and a["tier"] == "world"]
    assert [a["round"] for a in region] == [0, 1, 2, 3] and [a["round"] for a in world] == [0, 1]
    assert region[0]["participants"] == ["A", "B", "C"] and world[0]["participants"] == ["A", "B", "C", "D"]
    # a region of three needs all three (the threshold is at least 3): its round rolls back; the
    # world round goes on with three of four, B's masks removed with the survivors' shares
    assert region[1]["status"] == "rolled_back" and "2 of 3 sites survived" in region[1]["error"], region[1]
    assert world[1]["status"] == "committed" and world[1]["dropped"] == world[1]["masks_recovered"] == ["B"], world[1]
    assert [a["status"] for a in region + world].count("committed") == 5
    assert runs["dropout"]["dropouts"] == 1
    # the last world round below its threshold too (B and C drop out): every site ends on the last
    # world model, not on its region's
    train_cli(out := tmp_path / "last", [*base, *masked, 'privacy.inject=["B@1:drop", "C@1:drop"]'], FOUR_TIERS)
    last = read_summary(out)
    assert len(set(last["global_param_hash"].values())) == 1 and last["rounds_rolled_back"] == 2, last["rounds_rolled_back"]
