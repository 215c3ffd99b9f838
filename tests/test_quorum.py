"""Asynchronous quorum rounds (sync.quorum): the merge rule, equality with lock-step DiLoCo when
the quorum is every site, late sites that never wait, the final synchronous round, and the
configs it refuses (real processes, Gloo on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import queue
import signal
import statistics
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from geotrain.codecs import build_codec
from geotrain.comm.mailbox import Message, Rejoins, StoreChannel, channel_keys, down_key, join_key
from geotrain.comm.procs import listening_store
from geotrain.config import CODEC_BITS, load_config
from geotrain.errors import ConfigError, LaunchError
from geotrain.launch.local import launch_local
from geotrain.plan.strategies import STAR, choose_round
from geotrain.round.merge import Update, dynamic_steps, merge_weights
from geotrain.round.outer import DelayedNesterov, outer_step_, weighted_mean
from geotrain.round.syncer import FIELDS
from tests.helpers import TINY

# timing-sensitive runs (relative speeds, time limits, measured links): the test command runs them
# after the others, one at a time, with no other test loading the machine
pytestmark = pytest.mark.timing

TWO = "topology.sites=[{name: A, workers: 2}, {name: B, workers: 1}]"
# sites A and B at full speed, C at a quarter, for 6 s on an emulated 100 Mbit/s, 10 ms link
SLOW_C = [
    "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1, compute_speed: 0.25}]",
    "train.steps=100000",
    "train.max_seconds=6",
    "optim.schedule=constant",
    "topology.links.emulate=inprocess",
    "topology.links.inter.bandwidth_bps=1e8",
    "topology.links.inter.latency_s=0.01",
]


THREE = "topology.sites=[{name: A, workers: 1}, {name: B, workers: 2}, {name: C, workers: 1}]"  # C slow with SLOW_C


def test_merge_weights_are_tokens_discounted_by_staleness() -> None:
    d = torch.zeros(1)
    ups = [Update(0, 5, 10, 2, d), Update(1, 4, 10, 1, d), Update(2, 2, 5, 1, d)]
    assert merge_weights(ups, 5, True, 0.5) == [20.0, 10.0 * 2**-0.5, 5.0 * 4**-0.5]
    assert merge_weights(ups, 5, False, 0.5) == [1.0, 2**-0.5, 0.5]
    assert merge_weights(ups, 5, True, 0.0) == [20.0, 10.0, 5.0]  # no discount
    assert merge_weights(ups[:1], 5, True, 3.0) == [20.0]  # an update on time is not discounted


def test_weighted_mean_does_the_synchronous_rounds_arithmetic() -> None:
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(1000, generator=g) for _ in range(3))
    assert torch.equal(weighted_mean([a, b], [3.0, 3.0], 6.0), (a + b) / 2)  # equal: sum, then divide
    assert torch.equal(weighted_mean([a, b], [2.0, 1.0], 3.0), a * (2.0 / 3.0) + b * (1.0 / 3.0))  # scale, then sum
    torch.testing.assert_close(weighted_mean([a, b, c], [1.0, 2.0, 1.0], 4.0), (a + 2 * b + c) / 4)
    # the discount shrinks a stale update outright, even alone in its merge (total = undiscounted tokens)
    assert torch.equal(weighted_mean([a], [0.5], 1.0), a * 0.5)


@pytest.mark.parametrize("nesterov", [True, False])
def test_delayed_nesterov_over_a_world_round_is_one_outer_step_on_its_mean(nesterov: bool) -> None:
    cfg = load_config(None, [f"sync.nesterov={str(nesterov).lower()}"]).sync
    gen = torch.Generator().manual_seed(1)
    start = [torch.randn(30, generator=gen), torch.randn(4, 5, generator=gen)]
    grads = [torch.randn(50, generator=gen) for _ in range(12)]

    def sgd(theta: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(theta, lr=cfg.outer_sgd[0], momentum=cfg.outer_sgd[1], nesterov=cfg.outer_sgd[2])

    delayed = [t.clone() for t in start]
    dn = DelayedNesterov(delayed, sgd(delayed), cfg, sites=4)
    ref = [t.clone() for t in start]
    opt = sgd(ref)
    for k in range(0, 12, 4):  # 4 sites: one update per merge (each a quarter of the world), or 2 + 1 + 1
        parts = [grads[k : k + 1], grads[k + 1 : k + 2], grads[k + 2 : k + 4]] if k == 4 else [[g] for g in grads[k : k + 4]]
        for part in parts:
            dn.step(sum(part) / 4, updates=len(part))
        outer_step_(opt, ref, torch.stack(grads[k : k + 4]).mean(0))
        for x, y in zip(delayed, ref, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    dn.step(torch.stack(grads[:4]).mean(0), updates=4)  # then a whole round: the optimizer, with the same buffer
    outer_step_(opt, ref, torch.stack(grads[:4]).mean(0))
    for x, y in zip(delayed, ref, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    one = [t.clone() for t in start]
    dn1, ref1 = DelayedNesterov(one, sgd(one), cfg, sites=2), [t.clone() for t in start]
    opt1 = sgd(ref1)
    for gk in grads:  # every merge a whole round (a quorum of every site): the optimizer itself, bit for bit
        dn1.step(gk, updates=2)
        outer_step_(opt1, ref1, gk)
    assert all(torch.equal(x, y) for x, y in zip(one, ref1, strict=True))


def test_dynamic_local_updates_scale_h_by_measured_rate() -> None:
    assert dynamic_steps([10.0, 5.0, 2.5, 0.0], [20, 20, 20, 20], 200) == [200, 100, 50, 20]  # unmeasured: kept
    assert dynamic_steps([1.0, 1000.0], [7, 7], 200) == [1, 200]  # at least one step
    assert dynamic_steps([3.0, 3.0], [5, 5], 8) == [8, 8]


def _run(tmp: Path, name: str, overrides: list[str]) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg = load_config(None, TINY + ["run.baseline=none", "train.seed=3", *overrides])
    summary = launch_local(cfg, tmp / name, console_print=None)
    return summary, torch.load(tmp / name / "final_model.pt")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quorum_rounds_adapt_h_and_codec_to_the_links_the_sites_measure(tmp_path: Path) -> None:
    """sync.adapt with quorum rounds: each site measures its link to the syncer (an empty message
    and back, and its round's bytes both ways over the seconds its exchange took, less its wait
    for the quorum), sends that with its next update, and the syncer chooses every site's next H
    and codec with the planner's formula for a star. On an emulated 1 Mbit/s, 20 ms link the
    measurements are the link's, the choice compresses, and every site ends on one model; with
    dynamic local steps too."""
    lo, hi, target = 2, 20, 0.9
    three = "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}]"
    link = ["topology.links.emulate=inprocess", "topology.links.inter.bandwidth_bps=1e6", "topology.links.inter.latency_s=0.02"]
    adapt = [f"sync.adapt={{target: {target}, H_min: {lo}, H_max: {hi}}}", "sync.quorum={sites: 2}", "sync.H=5"]
    s, _ = _run(tmp_path, "adapt", [three, *link, *adapt, "train.steps=60", "train.eval_every=0"])
    log = s["adapt"]
    codecs = {c: float(CODEC_BITS[c]) for c in ("none", "bf16", "int8", "fp4")}
    assert log and log[0]["H"] == 5 and log[0]["codec"] == "none"
    for prev, a in zip([None, *log], log, strict=False):
        assert 0 not in a["sites"]  # site 0 talks to the syncer in memory: it measures nothing
        assert all(0.7e6 < b < 1.3e6 for b in a["link_bps"]) and 0.04 <= a["rtt_s"] < 0.2, a  # the emulated link
        bps, T = min(a["link_bps"]), a["step_s"]
        assert a["next"] == choose_round(bps, a["params"], T, STAR, a["rtt_s"], lo, hi, codecs, target)
        assert prev is None or (a["H"], a["codec"]) == (prev["next"]["H"], prev["next"]["codec"])
    assert log[-1]["next"]["codec"] != "none"  # 1 Mbit/s: it compresses
    assert len(set(s["global_param_hash"].values())) == 1 and s["hashes_agree_within_sites"]
    # with dynamic local steps (sync.pace=adaptive) the chosen H is the fastest site's: C, at a
    # third of the speed, runs fewer steps per round, from its measured rate
    slow = "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1, compute_speed: 0.33}]"
    d, _ = _run(tmp_path, "dynamic", [slow, *link, *adapt, "sync.pace=adaptive", "train.steps=60", "train.eval_every=0"])
    merged = [m for m in d["pace"] if m["kind"] == "quorum"]
    assert d["adapt"] and any(2 in m["sites"] and m["steps"][m["sites"].index(2)] < max(m["steps"]) for m in merged), merged
    assert len(set(d["global_param_hash"].values())) == 1 and d["hashes_agree_within_sites"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "sites", [TWO, "topology.sites=[{name: A, workers: 2}, {name: B, workers: 1}, {name: C, workers: 1}]"], ids=["2", "3"]
)
def test_a_quorum_of_every_site_and_an_endless_grace_window_is_lock_step_diloco(tmp_path: Path, sites: str) -> None:
    """Sites of unequal sizes, token-weighted, Nesterov outer steps; 3 rounds, then a last partial
    one. Two sites: bit for bit (the sum is one addition, exact in either order). Three: the ring
    all-reduce adds each chunk in another order than the syncer's site order, so the models agree
    to rounding (4.2e-7 at most when measured) and the merges are the same."""
    n = sites.count("name:")
    common = [sites, "train.steps=14", "sync.H=4", "topology.links.emulate=off"]
    sync, sync_w = _run(tmp_path, "sync", common)
    asy, asy_w = _run(tmp_path, "async", [*common, f"sync.quorum={{sites: {n}, grace_s: .inf}}"])
    assert sync_w.keys() == asy_w.keys()
    if n == 2:
        assert all(torch.equal(sync_w[k], asy_w[k]) for k in sync_w)
        assert asy["final_eval_loss"] == sync["final_eval_loss"]
    else:
        assert not all(torch.equal(sync_w[k], asy_w[k]) for k in sync_w)  # (if this ever holds, say bit for bit)
        for k in sync_w:
            torch.testing.assert_close(asy_w[k], sync_w[k], rtol=0, atol=5e-6)
        assert asy["final_eval_loss"] == pytest.approx(sync["final_eval_loss"], rel=1e-6)
    assert len(set(asy["global_param_hash"].values())) == 1 and asy["hashes_agree_within_sites"]
    merges = asy["pace"]  # the syncer's log: every round held every site's update, none late
    assert [m["kind"] for m in merges] == ["quorum"] * 3 + ["final"]
    assert all(m["sites"] == list(range(n)) and m["staleness"] == [0] * n for m in merges)
    assert [m["steps"] for m in merges] == [[4] * n] * 3 + [[2] * n]
    assert asy["inter_site_bytes"] > 0


@pytest.mark.timeout(300)
def test_quorum_rounds_checkpoint_at_a_barrier_and_resume_exactly(tmp_path: Path) -> None:
    """Checkpoints of asynchronous rounds: the round before each is a barrier (every live site's
    update merged, every site answered with the same model), then every rank writes its state and
    site 0 the syncer's (global model, delayed momentum, version, log). A quorum of every site with
    an endless grace window runs the same merges every time, so the run resumed from the
    checkpoint at step 8 ends bit for bit where the run that never stopped ends; with a quorum of
    2 of 3 and int8 both ways, the resumed run ends on one model."""
    three = "topology.sites=[{name: A, workers: 2}, {name: B, workers: 1}, {name: C, workers: 1}]"
    common = [three, "train.steps=14", "sync.H=4", "topology.links.emulate=off", "sync.quorum={sites: 3, grace_s: .inf}"]
    ckpt = tmp_path / "ckpt"
    full, full_w = _run(tmp_path, "full", [*common, "checkpoint.every=8", f"checkpoint.dir={ckpt}"])
    assert [m["kind"] for m in full["pace"]] == ["quorum", "checkpoint", "quorum", "final"]
    resumed, resumed_w = _run(tmp_path, "resumed", [*common, f"checkpoint.resume={ckpt / 'step-00000008'}"])
    assert all(torch.equal(full_w[k], resumed_w[k]) for k in full_w)
    assert resumed["final_eval_loss"] == full["final_eval_loss"]
    assert resumed["pace"] == full["pace"][:2] + resumed["pace"][2:] and len(resumed["pace"]) == 4
    two_of_three = [*common[:-1], "sync.quorum={sites: 2}", "sync.codec=int8", "train.steps=24"]
    ckpt2 = tmp_path / "ckpt2"
    _run(tmp_path, "q2", [*two_of_three, "checkpoint.every=8", f"checkpoint.dir={ckpt2}"])
    q2, _ = _run(tmp_path, "q2-resumed", [*two_of_three, f"checkpoint.resume={ckpt2 / 'step-00000016'}"])
    assert len(set(q2["global_param_hash"].values())) == 1 and q2["hashes_agree_within_sites"]
    assert "checkpoint" in [m["kind"] for m in q2["pace"]]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_slow_site_is_late_never_waits_and_ends_on_the_same_model(tmp_path: Path) -> None:
    """Site C runs at a quarter speed on an emulated 100 Mbit/s, 10 ms link; a quorum of one: the
    fast sites merge on their own, C's updates arrive late and are merged with a staleness discount,
    and the final round leaves every rank on one model."""
    s, _ = _run(tmp_path, "late", [*SLOW_C, "sync.H=32", "sync.quorum={sites: 1, grace_s: 0}"])
    a, b, c = s["per_site"]
    assert c["steps"] > 0 and a["steps"] > 1.5 * c["steps"]  # nobody waited for C
    merges = s["pace"]
    late = [(m["staleness"][i], m["weights"][i], m["steps"][i]) for m in merges for i, site in enumerate(m["sites"]) if site == 2]
    # C's rounds are late as a rule (its last one may not be; and on a machine loaded by other tests the
    # fast sites slow down too, so a few of C's rounds may land before any merge)
    assert late and sum(st >= 1 for st, _, _ in late[:-1]) >= len(late[:-1]) / 2, late
    assert all(w == pytest.approx(steps * (1 + st) ** -0.5, abs=1e-3) for st, w, steps in late)
    assert merges[-1]["kind"] == "final"
    assert sum(sum(m["steps"]) for m in merges) == a["steps"] + b["steps"] + c["steps"]  # every step merged once
    # how busy C stays (it waits only for the round trip to the syncer and the final round) is a
    # benchmark target: bench hetero's async runs keep every site >= 98% busy (hetero.json)
    assert len(set(s["global_param_hash"].values())) == 1 and s["hashes_agree_within_sites"]
    assert s["final_eval_loss"] < s["eval_curve"][0]["eval_loss"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_site_killed_mid_round_is_late_forever_and_the_others_finish_on_one_model(tmp_path: Path) -> None:
    """Site B (two workers) is SIGKILLed by the launcher at step 40, in the middle of its third
    round (H = 16): the syncer notices its closed connection, the other sites go on to the end of
    their time, and the final round leaves A and C on one model, evaluated by site A alone."""
    overrides = [*SLOW_C[1:], THREE, "sync.H=16", "sync.quorum={sites: 1, grace_s: 0}", "fault.kill=[B@40]"]
    s, _ = _run(tmp_path, "kill", overrides)
    assert s["lost_sites"] == ["B"]
    a, c = s["per_site"]
    assert (a["site"], c["site"]) == ("A", "C") and min(a["steps"], c["steps"]) > 100  # they went on for 6 s
    merges = s["pace"]
    lost = next(i for i, m in enumerate(merges) if m["kind"] == "lost")
    assert merges[lost]["sites"] == [1] and "late forever" in merges[lost]["why"]
    b_steps = [m["steps"][i] for m in merges for i, site in enumerate(m["sites"]) if site == 1 and m["kind"] != "lost"]
    assert sum(b_steps) == 32  # its two whole rounds were merged; the one it died in never came
    assert all(1 not in m["sites"] for m in merges[lost + 1 :])
    assert merges[-1]["kind"] == "final"
    assert sorted(s["global_param_hash"]) == ["A", "C"] and len(set(s["global_param_hash"].values())) == 1
    assert s["hashes_agree_within_sites"] and len(s["per_rank"]) == 2
    log = (tmp_path / "kill" / "logs" / "rank1.log").read_text()
    assert "fault injection: kill this site now" in log
    assert s["final_eval_loss"] < s["eval_curve"][0]["eval_loss"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_site_comes_back_heals_from_the_syncer_and_ends_on_the_same_model(tmp_path: Path) -> None:
    """Site B (two workers) is SIGKILLed at step 40 and started again 1 s later
    (``fault.restart_after``): its new ranks form a world of their own, rejoin through the run's
    store, and go on from the syncer's model and from step 32 (its two delivered rounds). Killed
    again at step 72, it is lost at once (the launcher tells the syncer: a store channel does not
    close), comes back from step 64, and the final round leaves all three sites on one model."""
    overrides = [
        *SLOW_C[1:],
        "train.max_seconds=8",
        THREE,
        "sync.H=16",
        "sync.quorum={sites: 1, grace_s: 0}",
        "fault.kill=[B@40, B@72]",
        "fault.restart_after=1",
    ]
    s, _ = _run(tmp_path, "rejoin", overrides)
    assert s["lost_sites"] == []
    assert [p["site"] for p in s["per_site"]] == ["A", "B", "C"]
    merges = s["pace"]
    events = [(i, m) for i, m in enumerate(merges) if m["kind"] in ("lost", "rejoined")]
    assert [m["kind"] for _, m in events] == ["lost", "rejoined", "lost", "rejoined"]
    assert all(m["sites"] == [1] for _, m in events)
    assert "connection closed" in events[0][1]["why"] and "the launcher saw them go" in events[2][1]["why"]
    assert "incarnation 1" in events[1][1]["why"] and "its step 32" in events[1][1]["why"]
    assert "incarnation 2" in events[3][1]["why"] and "its step 64" in events[3][1]["why"]
    for (lost, _), (back, _) in (events[0:2], events[2:4]):  # nothing of B while it was away
        assert all(1 not in m["sites"] for m in merges[lost + 1 : back])
    # (a merge may hold two of B's updates: one late, one on time)
    b_steps = [
        k for m in merges if m["kind"] in ("quorum", "final") for site, k in zip(m["sites"], m["steps"], strict=True) if site == 1
    ]
    after = [m for m in merges[events[3][0] + 1 :] if 1 in m["sites"]]
    assert len(after) >= 2  # the last incarnation delivered, and its updates were merged
    assert sum(b_steps) == 32 + 32 + (s["per_site"][1]["steps"] - 64)  # rounds 3-4 of incarnation 1, then from 64 on
    assert merges[-1]["kind"] == "final"  # (it may hold nothing: every last update may be merged already)
    assert len(set(s["global_param_hash"].values())) == 1 and s["hashes_agree_within_sites"]
    assert len(s["per_rank"]) == 4
    for rank in (1, 2):  # both of B's ranks were started twice more, each time as their own world
        for k in (1, 2):
            assert (tmp_path / "rejoin" / "logs" / f"rank{rank}.{k}.log").exists()
    assert "rejoined the asynchronous rounds" in (tmp_path / "rejoin" / "logs" / "rank1.2.log").read_text()
    assert s["final_eval_loss"] < s["eval_curve"][0]["eval_loss"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_codec_sends_both_ways_encoded_and_the_final_round_is_exact(tmp_path: Path) -> None:
    """int8 on sites of 2 and 1 workers and a quorum of both: the update and the answer cross
    encoded (about 4x fewer bytes than the fp32 run of the same rounds), the sites hold the
    syncer's encoded changes in between, the last answer is fp32, so every rank ends on one
    model, and the loss is close to fp32's. A NaN update crosses in fp32 and is left out."""
    common = [TWO, "train.steps=40", "sync.H=8", "topology.links.emulate=off", "sync.quorum={sites: 2, grace_s: .inf}"]
    fp32, _ = _run(tmp_path, "fp32", common)
    int8, _ = _run(tmp_path, "int8", [*common, "sync.codec=int8", "fault.nan=[B@2]"])
    # only B's leader and the syncer talk across sites: 5 rounds, then a final delivery of no steps.
    # B sends 4 int8 updates, the NaN one in fp32 and an empty final; the syncer 5 int8 answers
    # and the final one in fp32. Every message has a header of float64s: the arrival time, the
    # payload's length and the syncer protocol's fields.
    n, head = fp32["params"], (2 + FIELDS) * 8
    enc = build_codec("int8").encoded_nbytes(n)
    assert fp32["inter_site_bytes"] == 11 * (head + 4 * n) + head and fp32["compression_ratio"] == 1.0
    assert int8["inter_site_bytes"] == 9 * (head + enc) + 2 * (head + 4 * n) + head
    assert int8["compression_ratio"] == pytest.approx((11 * (head + 4 * n) + head) / int8["inter_site_bytes"])
    assert len(set(int8["global_param_hash"].values())) == 1 and int8["hashes_agree_within_sites"]
    rejected = [m for m in int8["pace"] if m["kind"] == "rejected"]
    assert len(rejected) == 1 and rejected[0]["sites"] == [1]
    assert abs(int8["final_eval_loss"] / fp32["final_eval_loss"] - 1) < 0.05
    assert int8["final_eval_loss"] < int8["eval_curve"][0]["eval_loss"]


