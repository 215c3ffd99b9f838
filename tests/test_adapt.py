"""Adaptation to the measured network (sync.adapt): the planner's formula picks H and codec, the
link emulation follows a scheduled change, and a real run follows a 10x slowdown."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from geotrain.bench.adapt import adapt_record, held_record, plot_adapt
from geotrain.comm.emulate.inprocess import SharedLinks
from geotrain.comm.topology import Topology
from geotrain.config import CODEC_BITS, STREAMING_HOLD, Config, TopologyConfig, load_config
from geotrain.errors import ConfigError
from geotrain.launch.local import launch_local
from geotrain.plan.strategies import _volume_latency, achieved_bps, choose_round, streaming_effective_bps, utilization
from tests.helpers import TINY, drawn, lines

# timing-sensitive runs (relative speeds, time limits, measured links): the test command runs them
# after the others, one at a time, with no other test loading the machine
pytestmark = pytest.mark.timing

BITS = {"none": 32.0, "bf16": 16.0, "int8": 8.0, "fp4": 4.0}


def _brute_force(
    bps: float, params: float, step_s: float, sites: int, rtt: float, lo: int, hi: int, target: float
) -> tuple[str, int]:
    """The planner's formula evaluated at every codec and every H: the least compression that reaches
    the target, its smallest H; else the highest utilisation (ties: the most compression, H_max)."""
    u = {
        (c, h): utilization("diloco", bps, params, step_s, sites, rtt, h, 1, 0, {"diloco": b})
        for c, b in BITS.items()
        for h in range(lo, hi + 1)
    }
    for c in sorted(BITS, key=lambda c: -BITS[c]):
        ok = [h for h in range(lo, hi + 1) if u[(c, h)] >= target]
        if ok:
            return c, ok[0]
    return max(u, key=lambda k: (u[k], -BITS[k[0]], k[1]))


@pytest.mark.parametrize("bps", [1e6, 1e7, 3e7, 1e8, 1e9, 1e11])
@pytest.mark.parametrize("rtt", [0.002, 0.08])
def test_choose_round_is_the_planner_formulas_answer(bps: float, rtt: float) -> None:
    params, step_s, sites, lo, hi, target = 5e6, 0.05, 3, 5, 300, 0.85
    got = choose_round(bps, params, step_s, sites, rtt, lo, hi, BITS, target)
    assert (got["codec"], got["H"]) == _brute_force(bps, params, step_s, sites, rtt, lo, hi, target)
    u = utilization("diloco", bps, params, step_s, sites, rtt, got["H"], 1, 0, {"diloco": BITS[got["codec"]]})
    assert got["predicted_utilization"] == u and got["meets_target"] == (u >= target)


@pytest.mark.parametrize("bps", [1e5, 1e6, 1e7, 1e9])
@pytest.mark.parametrize("tau", [0, 5, 20])
def test_choose_round_for_streaming_is_the_planner_formulas_answer(bps: float, tau: int) -> None:
    """Codec (least compression), then H (smallest), then fragment count (fewest) that reach the
    target, by the streaming formula; else the most utilisation (most compression, H_max)."""
    params, step_s, sites, rtt, lo, hi, target, counts = 1e6, 0.01, 2, 0.01, 21, 200, 0.6, [1, 2, 4, 8]

    def u(c: str, h: int, f: int) -> float:
        return utilization("streaming", bps, params, step_s, sites, rtt, h, f, tau, {"streaming": BITS[c]})

    want = None
    for c in sorted(BITS, key=lambda c: -BITS[c]):
        ok = [(h, f) for h in range(lo, hi + 1) for f in counts if u(c, h, f) >= target]
        if ok:
            want = (c, *min(ok))
            break
    if want is None:
        want = max(
            ((c, h, f) for c in BITS for h in range(lo, hi + 1) for f in counts), key=lambda k: (u(*k), -BITS[k[0]], k[1], -k[2])
        )
    got = choose_round(bps, params, step_s, sites, rtt, lo, hi, BITS, target, counts, tau)
    assert (got["codec"], got["H"], got["fragments"]) == want
    assert got["predicted_utilization"] == u(*want) and got["meets_target"] == (u(*want) >= target)


def test_a_hold_keeps_settings_predicted_just_above_the_target() -> None:
    """With hold > 0 the current settings are kept while the formula predicts them in target ..
    target + hold on the measured link; below the target or above the band, the choice is afresh."""
    bps, params, step_s, sites, rtt, lo, hi, target, counts, tau = 3e7, 1e6, 0.01, 2, 0.01, 21, 200, 0.6, [1, 2, 4, 8], 5
    fresh = choose_round(bps, params, step_s, sites, rtt, lo, hi, BITS, target, counts, tau)
    assert fresh["meets_target"] and "held" not in fresh

    def u(H: int) -> float:
        return utilization("streaming", bps, params, step_s, sites, rtt, H, 4, tau, {"streaming": BITS["none"]})

    above = next(h for h in range(lo, hi + 1) if target + 0.01 <= u(h) <= target + 0.04)  # in the band
    got = choose_round(bps, params, step_s, sites, rtt, lo, hi, BITS, target, counts, tau, ("none", above, 4), 0.05)
    assert got == {
        "codec": "none",
        "H": above,
        "fragments": 4,
        "predicted_utilization": u(above),
        "meets_target": True,
        "held": True,
    }
    assert got != {**fresh, "held": True}  # the fresh choice differs: holding changed something
    far = next(h for h in range(above, hi + 1) if u(h) > target + 0.05)  # above the band, or below the target
    for H in (far, lo):
        assert choose_round(bps, params, step_s, sites, rtt, lo, hi, BITS, target, counts, tau, ("none", H, 4), 0.05) == fresh
    assert choose_round(bps, params, step_s, sites, rtt, lo, hi, BITS, target, counts, tau, ("none", above, 4), 0.0) == fresh


def test_streaming_formula_cannot_hide_more_than_a_cycle() -> None:
    """F exchanges share one link: however many fragments and however long tau, a cycle of H steps
    cannot carry more than H steps of compute's worth of transfer without waiting."""
    params, step_s, H, rtt, bps = 1e6, 0.01, 20, 0.0, 1e6
    vol, _ = _volume_latency(params, 32, 2, rtt)
    for F in (1, 4, 16, 64):
        u = utilization("streaming", bps, params, step_s, 2, rtt, H, F, 19, {"streaming": 32})
        assert u <= H * step_s / (vol / bps) + 1e-12
        assert math.isclose(u, H * step_s / (vol / bps), rel_tol=1e-9) or F == 1


