"""Asynchronous quorum rounds in two tiers (sync.quorum with sync.region_every): a syncer per
region, world rounds among the regions' syncers. Equal to lock-step tiers when every quorum is
the whole region; a slow site never holds up its region, a killed site comes back, and every site
ends on one model (real processes, Gloo on 127.0.0.1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from geotrain.config import load_config
from geotrain.launch.local import launch_local
from geotrain.round.syncer import FIELDS
from tests.helpers import TINY

FOUR = "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}, {name: D, workers: 1}]"
REGIONS = "topology.regions=[{name: eu, sites: [A, B]}, {name: us, sites: [C, D]}]"
HEADER = (2 + FIELDS) * 8  # a mailbox message's float64 header (arrival, length, the fields)


def _run(tmp: Path, name: str, overrides: list[str]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    summary = launch_local(load_config(None, TINY + overrides), tmp / name, console_print=None)
    return summary, torch.load(tmp / name / "final_model.pt")


def _logs(s: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The two region syncers' logs: eu's (site A's, the run's first rank) and us's (site C's leader)."""
    us = next(r["merges"] for r in s["per_rank"] if r["site"] == "C" and r["local_rank"] == 0)
    return s["pace"], us


def _world(log: list[dict[str, Any]]) -> list[list[int]]:
    return [m["sites"] for m in log if m["kind"] == "world"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quorum_rounds_of_whole_regions_are_lock_step_tiers_with_fewer_bytes_across_regions(tmp_path: Path) -> None:
    """Every quorum is the whole region and the grace window endless: each region's merges are its
    lock-step region rounds, and the world rounds its syncers run every second merge are the world
    rounds of lock-step tiers (14 steps, H=4: world rounds after steps 8 and 14). The models agree
    to rounding (5.8e-8 when measured: the world mean adds regions, lock-step adds sites on a
    ring). Only the two syncers cross regions, one model each way per world round; lock-step tiers
    all-reduce every site's Δ over the four sites."""
    common = [FOUR, REGIONS, "sync.region_every=2", "train.steps=14", "sync.H=4", "topology.links.emulate=off"]
    lock, lock_w = _run(tmp_path, "lock", common)
    asy, asy_w = _run(tmp_path, "async", [*common, "sync.quorum={sites: 2, grace_s: .inf}"])
    for k in lock_w:
        torch.testing.assert_close(asy_w[k], lock_w[k], rtol=0, atol=1e-6)
    assert asy["final_eval_loss"] == pytest.approx(lock["final_eval_loss"], rel=1e-6)
    assert len(set(asy["global_param_hash"].values())) == 1
    eu, us = _logs(asy)
    assert [m["kind"] for m in eu] == ["quorum", "quorum", "world", "quorum", "final", "world"]
    assert [m["sites"] for m in eu if m["kind"] != "world"] == [[0, 1]] * 4
    assert [m["sites"] for m in us if m["kind"] != "world"] == [[2, 3]] * 4
    assert _world(eu) == _world(us) == [[0, 2], [0, 2]]
    model = 4 * asy["params"] + HEADER
    assert asy["inter_region_bytes"] == 2 * 2 * model  # two world rounds, one model each way
    assert lock["inter_region_bytes"] > asy["inter_region_bytes"]


@pytest.mark.slow
@pytest.mark.timing
@pytest.mark.timeout(300)
def test_a_slow_site_never_holds_up_its_region_and_a_killed_site_comes_back_in_two_tiers(tmp_path: Path) -> None:
    """eu (A, B with two workers) and us (C, D at 0.4 speed), quorums of one site, a world round
    every second merge, over an emulated 100 Mbit/s, 30 ms link between regions. D is late in
    us's rounds and never waits; C keeps the world rounds going. B is SIGKILLed at step 40 and
    started again: eu's syncer loses it and takes it back, us never hears of it, and all four
    sites end on one model."""
    overrides = [
        "topology.sites=[{name: A, workers: 1}, {name: B, workers: 2}, {name: C, workers: 1}, "
        "{name: D, workers: 1, compute_speed: 0.4}]",
        REGIONS,
        "sync.region_every=2",
        "sync.H=8",
        "sync.quorum={sites: 1, grace_s: 0}",
        "train.steps=100000",
        "train.max_seconds=9",
        "optim.schedule=constant",
        "fault.kill=[B@40]",
        "fault.restart_after=0.5",
        "topology.links.emulate=inprocess",
        "topology.links.inter.bandwidth_bps=1e8",
        "topology.links.inter.latency_s=0.03",
    ]
    s, _ = _run(tmp_path, "kill", overrides)
    assert s["lost_sites"] == [] and [p["site"] for p in s["per_site"]] == ["A", "B", "C", "D"]
    assert len(set(s["global_param_hash"].values())) == 1 and s["hashes_agree_within_sites"]
    eu, us = _logs(s)
    events = [(m["kind"], m["sites"]) for m in eu if m["kind"] in ("lost", "rejoined")]
    assert events == [("lost", [1]), ("rejoined", [1])]
    assert not any(m["kind"] in ("lost", "rejoined") or 1 in m["sites"] or 0 in m["sites"] for m in us if m["kind"] != "world")
    assert _world(eu) == _world(us) and len(_world(eu)) >= 4  # the same world rounds on both syncers
    steps = {p["site"]: p["steps"] for p in s["per_site"]}
    assert steps["C"] > 2 * steps["D"]  # D is late, never waited for
    late = [st for m in us if m["kind"] == "quorum" and 3 in m["sites"] for st in m["staleness"]]
    assert late and max(late) >= 1
    # across regions: each syncer's contribution to each world round, to the other syncer, and nothing else
    contributions = sum(len(w) for w in _world(eu))
    assert s["inter_region_bytes"] == contributions * (4 * s["params"] + HEADER)
    assert s["final_eval_loss"] < s["eval_curve"][0]["eval_loss"]


def test_a_world_contribution_of_the_wrong_size_or_not_finite_weighs_nothing() -> None:
    """What another region's syncer sends is checked before it is used: a contribution of the
    wrong length or with a non-finite value counts with weight 0 and zeros (it costs its region
    the world round, never the run); a good one keeps its tokens and values."""
    from geotrain.comm.mailbox import Message
    from geotrain.config import SyncConfig
    from geotrain.round.outer import averaging
    from geotrain.round.world import WORLD, WorldTier

    theta = [torch.zeros(3), torch.zeros(2)]
    cfg = SyncConfig(quorum={"sites": 1}, region_every=2)
    tier = WorldTier(0, [0, 5], theta, averaging, object(), cfg, {"none": None})  # type: ignore[arg-type]

    def sent(values: torch.Tensor, round_: int) -> Message:
        fields = [WORLD, float(round_), 40.0, 0.0, 0.0, 0.0, 80.0, 0.0, 0.0, 0.0]
        return Message(5, 0.0, fields, values.to(torch.float32).contiguous().view(torch.uint8))

    tier.take(sent(torch.arange(5.0), 0))
    tier.take(sent(torch.arange(4.0), 1))
    tier.take(sent(torch.tensor([1.0, float("nan"), 0.0, 0.0, 0.0]), 2))
    good, short, nan = (tier.got[(1, r)] for r in range(3))
    assert good.tokens == 40.0 and torch.equal(good.delta, torch.arange(5.0))
    for bad in (short, nan):
        assert bad.tokens == 0.0 and torch.equal(bad.delta, torch.zeros(5))