# a hub that loses a silent site after 3 s (beats every 0.5 s), sites that wait for it up to 60 s
LIVE = ["liveness.hub_timeout_s=60", "liveness.hub_heartbeat_s=0.5", "liveness.hub_lost_after_s=3"]


def _start_three_sites(out: Path, quorum: str, *extra: str) -> tuple[threading.Thread, dict[str, Any], list[int]]:
    """Sites of 1, 2 and 1 workers (C slow) launched in a thread, once B is a few rounds in: the
    thread, the summary it will fill, and the ranks' PIDs (B's are 1 and 2)."""
    cfg = load_config(None, TINY + ["run.baseline=none", *SLOW_C[1:], THREE, "sync.H=16", quorum, *extra])
    got: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: got.update(launch_local(cfg, out, console_print=None)), daemon=True)
    runner.start()
    deadline = time.monotonic() + 120
    while not ((out / "logs" / "rank1.log").exists() and "step" in (out / "logs" / "rank1.log").read_text()):
        assert time.monotonic() < deadline and runner.is_alive(), "site B never started training"
        time.sleep(0.1)
    time.sleep(1.0)  # a few rounds in
    return runner, got, json.loads((out / "pids.json").read_text())["ranks"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_killed_from_outside_loses_its_site_and_the_others_finish(tmp_path: Path) -> None:
    """Not an injected fault: one of site B's two ranks gets a SIGKILL from this test, by PID. The
    launcher sees the rank die, kills B's other rank, and A and C finish on one model."""
    runner, got, pids = _start_three_sites(tmp_path / "ext", "sync.quorum={sites: 1, grace_s: 0}")
    os.kill(pids[2], signal.SIGKILL)  # B's local rank 1
    runner.join(timeout=180)
    assert not runner.is_alive() and got, "the run did not finish without site B"
    assert got["lost_sites"] == ["B"] and [p["site"] for p in got["per_site"]] == ["A", "C"]
    assert sorted(got["global_param_hash"]) == ["A", "C"] and len(set(got["global_param_hash"].values())) == 1
    assert any(m["kind"] == "lost" and m["sites"] == [1] for m in got["pace"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_killed_from_outside_comes_back_with_restart_after(tmp_path: Path) -> None:
    """Not an injected fault either: one of B's ranks gets a SIGKILL from this test, by PID, and
    ``fault.restart_after`` is set. The launcher loses B, starts it again 1 s later, and B rejoins
    the rounds; every site ends on one model. (``fault.kill`` is empty: the restarted site has no
    injected kill to skip.)"""
    out = tmp_path / "back"
    runner, got, pids = _start_three_sites(
        out, "sync.quorum={sites: 1, grace_s: 0}", "train.max_seconds=8", "fault.restart_after=1"
    )
    os.kill(pids[2], signal.SIGKILL)  # B's local rank 1
    runner.join(timeout=180)
    assert not runner.is_alive() and got, "the run did not finish"
    assert got["lost_sites"] == [] and [p["site"] for p in got["per_site"]] == ["A", "B", "C"]
    kinds = [m["kind"] for m in got["pace"] if m["kind"] in ("lost", "rejoined") and m["sites"] == [1]]
    assert kinds == ["lost", "rejoined"], kinds
    assert len(set(got["global_param_hash"].values())) == 1 and got["hashes_agree_within_sites"]
    assert "rejoined the asynchronous rounds" in (out / "logs" / "rank1.1.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_site_stopped_from_outside_goes_silent_is_lost_and_the_others_finish(tmp_path: Path) -> None:
    """Both of site B's ranks get a SIGSTOP from this test: their connections stay open, so only
    their silent heartbeats tell. The syncer loses B after liveness.hub_lost_after_s; A and C finish on one
    model, at their time limit, and the launcher kills B's stopped ranks. Without the heartbeat the
    final round would wait for B until liveness.hub_timeout_s and the run would fail."""
    quorum = "sync.quorum={sites: 1, grace_s: 0}"
    runner, got, pids = _start_three_sites(tmp_path / "hung", quorum, *LIVE)
    b_ranks = pids[1:3]
    for pid in b_ranks:
        os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    runner.join(timeout=120)
    assert not runner.is_alive() and got, "the run did not finish without site B"
    assert time.monotonic() - stopped < 40  # the time limit (6 s of training) and the loss, not timeout_s
    assert got["lost_sites"] == ["B"] and [p["site"] for p in got["per_site"]] == ["A", "C"]
    assert sorted(got["global_param_hash"]) == ["A", "C"] and len(set(got["global_param_hash"].values())) == 1
    lost = [m for m in got["pace"] if m["kind"] == "lost"]
    assert len(lost) == 1 and lost[0]["sites"] == [1] and "silent" in lost[0]["why"], lost
    after = [m for m in got["pace"] if m["t"] > lost[0]["t"] and m["kind"] != "lost"]
    assert all(1 not in m["sites"] for m in after)  # nothing of B after it was lost
    for pid in b_ranks:  # killed by the launcher once the run was over (and reaped by the zygote)
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split(") ", 1)[1][0] == "Z"


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_site_stopped_from_outside_is_killed_and_comes_back_with_restart_after(tmp_path: Path) -> None:
    """B's ranks get a SIGSTOP from this test, with ``fault.restart_after``: the syncer loses B for
    silence and reports it in the run's store; the launcher kills B's stopped ranks (only it can)
    and starts B again 1 s later; B rejoins and every site ends on one model."""
    quorum = "sync.quorum={sites: 1, grace_s: 0}"
    out = tmp_path / "hung-back"
    runner, got, pids = _start_three_sites(out, quorum, *LIVE, "train.max_seconds=14", "fault.restart_after=1")
    for pid in pids[1:3]:
        os.kill(pid, signal.SIGSTOP)
    runner.join(timeout=150)
    assert not runner.is_alive() and got, "the run did not finish"
    assert got["lost_sites"] == [] and [p["site"] for p in got["per_site"]] == ["A", "B", "C"]
    events = [m for m in got["pace"] if m["kind"] in ("lost", "rejoined") and m["sites"] == [1]]
    assert [m["kind"] for m in events] == ["lost", "rejoined"] and "silent" in events[0]["why"], events
    assert len(set(got["global_param_hash"].values())) == 1 and got["hashes_agree_within_sites"]
    assert "rejoined the asynchronous rounds" in (out / "logs" / "rank1.1.log").read_text()
    for pid in pids[1:3]:  # the stopped ranks were killed (and reaped by the zygote)
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split(") ", 1)[1][0] == "Z"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_site_that_fails_at_the_start_still_stops_the_run(tmp_path: Path) -> None:
    """Before training starts the others would wait for the failed site in the start's collectives:
    a site whose corpus is missing on its machine stops the run with the usual one line."""
    topo = "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1, corpus: /nonexistent/corpus.txt}]"
    cfg = load_config(None, TINY + ["run.baseline=none", "train.steps=20", topo, "sync.quorum={sites: 1}"])
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 \(site B, local rank 0\) exited with code"):
        launch_local(cfg, tmp_path / "bad", console_print=None)
    assert time.monotonic() - t0 < 60  # not the rendezvous timeout
    assert "topology.sites[1].corpus: file or directory not found" in (tmp_path / "bad" / "logs" / "rank1.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dynamic_local_updates_give_a_slow_site_fewer_steps_per_round(tmp_path: Path) -> None:
    """Dynamic local updates, sync.pace=adaptive (what adaptive pace means in asynchronous
    rounds; the old key sync.quorum.local_steps is refused naming it): a first round of H/10 steps
    measures every site's pace; then the syncer gives site C, at a quarter speed, about a quarter
    of H, so it delivers about as often as the fast sites."""
    assert load_config(None, ["sync.quorum={sites: 1}", "sync.pace=adaptive"]).sync.dynamic_quorum_steps
    with pytest.raises(ConfigError, match=r"^sync\.quorum\.local_steps: moved to sync\.pace "):
        load_config(None, ["sync.quorum={sites: 1, local_steps: dynamic}"])
    assert not load_config(None, ["sync.quorum={sites: 1}"]).sync.dynamic_quorum_steps
    s, _ = _run(tmp_path, "dynamic", [*SLOW_C, "sync.H=160", "sync.quorum={sites: 1, grace_s: 0}", "sync.pace=adaptive"])
    merges = s["pace"]
    assert merges[0]["steps"] == [16] * len(merges[0]["steps"])  # the first round: H/10
    assigned = [m["next_H"] for m in merges if m["kind"] == "quorum"]
    assert all(max(h[0], h[1]) == 160 for h in assigned)  # a fastest site runs H
    c_assigned = [h[2] for h in assigned]
    assert all(h <= 80 for h in c_assigned) and statistics.median(c_assigned) <= 60  # well under H: a quarter speed
    # each assignment is H x the site's logged rate / the fastest (the rates are rounded in the log)
    rated = [m for m in merges if m["kind"] == "quorum" and all(r > 0 for r in m["rates"])]
    assert rated and all(abs(m["next_H"][2] - 160 * m["rates"][2] / max(m["rates"])) <= 1 for m in rated)
    # the rate C is measured at: about a quarter of the fastest alone on 2 cores; a parallel test
    # run's stalls and wake-up waits make it read lower (docs/PACE.md), never higher
    assert 0.03 < statistics.median(m["rates"][2] / max(m["rates"]) for m in rated) < 0.4
    c_steps = [m["steps"][i] for m in merges if m["kind"] == "quorum" for i, site in enumerate(m["sites"]) if site == 2]
    assert c_steps and all(k <= 80 for k in c_steps)  # C ran what it was given
    a, b, c = s["per_site"]
    assert a["steps"] > 2 * c["steps"]
    assert sum(sum(m["steps"]) for m in merges) == a["steps"] + b["steps"] + c["steps"]  # every step merged once
    assert len(set(s["global_param_hash"].values())) == 1 and s["hashes_agree_within_sites"]
    assert s["final_eval_loss"] < s["eval_curve"][0]["eval_loss"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["sync.quorum={sites: 5}"], "sync.quorum.sites: 5 is more than the 2 sites in topology.sites (allowed: 1..2)"),
        (["sync.quorum={sites: 1}", "sync.algorithm=ddp"], "sync.algorithm: quorum rounds merge the pseudo-gradients of rounds"),
        (["sync.quorum={sites: 1}", "sync.codec=powersgd"], "sync.codec: PowerSGD's low-rank factors are one sum"),
        (
            ["sync.quorum={sites: 1}", "elastic.enabled=true"],
            "sync.quorum.sites: elastic rounds need more than half of the sites (2 of 2): two rounds of disjoint sites",
        ),
        (
            ["sync.quorum={sites: 1}", "fault.kill=[A@5]"],
            "fault.kill: site A holds a quorum syncer; kill another site (allowed: B)",
        ),
        (
            [
                "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}]",
                "topology.regions=[{name: eu, sites: [A, B]}, {name: us, sites: [C]}]",
                "sync.region_every=2",
                "sync.quorum={sites: 1}",
                "fault.kill=[C@5]",
            ],
            "fault.kill: site C holds a quorum syncer; kill another site (allowed: B)",
        ),
        (
            [
                "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}]",
                "topology.regions=[{name: eu, sites: [A]}, {name: us, sites: [B]}]",
                "sync.region_every=2",
                "sync.quorum={sites: 1}",
                "checkpoint.every=10",
            ],
            "checkpoint.every: a checkpoint is one instant at which every site holds the state it resumes from",
        ),
        (
            ["fault.kill=[B@5]"],
            "fault.kill: failing a site this way needs elastic.enabled=true (or sync.quorum",
        ),
        (["sync.quorum={sites: 1, grace_s: -1}"], "grace_s"),
        (["sync.quorum={grace_s: 1}"], "sites"),
        (
            ["liveness.hub_heartbeat_s=2", "liveness.hub_lost_after_s=4"],
            "liveness.hub_lost_after_s: must exceed twice hub_heartbeat_s=2 (got 4)",
        ),
        (
            ["liveness.hub_timeout_s=30", "liveness.hub_lost_after_s=30"],
            "liveness.hub_lost_after_s: must be less than hub_timeout_s=30",
        ),
    ],
)
def test_bad_quorum_configs_are_refused_in_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["sync.quorum={sites: 1}", "sync.algorithm=streaming", "sync.within_site=fsdp"],
        ["sync.quorum={sites: 1}", "sync.pace=adaptive", "checkpoint.every=10"],
        ["sync.quorum={sites: 2}", "sync.pace=adaptive", "sync.algorithm=streaming", "checkpoint.every=10"],
    ],
)
def test_quorum_rounds_load_with_fsdp_streaming_and_checkpoints(overrides: list[str]) -> None:
    """Once refused: the round engine runs Streaming fragments over FSDP shards in quorum rounds,
    and checkpoints each site's own state at a round (tests/test_combinations.py runs them)."""
    assert load_config(None, overrides).sync.quorum is not None


@pytest.mark.timeout(60)
def _store_pair() -> tuple[Any, Callable[[], Any], StoreChannel, StoreChannel]:
    """A real TCPStore on 127.0.0.1 and the two ends of a channel through it (site 1, incarnation 2)."""
    server = listening_store("127.0.0.1", 10.0)

    def connect() -> Any:
        return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False)

    up, down = channel_keys(1, 2)
    site = StoreChannel(connect, send=up, recv=down, fields=3, src=0)
    syncer = StoreChannel(connect, send=down, recv=up, fields=3, src=5)
    return server, connect, site, syncer