@pytest.mark.parametrize(("H", "F", "tau"), [(20, 4, 2), (20, 4, 10), (100, 16, 10), (50, 1, 0)])
@pytest.mark.parametrize("exposed", [0.05, 0.5, 3.0])
def test_streaming_effective_bandwidth_inverts_the_formula_on_a_measured_wait(H: int, F: int, tau: int, exposed: float) -> None:
    params, bits, step_s, sites, rtt = 2e6, 32.0, 0.05, 4, 0.02
    bps = streaming_effective_bps(exposed, params, bits, step_s, sites, rtt, H, F, tau)
    u = utilization("streaming", bps, params, step_s, sites, rtt, H, F, tau, {"streaming": bits})
    _, lat = _volume_latency(params, bits, sites, rtt, F)
    if min(exposed / F + tau * step_s, (exposed + H * step_s) / F) > 20 / 19 * lat:
        assert math.isclose(u, H * step_s / (H * step_s + exposed), rel_tol=1e-9)
    else:  # less exposure than the latency term alone gives: no bandwidth explains it; a large, finite one
        assert math.isfinite(bps) and u < H * step_s / (H * step_s + exposed)
    assert streaming_effective_bps(0.0, params, bits, step_s, sites, rtt, H, F, tau) == math.inf


def test_achieved_bandwidth_inverts_the_formulas_transfer_time() -> None:
    params, sites, rtt, bps = 2e6, 4, 0.05, 3e7
    vol, lat = _volume_latency(params, 32, sites, rtt)
    assert math.isclose(achieved_bps(vol / 8, vol / bps + lat, sites, rtt), bps, rel_tol=1e-12)
    # a measured time shorter than the model's latency still gives a finite, large bandwidth
    assert math.isfinite(achieved_bps(1e6, lat / 2, sites, rtt))