@pytest.mark.timeout(60)
def test_a_store_channel_carries_messages_in_order_and_leaves_nothing_behind() -> None:
    server, _, site, syncer = _store_pair()
    site.send([1.0, 2.0, 3.5], torch.arange(5, dtype=torch.float32))
    site.send([4.0, 0.0, 0.0], torch.empty(0))  # a final delivery of no steps
    first, second = syncer.receive(5.0), syncer.receive(5.0)
    assert first is not None and second is not None
    assert first.src == 5 and first.fields == [1.0, 2.0, 3.5] and torch.equal(first.floats(), torch.arange(5.0))
    assert second.fields == [4.0, 0.0, 0.0] and second.payload.numel() == 0
    assert server.num_keys() <= 1  # received keys are deleted (the count may include the store's own)
    t = time.monotonic()
    assert syncer.receive(0.3) is None and time.monotonic() - t < 10  # a bounded wait (0.3 s asked; 10 s: never ends)
    got: queue.Queue[Message] = queue.Queue()
    thread = syncer.listen(got, lambda m: m.fields[0] == 9.0)
    for i in range(3):
        site.send([float(i), 0.0, 0.0], torch.full((2,), float(i)))
    site.send([9.0, 0.0, 0.0], torch.empty(0))
    thread.join(5.0)
    assert not thread.is_alive() and [got.get_nowait().fields[0] for _ in range(4)] == [0.0, 1.0, 2.0, 9.0]


@pytest.mark.timeout(60)
def test_rejoins_see_a_new_incarnation_once_and_its_death_from_the_launcher() -> None:
    server, connect, _, _ = _store_pair()
    made: list[tuple[int, int]] = []
    rejoins = Rejoins(connect, lambda s, k: made.append((s, k)) or StoreChannel(connect, "a", "b", 1, s))
    assert rejoins.poll({1, 2}) == []
    connect().add(join_key(2), 1)  # site 2's leader, its first restart
    assert rejoins.poll({1, 2}) == [(2, 1)] and rejoins.poll({1, 2}) == []
    assert rejoins.down([2]) == []
    server.set(down_key(2), "1")  # the launcher saw incarnation 1 exit
    # TCPStore's set gets no answer: another connection can read before it lands. A check on the
    # same connection answers only after it (the launcher's own set is read rounds later)
    assert server.check([down_key(2)])
    assert rejoins.down([2]) == [2]
    connect().add(join_key(2), 1)
    assert rejoins.poll({2}) == [(2, 2)] and rejoins.down([2]) == []  # the new incarnation is not down


def test_the_watch_names_a_rank_that_stopped_beating(monkeypatch: pytest.MonkeyPatch) -> None:
    """comm/alive.py against a real store: rank 0 beats, rank 1 never does; once rank 0 stops it
    goes silent too. Silence is measured on the watcher's clock, from its first look."""
    from geotrain.comm.alive import Heartbeat, SilenceWatch
    from geotrain.comm.procs import host_store

    store, _ = host_store(timeout_s=30)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    beat = Heartbeat(0, 0.05)
    watch = SilenceWatch([0, 1], 0.05, 0.6)
    assert watch.silent([0, 1]) == {}  # nobody is silent before limit_s has passed
    time.sleep(0.8)
    assert list(watch.silent([0, 1])) == [1]
    beat.stop()
    time.sleep(0.8)
    assert sorted(watch.silent([0, 1])) == [0, 1]