def test_scheduled_link_changes_follow_regions_pairs_and_time() -> None:
    regions = [{"name": "eu", "sites": ["A", "B"]}, {"name": "us", "sites": ["C"]}]
    changes = [
        {"after_s": 10, "bandwidth_scale": 0.1},
        {"after_s": 20, "bandwidth_scale": 0.5, "latency_scale": 2, "sites": ["A", "B"]},
    ]
    cfg = TopologyConfig.model_validate(
        {"sites": [{"name": n, "workers": 1} for n in "ABC"], "regions": regions, "links": {"changes": changes}}
    )
    t = Topology.from_config(cfg)
    bw = t.inter_link.bandwidth_bps
    assert t.link_at(0, 2, 9.9).bandwidth_bps == bw and t.link_at(0, 2, 10).bandwidth_bps == 0.1 * bw  # between regions
    assert t.link_at(0, 1, 15).bandwidth_bps == bw  # inside a region: unnamed changes do not touch it
    late = t.link_at(1, 0, 25)  # a named pair, either direction
    assert late.bandwidth_bps == 0.5 * bw and late.latency_s == 2 * t.inter_link.latency_s
    flat = Topology.from_config(
        TopologyConfig.model_validate({"sites": cfg.model_dump()["sites"], "links": {"changes": changes[:1]}})
    )
    assert flat.link_at(0, 1, 11).bandwidth_bps == 0.1 * bw  # without regions every inter-site link


def test_the_clock_of_link_changes_is_shared_by_every_rank_of_a_run(tmp_path: Path) -> None:
    a = SharedLinks(tmp_path / "links", 2)
    b = SharedLinks(tmp_path / "links", 2)  # a second process maps the same file later
    assert a.t0 > 0 and b.t0 == a.t0
    a.close()
    b.close(unlink=True)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_link_state_left_by_a_killed_launcher_does_not_reach_the_next_run(tmp_path: Path, monkeypatch) -> None:
    """A launcher that was SIGKILLed leaves its link-state file (clock and busy links). If the
    kernel gives the next launcher the same port, that run must start its own clock: here the
    stale clock is 10,000 s old, so a change scheduled at 1 h (links 1,000x slower) would fire at
    once and every ring step would wait 1 s."""
    import struct
    import time

    import geotrain.launch.local as local
    from geotrain.comm.emulate.inprocess import state_path

    real = local.host_store

    def host_store_with_stale_state(*args, **kwargs):  # type: ignore[no-untyped-def]
        store, agent = real(*args, **kwargs)
        stale = SharedLinks(state_path(str(store.port)), 2)
        struct.pack_into("d", stale._mm, stale._t0_off, time.monotonic() - 10_000)
        stale.close()
        return store, agent

    monkeypatch.setattr(local, "host_store", host_store_with_stale_state)
    cfg = load_config(
        None,
        TINY
        + [
            "run.baseline=none",
            "train.steps=10",
            "sync.H=5",
            "topology.links.emulate=inprocess",
            "topology.links.inter.latency_s=0.001",
            "topology.links.changes=[{after_s: 3600, bandwidth_scale: 0.001, latency_scale: 1000}]",
        ],
    )
    s = launch_local(cfg, tmp_path / "run", console_print=None)
    # the stale clock would make every ring step wait 1 s (2 rounds x 2 steps: at least 4 s); the
    # run's own waits a few ms per round, and on a loaded machine its peer's slower steps a little more
    assert s["rounds"] == 2 and s["wan_wait_seconds"] < 3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["sync.adapt={}", "sync.algorithm=ddp"], "sync.algorithm: DDP exchanges every step and has no H to choose"),
        (["sync.adapt={fragments: [2]}"], "sync.adapt.fragments: Streaming DiLoCo only"),
        (["sync.adapt={hold: 0.05}"], "sync.adapt.hold: Streaming DiLoCo only"),
        (["sync.adapt={hold: 1.5}", "sync.algorithm=streaming"], "sync.adapt.hold"),
        (["sync.adapt={}", "sync.algorithm=streaming", "sync.eager=true"], "sync.eager: the eager step owes each fragment"),
        (["sync.adapt={fragments: [1, 2]}", "sync.algorithm=streaming"], "sync.fragments: the first fragment count"),
        (["sync.adapt={fragments: [4, 4]}", "sync.algorithm=streaming"], "sync.adapt.fragments: each count once"),
        (["sync.adapt={fragments: [0, 4]}", "sync.algorithm=streaming"], "sync.adapt.fragments: each count in 1..4096"),
        (["sync.adapt={H_min: 5}", "sync.algorithm=streaming", "sync.tau=5"], "sync.adapt.H_min: must exceed tau=5"),
        (["sync.adapt={H_min: 100}"], "sync.H: the first round's H must lie in"),
        (["sync.adapt={codecs: [int8]}"], "sync.codec: adaptation chooses among fixed-width codecs by their bits per value"),
        (["sync.adapt={H_min: 300, H_max: 200}", "sync.H=250"], "sync.adapt.H_min: must be at most H_max=200"),
        (["sync.adapt={codecs: [none, none]}"], "sync.adapt.codecs: each codec once"),
        (["sync.adapt={codecs: [none, topk]}"], "sync.adapt.codecs[1]: Input should be"),
        (["topology.links.emulate=off", "topology.links.changes=[{after_s: 5, bandwidth_scale: 0.1}]"], "in-process only"),
        (["topology.links.changes=[{after_s: 5, bandwidth_scale: 0.1, sites: [A, Z]}]"], "unknown site 'Z'"),
        (["topology.links.changes=[{after_s: 5, bandwidth_scale: 0}]"], "bandwidth_scale"),
    ],
)
def test_bad_adaptation_configs_are_refused_in_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["sync.adapt={}", "train.max_seconds=5"],
        ["sync.adapt={}", "sync.algorithm=streaming", "checkpoint.every=5"],
    ],
)
def test_adaptation_loads_with_a_time_limit_and_checkpoints(overrides: list[str]) -> None:
    """Once refused as 'not combined yet': the round engine ends an adapted run on time and keeps
    the adapter's state in its checkpoints (tests/test_combinations.py runs them)."""
    cfg = load_config(None, overrides)
    assert cfg.sync.adapt is not None


CODECS = {c: float(CODEC_BITS[c]) for c in ("none", "bf16", "int8", "fp4")}  # sync.adapt.codecs' default


def _slowdown_run(tmp_path: Path, after_s: float, steps: int, overrides: list[str]) -> tuple[Config, dict, list[dict]]:
    """Two one-worker sites whose link becomes 10x slower ``after_s`` seconds in: the config, the
    run's summary and its adaptation log (the run committed every round and ended on one model)."""
    cfg = load_config(
        None,
        [
            *TINY,
            "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}]",
            *overrides,
            f"topology.links.changes=[{{after_s: {after_s}, bandwidth_scale: 0.1}}]",
            f"train.steps={steps}",
            "train.eval_every=1000000",
            "run.baseline=none",
            "train.save_final=false",
        ],
    )
    s = launch_local(cfg, tmp_path / "run", console_print=None)
    assert s["rounds_rolled_back"] == 0 and len(set(s["global_param_hash"].values())) == 1
    return cfg, s, s["adapt"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_adaptation_with_adaptive_pace_takes_the_fastest_sites_step_time(tmp_path: Path) -> None:
    """sync.adapt with sync.pace=adaptive: B runs at 0.4 speed, so each round budgets H steps of
    A and B runs fewer; the adapter takes each site's own steps, the fastest site's step time as
    the formula's T (a round lasts H of its steps), and chooses H from the measured 10 Mbit/s link
    (the planner's answer for it). The run ends once A has run train.steps, on one model."""
    lo, hi, target = 4, 200, 0.9
    overrides = [
        "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1, compute_speed: 0.4}]",
        "topology.links.emulate=inprocess",
        "topology.links.inter.bandwidth_bps=1e7",
        "train.steps=60",
        "train.eval_every=0",
        "sync.H=6",
        "sync.pace=adaptive",
        f"sync.adapt={{target: {target}, H_min: {lo}, H_max: {hi}}}",
        "run.baseline=none",
    ]
    s = launch_local(load_config(None, TINY + overrides), tmp_path / "run", console_print=None)
    log = s["adapt"]
    assert log and all(isinstance(a["steps"], int) for a in log)
    for a, p in zip(log, s["pace"], strict=False):  # (the calibration round's measurement included)
        per = p["steps"]
        step_s = [round(x, 9) for x in a["step_s"]]
        assert len(per) == 2 and a["steps"] == max(per)
        T = min(a["step_s"])  # the fastest site's
        assert a["next"] == choose_round(a["link_bps"], s["params"], T, 2, a["rtt_s"], lo, hi, CODECS, target), step_s
    assert any(p["steps"][1] < p["steps"][0] for p in s["pace"][1:])  # B ran fewer steps than A
    assert log[0]["changed"] and log[0]["next"]["H"] != 6
    a_steps, b_steps = (p["steps"] for p in s["per_site"])
    assert a_steps >= 60 and b_steps < a_steps
    assert len(set(s["global_param_hash"].values())) == 1 and s["hashes_agree_within_sites"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_measures_the_link_and_follows_a_10x_slowdown_with_the_planners_choice(tmp_path: Path) -> None:
    """Two sites on an emulated 1 Mbit/s, 20 ms link that becomes 10x slower 6 s in: every round's
    choice is the planner formula's answer for the link measured in that round, the measurement is
    the configured link, and the slowdown is followed within 2 rounds."""
    after_s, lo, hi, target = 6.0, 2, 400, 0.5
    cfg, s, log = _slowdown_run(  # 2,000 steps: here about 5 rounds before the slowdown and 5 after
        tmp_path,
        after_s,
        2000,
        [
            "topology.links.inter.bandwidth_bps=1e6",
            "topology.links.inter.latency_s=0.02",
            "sync.H=5",
            f"sync.adapt={{target: {target}, H_min: {lo}, H_max: {hi}}}",
        ],
    )
    assert [a["round"] for a in log] == list(range(1, s["rounds"] + 1))
    for prev, a in zip([None, *log], log, strict=False):
        # the agreed link from every site's measurements, and the planner's choice for it
        assert a["rtt_s"] == min(a["ping_s"])
        assert a["link_bps"] == achieved_bps(max(a["bytes"]), min(a["allreduce_s"]), 2, a["rtt_s"])
        assert a["next"] == choose_round(a["link_bps"], s["params"], max(a["step_s"]), 2, a["rtt_s"], lo, hi, CODECS, target)
        assert a["H"] == (5 if prev is None else prev["next"]["H"]) and a["codec"] == (
            "none" if prev is None else prev["next"]["codec"]
        )
        assert lo <= a["next"]["H"] <= hi
    # the measurement is the emulated link: 20 ms each way, 1 Mbit/s (the transfer of the fp32 ring).
    # Bounds a loaded machine cannot break: a round trip is at least the two latencies, and the
    # link delivers at most its bandwidth (20% for the measurement's latency estimate); how close
    # the measurement comes is the benchmark's (bench tiers --adapt-only)
    before = [a for a in log if a["t_s"] < after_s]
    assert before and all(a["rtt_s"] >= 0.03 for a in log), [a["rtt_s"] for a in log]
    assert all(a["link_bps"] <= 1.2e6 for a in before if a["codec"] == "none"), [a["link_bps"] for a in before]
    # the first round whose whole average ran after the slowdown sees it; H or the codec changes at
    # the first boundary after the slowdown, at that round's or at the next one (within 2 rounds)
    slow = next(i for i, a in enumerate(log) if a["t_s"] - max(a["allreduce_s"]) - max(a["ping_s"]) >= after_s)
    first = next(i for i, a in enumerate(log) if a["t_s"] >= after_s)
    assert log[slow]["link_bps"] < 0.2e6, log[slow]
    assert any(a["changed"] for a in log[first : slow + 2]), log[first : slow + 2]
    assert log[-1]["codec"] != "none" or log[-1]["H"] > before[-1]["H"]
    # the benchmark's record and plot of this run (geotrain bench tiers)
    rec = adapt_record(s, cfg, after_s)
    assert len(rec["timeline"]) == len(log) and rec["rounds_to_follow"] in (1, 2) and rec["follow_met"]
    _check_adapt_plot(rec, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_streaming_adapts_h_codec_and_fragment_count_to_the_measured_link(tmp_path: Path) -> None:
    """Streaming DiLoCo on an emulated 2 Mbit/s, 5 ms link that becomes 10x slower 3 s in: after
    every cycle of H steps the choice of H, codec and fragment count is the planner formula's
    answer for the link measured in the exchange thread, the run follows it (fragments rebuilt,
    momentum carried), the slowdown is followed within 2 cycles, and the sites end on one model."""
    after_s, lo, hi, target, tau, counts = 3.0, 11, 100, 0.5, 10, [1, 2, 4, 8]
    cfg, s, log = _slowdown_run(
        tmp_path,
        after_s,
        450,
        [
            "model.n_layer=4",
            "topology.links.inter.bandwidth_bps=2e6",
            "topology.links.inter.latency_s=0.005",
            "sync.algorithm=streaming",
            "sync.H=30",
            f"sync.tau={tau}",
            "sync.fragments=4",
            f"sync.adapt={{target: {target}, H_min: {lo}, H_max: {hi}, fragments: {counts}}}",
        ],
    )
    assert [a["round"] for a in log] == list(range(1, len(log) + 1)) and len(log) >= 3
    for i, (prev, a) in enumerate(zip([None, *log], log, strict=False)):
        assert a["fragment_choices"] == counts and a["tau"] == tau and a["exchanges"] >= 1
        # the rtt: the shortest ping of the last ping_window cycles (pinged from the exchange thread)
        assert a["rtt_s"] == min(min(b["ping_s"]) for b in log[max(0, i + 1 - a["ping_window"]) : i + 1])
        assert 1 <= a["link_exchanges"] <= a["exchanges"]
        assert a["link_bps"] == achieved_bps(a["link_bytes"], a["link_seconds"], 2, a["rtt_s"], a["link_exchanges"])
        # the formula inverted on the slowest site's wait per H steps too; the slower of the two links
        T = max(a["step_s"])
        assert a["exposed_s"] == a["waited_s"][a["step_s"].index(T)] / a["steps"] * a["H"]
        bits, args = CODECS[a["codec"]], (T, 2, a["rtt_s"], a["H"], a["fragments"], tau)
        assert a["effective_bps"] == min(a["link_bps"], streaming_effective_bps(a["exposed_s"], s["params"], bits, *args))
        now = (a["codec"], a["H"], a["fragments"])  # held while predicted in target .. target + hold
        assert a["hold"] == STREAMING_HOLD
        want = choose_round(
            a["effective_bps"], s["params"], T, 2, a["rtt_s"], lo, hi, CODECS, target, counts, tau, now, a["hold"]
        )
        assert a["next"] == want
        start = {"H": 30, "codec": "none", "fragments": 4}
        assert {k: a[k] for k in start} == (start if prev is None else {k: prev["next"][k] for k in start})
    # the fragment count was rebuilt at least once (per fragment, tau steps of compute hide more
    # than the 10 ms round trip here, so more fragments pay)
    assert len({a["fragments"] for a in log}) > 1, [a["fragments"] for a in log]
    before = [a for a in log if a["t_s"] < after_s]
    assert before and all(a["link_bps"] <= 2.4e6 for a in before), [a["link_bps"] for a in before]  # at most the link (above)
    first = next(i for i, a in enumerate(log) if a["t_s"] >= after_s)
    slow = next(i for i, a in enumerate(log) if a["t_s"] - max(a["allreduce_s"]) >= after_s)  # all its exchanges after
    assert log[slow]["link_bps"] < 0.4e6, log[slow]
    assert any(a["changed"] for a in log[first : slow + 2]), log[first : slow + 2]
    # the benchmark's record and plot of such a run, and its per-round formula check
    rec = adapt_record(s, cfg, after_s)
    assert rec["algorithm"] == "streaming" and [a["fragments"] for a in rec["timeline"]] == [a["fragments"] for a in log]
    _check_adapt_plot(rec, tmp_path)
    held = held_record(s)
    assert [r["predicted_utilization"] for r in held["rounds"]] == [a["next"]["predicted_utilization"] for a in log]


def _check_adapt_plot(rec: dict, tmp_path: Path) -> None:
    """The plot of an adaptation run draws the timeline's choices and utilisations against time."""
    with drawn() as figs:
        plot_adapt(rec, tmp_path / "adapt.png")
    tl = rec["timeline"]
    t = [a["t_s"] for a in tl]
    h, codec, util = (lines(ax) for ax in figs[0].axes[:3])
    assert h["H chosen for the next round"] == (t, [a["next_H"] for a in tl])
    assert codec["codec chosen"] == (t, [CODEC_BITS[a["next_codec"]] for a in tl])
    assert util["predicted for the next round"] == (t, [100 * a["predicted_utilization"] for a in tl])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_checkpoint_keeps_the_adapted_h_and_codec(tmp_path: Path) -> None:
    """sync.adapt with checkpoints: the first round's measurement moves H on a 10 Mbit/s link; a
    run resumed from a checkpoint taken inside the second round starts with the H and codec in
    force then (the next choice is measured again), and every site ends on one model."""
    common = [*TINY, "run.baseline=none", "sync.H=10", "sync.adapt={target: 0.9}", "topology.links.inter.bandwidth_bps=1e7"]
    full = launch_local(
        load_config(None, [*common, "train.steps=30", "checkpoint.every=10"]), tmp_path / "full", console_print=None
    )
    first = full["adapt"][0]
    assert first["changed"] and first["next"]["H"] > 10
    ck = tmp_path / "full" / "checkpoints" / "step-00000020"  # inside the second round
    resumed = launch_local(
        load_config(None, [*common, "train.steps=30", f"checkpoint.resume={ck}"]), tmp_path / "resumed", console_print=None
    )
    assert resumed["adapt"][0]["H"] == first["next"]["H"] and resumed["adapt"][0]["codec"] == first["next"]["codec"]
    assert len(set(resumed["global_param_hash"].values())) == 1