def _mailbox_rank(rank: int) -> Any:
    from geotrain.comm.mailbox import Mailbox
    from geotrain.comm.session import rank_comm
    from tests.helpers import uniform_topology

    with rank_comm(uniform_topology(2, 1), "off") as (_groups, comm):
        box = Mailbox(comm, dist.new_group([0, 1]), 1)
        if rank == 1:
            early = box.receive(0, 0.2)  # nothing sent yet: times out, its receive stays pending
            dist.barrier()
            got = [box.receive(0, 10.0) for _ in range(2)]
            return early is None, [m.fields[0] if m is not None else None for m in got]
        dist.barrier()
        for i in (1.0, 2.0):
            box.send(1, [i], torch.empty(0))
        box.flush()
        return None


@pytest.mark.timeout(90)
def test_a_timed_out_receive_never_swallows_the_next_message() -> None:
    """A receive that timed out used to leave a thread that took the next message: the caller then
    got the message after it (or nothing). Now the next receive waits for that same receive."""
    from tests.helpers import run_ranks

    res = run_ranks(2, _mailbox_rank, timeout=60)
    assert res[1] == (True, [1.0, 2.0]), res[1]


@pytest.mark.timeout(60)
def test_a_store_that_is_gone_is_waited_out_logged_never_spun_on(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A channel's or a watch's store that went away: a receive waits its timeout out (it used to
    return at once, so its callers' loops spun at 100% CPU), a listener backs off, and both say
    so once; the watch stops counting silence, logs it, and gives up with StoreLost past its bound
    (an unreachable store used to make every rank look alive forever, without a word)."""
    from geotrain.comm import alive
    from geotrain.comm.alive import SilenceWatch, StoreLost
    from geotrain.comm.procs import host_store

    monkeypatch.setattr(alive, "_client", lambda period_s: alive.run_store(0.5))  # reconnections give up sooner
    server = listening_store("127.0.0.1", 10.0)
    port = server.port

    def connect() -> Any:
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2), wait_for_workers=False)

    syncer = StoreChannel(connect, send="x/down", recv="x/up", fields=3, src=5)
    assert syncer.receive(0.1) is None  # its client connects while the store is up
    del server  # the store's server stops (nothing else holds it)
    time.sleep(0.3)
    t = time.monotonic()
    assert syncer.receive(1.0) is None and time.monotonic() - t >= 0.9  # waited out, not returned at once
    got: queue.Queue[Message] = queue.Queue()
    cpu = time.process_time()
    thread = syncer.listen(got, lambda m: True)
    time.sleep(1.5)
    syncer.close()
    thread.join(5.0)  # a reconnection in progress ends within its client's timeout (2 s here)
    assert time.process_time() - cpu < 0.6 and not thread.is_alive()  # no spinning while the store is gone
    assert "the run's store failed while waiting" in capsys.readouterr().err

    store, _ = host_store(timeout_s=30)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    watch = SilenceWatch([0], 0.05, 0.3)
    watch.outage_limit_s = 1.0
    assert watch.silent([0]) == {}
    del store
    time.sleep(0.4)
    assert watch.silent([0]) == {}  # unknown, not silent (and not alive by default either: logged)
    assert "rendezvous store cannot be read" in capsys.readouterr().err
    deadline = time.monotonic() + 30
    with pytest.raises(StoreLost, match="has not answered for"):
        while time.monotonic() < deadline:
            watch.silent([0])
            time.sleep(0.05)
