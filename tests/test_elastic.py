"""Elastic mode: whole sites killed (SIGKILL) or hung (SIGSTOP) by real signals, mid-all-reduce;
rollback, heartbeat detection, live healing, a Lighthouse that dies and comes back, and a
process with the wrong secret. Every run is real processes on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from geotrain.comm.procs import free_port
from geotrain.config import ElasticConfig
from geotrain.elastic.lighthouse import LighthouseProcess
from geotrain.launch.spawn import worker_args
from geotrain.launch.zygote import WORKER
from tests.helpers import TINY, read_summary, train_args, train_cli

pytestmark = pytest.mark.timeout(240)

THREE = "topology:\n  sites: [{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}]\n"
TWO = "topology:\n  sites: [{name: A, workers: 1}, {name: B, workers: 1}]\n"
ELASTIC = ["elastic.enabled=true", "sync.H=10", "train.eval_every=0"]
BACKSTOP = 120.0  # liveness.collective_timeout_s default: what would end a wait nobody detected


def records(out: Path, site: str) -> list[dict[str, Any]]:
    path = out / "elastic" / f"rounds-{site}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def told(out: Path) -> str:
    """Every site's rounds in brief, for an assertion's message (what a failure in CI leaves to read)."""
    lines = []
    for path in sorted((out / "elastic").glob("rounds-*.jsonl")):
        for r in records(out, path.stem.removeprefix("rounds-")):
            lines.append(f"{r['site']} step {r['step']} {r['outcome']} {r['committed']} {r['hash'][:8]} {r['reason'][:80]}")
    return "\n".join(lines)


@pytest.mark.slow
def test_kill_mid_allreduce_rolls_back_and_survivors_agree(tmp_path: Path) -> None:
    out = tmp_path / "kill"
    proc = train_cli(out, [*ELASTIC, "train.steps=80", 'fault.kill=["B@30"]', 'fault.nan=["C@5"]'], THREE)
    s = read_summary(out)
    assert s["survivors"] == ["A", "C"]
    assert s["per_site"]["A"]["steps"] == s["per_site"]["C"]["steps"] == 80
    # the round B died in was rolled back everywhere; every other round committed
    a = records(out, "A")
    assert [r["outcome"] for r in a].count("rolled_back") == 1 == s["rounds_rolled_back"]
    failed = next(r for r in a if r["outcome"] == "rolled_back")
    assert failed["step"] == 30 and "B" in failed["admitted"]
    assert all(r["admitted"] == ["A", "C"] for r in a if r["start"] > failed["end"])
    assert s["rounds"] == 8 and s["rounds_committed"] == 7
    # bit-identical survivors; every committed round count maps to one model
    assert s["global_param_hash"]["A"] == s["global_param_hash"]["C"] and s["consistent"]
    (kill,) = s["failures"]
    # detected by the survivors (a closed connection, heartbeats), not by the 120 s backstop of a
    # collective: how fast (2 x the heartbeat timeout or better) is chaos's target (chaos.json)
    assert kill["site"] == "B" and kill["kind"] == "kill" and kill["detection_seconds"] < BACKSTOP / 4
    assert s["seconds_lost"] < BACKSTOP / 2, s["seconds_lost"]
    # C's NaN update (round 5, after B died) was withdrawn: A alone contributed; the model is finite
    # the update guard is on in elastic mode: C's own guard withdrew it
    assert "withdrawn from this round (update guard)" in proc.stdout
    assert s["guard_rejections"] == {"C": 1} and s["guard_events"][0]["site"] == "C"
    assert "non-finite" in s["guard_events"][0]["why"]
    assert any(r["contributors"] == 1 for r in a if r["outcome"] == "committed")
    assert math.isfinite(s["final_eval_loss"])
    assert not (out / "summary.json").read_text().count("NaN")


@pytest.mark.slow
@pytest.mark.parametrize(
    "algorithm", [[], ["sync.algorithm=streaming", "sync.fragments=2", "sync.tau=2"]], ids=["diloco", "streaming"]
)
def test_a_round_split_at_the_end_is_healed_before_the_sites_leave(tmp_path: Path, algorithm: list[str]) -> None:
    """B misses A's vote (fault.split: as if it took A for dead) in a round A commits: a split.
    Each site writes what it decided and waits for the other's, so both know. Mid-run the next
    round heals B; after the last round both stay for one more, in which B heals, and the two end
    on one model. Before, a site that had decided left at once, and a split last round (seen under
    load in CI: B's heartbeat watch timed out while A's process had stopped beating) ended the run
    with two models."""
    out = tmp_path / "split"
    proc = train_cli(out, [*ELASTIC, *algorithm, "train.steps=40", 'fault.split=["B@20", "B@40"]'], TWO)
    s = read_summary(out)
    assert proc.stdout.count("fault.split: this site missed the others' votes") == 2
    a, b = records(out, "A"), records(out, "B")
    assert len(a) == len(b) and [r["step"] for r in a] == [r["step"] for r in b]
    split = [i for i, r in enumerate(b) if r["outcome"] == "rolled_back" and r["step"] in (20, 40) and not r["healers"]]
    assert [b[i]["step"] for i in split] == [20, 40] and all(a[i]["outcome"] == "committed" for i in split)
    assert b[split[0] + 1]["healers"] == ["B"] and b[split[0] + 1]["contributors"] == 1  # mid-run: the next round heals B
    # after the last round, one more (at the last step), in which B heals
    assert split[1] == len(b) - 2 and a[-1]["healers"] == b[-1]["healers"] == ["B"] and a[-1]["outcome"] == b[-1]["outcome"]
    assert all(r["outcome"] == "committed" for i, r in enumerate(b[:-1]) if i not in split)
    assert s["survivors"] == ["A", "B"] and s["consistent"] and len(set(s["global_param_hash"].values())) == 1
    assert s["per_site"]["A"]["final_eval_loss"] == s["per_site"]["B"]["final_eval_loss"]


@pytest.mark.slow
def test_hang_is_detected_then_the_site_heals_and_all_agree(tmp_path: Path) -> None:
    """SIGSTOP B mid-all-reduce with min_sites=3: A and C detect it by heartbeat, roll back, pause
    (too few sites), and carry on when B's new incarnation has healed from a peer."""
    out = tmp_path / "hang"
    overrides = [*ELASTIC, "train.steps=150", 'fault.hang=["B@30"]', "fault.restart_after=4", "elastic.min_sites=3"]
    proc = train_cli(out, [*overrides, "liveness.quorum_timeout_s=1"], THREE)
    s = read_summary(out)
    assert s["survivors"] == ["A", "B", "C"]
    (hang,) = s["failures"]
    assert hang["kind"] == "hang" and hang["detection_seconds"] < BACKSTOP / 4, hang  # by heartbeat (above)
    assert "no heartbeat from B" in proc.stdout
    assert "training paused: fewer than elastic.min_sites=3" in proc.stdout
    # B restarted, healed in one round (zero contribution), contributed from the next
    assert s["per_site"]["B"]["started_at_step"] > 30
    b = records(out, "B")
    heal = next(i for i, r in enumerate(b) if "B" in r["healers"])
    assert b[heal]["outcome"] == "committed" and b[heal]["contributors"] == 2
    assert b[heal + 1]["contributors"] == 3
    assert len(set(s["global_param_hash"].values())) == 1 and s["consistent"]
    assert s["per_site"]["B"]["final_eval_loss"] == s["per_site"]["A"]["final_eval_loss"]


@pytest.mark.slow
def test_sites_of_two_workers_heal_every_rank(tmp_path: Path) -> None:
    """G=2: each local rank carries its shard across sites and heals from the same local rank."""
    out = tmp_path / "g2"
    topology = "topology:\n  sites: [{name: A, workers: 2}, {name: B, workers: 2}]\n"
    train_cli(out, [*ELASTIC, "train.steps=700", 'fault.kill=["B@30"]', "fault.restart_after=0.5"], topology)
    s = read_summary(out)
    assert s["survivors"] == ["A", "B"] and s["consistent"] and s["hashes_agree_within_sites"]
    assert s["rounds_rolled_back"] >= 1 and s["per_site"]["B"]["started_at_step"] > 30
    ranks = s["runs"][0]["per_rank"]
    hashes: dict[str, set[str]] = {r["site"]: set() for r in ranks}
    for r in ranks:
        hashes[r["site"]].add(r["global_param_hash"])
    assert hashes["A"] == hashes["B"] and len(hashes["A"]) == 1  # all four ranks hold one model


@pytest.mark.slow
def test_a_migrated_site_drains_at_a_round_boundary_heals_and_all_end_on_one_model(tmp_path: Path) -> None:
    """fault.migrate: C stops right after a committed round (nothing in flight, nothing rolled
    back), a new incarnation with C's data slice starts at once and heals from a live site."""
    out = tmp_path / "migrate"
    proc = train_cli(out, [*ELASTIC, "train.steps=80", 'fault.migrate=["C@35"]'], THREE, timeout=200)
    s = read_summary(out)
    assert "drained after committed round" in proc.stdout, proc.stdout[-3000:]
    assert s["survivors"] == ["A", "B", "C"] and s["consistent"], told(out)
    assert len(set(s["global_param_hash"].values())) == 1
    assert s["rounds_rolled_back"] == 0, told(out)  # drained between rounds: no round lost
    assert all(p["steps"] == 80 for p in s["per_site"].values())
    (m,) = s["failures"]
    assert m["kind"] == "migrate" and m["site"] == "C" and m["healed_after_seconds"] is not None
    c = records(out, "C")
    drained = next(i for i, r in enumerate(c) if r["step"] >= 35 and r["outcome"] == "committed")
    assert "C" in c[drained + 1]["healers"], told(out)  # the next record of C is its new incarnation's heal
    assert (out / "logs" / "rank2.1.log").exists()


@pytest.mark.slow
def test_a_site_that_healed_in_a_failed_round_heals_the_others(tmp_path: Path) -> None:
    """The chaos-soak deadlock: B restarts and heals in a round that C's death rolls back; then A,
    the last site never restarted, dies too. B (and C, healed in the next failed round) hold a
    valid state although no round with them committed: they must heal A, and all finish alike.
    Before the fix every remaining site counted as 'joining', nobody could be a heal source, and
    all gave up after liveness.start_timeout_s."""
    out = tmp_path / "deadlock"
    faults = ['fault.kill=["B@30", "C@40", "A@50"]', "fault.restart_after=0.5", "elastic.min_sites=3"]
    proc = train_cli(out, [*ELASTIC, "train.steps=80", *faults, "liveness.start_timeout_s=40"], THREE, timeout=200)
    s = read_summary(out)
    assert "no live site to heal from" not in proc.stdout + proc.stderr
    assert s["survivors"] == ["A", "B", "C"] and s["consistent"], (s.get("failures"), told(out))
    assert sorted(f["site"] for f in s["failures"]) == ["A", "B", "C"]
    assert len(set(s["global_param_hash"].values())) == 1
    assert all(p["steps"] == 80 for p in s["per_site"].values())
    b = records(out, "B")
    healed_then_failed = [r for r in b if "B" in r["healers"] and r["outcome"] == "rolled_back"]
    assert healed_then_failed, "B's healing round should have been rolled back (C killed in it)"
    # after A died, A healed from a site that had only ever healed in rolled-back rounds (B or C)
    a = records(out, "A")
    assert any("A" in r["healers"] and r["outcome"] == "committed" for r in a)


@contextlib.contextmanager
def _run_with_own_lighthouse(
    tmp_path: Path, out: Path, topology: str, overrides: list[str], env: dict[str, str] | None = None, rounds: int = 1
) -> Iterator[tuple[LighthouseProcess, str, subprocess.Popen[str]]]:
    """A Lighthouse started by the test and ``geotrain train`` pointed at it, in the background;
    yields once site A has recorded ``rounds`` rounds. Both are stopped on the way out."""
    lh = LighthouseProcess(0, ElasticConfig(), tmp_path / "lighthouse.log")
    lh.start()
    args = train_args(out, [*ELASTIC, *overrides, f"elastic.lighthouse={lh.address}"], topology)
    run = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not ((out / "elastic" / "rounds-A.jsonl").exists() and len(records(out, "A")) >= rounds):
            assert time.monotonic() < deadline, "no round recorded"
            time.sleep(0.05)
        yield lh, lh.address, run
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        lh.stop()


@pytest.mark.slow
def test_sites_train_through_a_lighthouse_outage(tmp_path: Path) -> None:
    """The coordinator dies mid-run: sites keep doing inner steps, postpone the round, and carry
    on when it is restarted on the same address; all end identical."""
    out = tmp_path / "outage"
    with _run_with_own_lighthouse(tmp_path, out, THREE, ["train.steps=600"], rounds=2) as (lh, _, run):
        lh.kill()
        time.sleep(2.5)
        lh.start()
        stdout, _ = run.communicate(timeout=200)
    assert run.returncode == 0, stdout[-3000:]
    assert "unreachable: inner steps go on" in stdout and "reachable again" in stdout
    s = read_summary(out)
    assert s["survivors"] == ["A", "B", "C"] and s["consistent"] and s["rounds_rolled_back"] == 0
    steps = [r["step"] for r in records(out, "A")]
    assert max(b - a for a, b in zip(steps, steps[1:], strict=False)) > 10  # a round postponed past H steps
    assert steps[-1] == 600


@pytest.mark.slow
@pytest.mark.timing  # (relative speeds: under load both sites had reached the last step by the outage)
def test_after_an_outage_sites_of_different_speeds_meet_on_the_same_steps_again(tmp_path: Path) -> None:
    """B runs at a third of A's speed; the Lighthouse dies for a second, so each site postpones
    the round and meets the other at a step of its own when it is back. The round after that ends
    at the same multiple of H on both (the first past the furthest step either had reached), so
    both run the same rounds to the end and end on one model; before, each kept its own offset
    and a finished site could leave the other's last round to commit alone."""
    two = "topology:\n  sites: [{name: A, workers: 1}, {name: B, workers: 1, compute_speed: 0.33}]\n"
    out = tmp_path / "outage"
    with _run_with_own_lighthouse(tmp_path, out, two, ["train.steps=1200", "sync.H=50"], rounds=2) as (lh, _, run):
        lh.kill()
        time.sleep(1.0)
        lh.start()
        stdout, _ = run.communicate(timeout=200)
    assert run.returncode == 0, stdout[-3000:]
    a, b = records(out, "A"), records(out, "B")
    postponed = next(i for i, (x, y) in enumerate(zip(a, a[1:], strict=False)) if y["step"] - x["step"] > 50) + 1
    assert a[postponed]["step"] != b[postponed]["step"]  # they met at steps of their own
    # from the next round on, B's rounds end on multiples of H; A is in every one of them, the
    # rounds after its own last step without an update (A may have run all its steps in the outage)
    after_b = [r["step"] for r in b[postponed + 1 :]]
    assert all(x % 50 == 0 for x in after_b) and after_b[-1] == 1200
    assert len(a) == len(b) and all(r["admitted"] == ["A", "B"] for r in b[postponed:])
    s = read_summary(out)
    assert s["consistent"] and len(set(s["global_param_hash"].values())) == 1


@pytest.mark.slow
def test_a_process_with_the_wrong_secret_is_refused(tmp_path: Path) -> None:
    from geotrain.comm.topology import Topology
    from geotrain.config import TopologyConfig
    from geotrain.launch.sites import site_env

    out = tmp_path / "auth"
    env = {**os.environ, "GEOTRAIN_SECRET": "the-right-shared-secret-0123456789"}
    with _run_with_own_lighthouse(tmp_path, out, TWO, ["train.steps=1000"], env) as (_, addr, run):
        # an impostor: site C of a three-site config, joining (incarnation 1) with another secret
        cfg = tmp_path / "impostor.yaml"
        cfg.write_text(THREE)
        topo = Topology.from_config(TopologyConfig.model_validate(yaml.safe_load(THREE)["topology"]))
        rogue_env = site_env(topo, "off", 2, 1, 0, free_port(), addr, "unused")
        rogue_env["GEOTRAIN_SECRET"] = "a-wrong-secret-of-enough-length"
        sets = [x for o in [*TINY, *ELASTIC, "train.steps=500"] for x in ("--set", o)]
        cmd = [sys.executable, "-m", WORKER, *worker_args(cfg, tmp_path / "rogue"), *sets]
        rogue = subprocess.run(cmd, capture_output=True, text=True, env=rogue_env, timeout=120)
        stdout, _ = run.communicate(timeout=200)
    assert rogue.returncode == 3, rogue.stdout[-2000:] + rogue.stderr[-2000:]
    assert "membership refused" in rogue.stderr and "secret" in rogue.stderr
    assert run.returncode == 0, stdout[-3000:]
    assert "quorum participant 'C' failed authentication (no valid member tag): ignored" in stdout
    s = read_summary(out)
    assert s["survivors"] == ["A", "B"] and s["consistent"] and s["rounds_rolled_back"] == 0, told(out)
    # C's quorum requests carry no valid member tag: it is never a member of any round
    assert all(r["members"] == ["A", "B"] and r["outcome"] == "committed" for r in records(out, "A"))


def _chaos(tmp_path: Path, *args: str) -> dict[str, Any]:
    """``geotrain chaos`` on 3 sites, 10 rounds of H=20; its report from the default place (OUT/chaos.json)."""
    cmd = [sys.executable, "-m", "geotrain", "chaos", "--out", str(tmp_path / "run")]
    cmd += ["--sites", "3", "--rounds", "10", "--H", "20", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report: dict[str, Any] = json.loads((tmp_path / "run" / "chaos.json").read_text())
    return report


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead for our purposes
        return f.read().split(") ", 1)[1][0] != "Z"


@pytest.mark.slow
@pytest.mark.timing  # (goodput is a ratio of wall times: beside another test the reference run can be the slower)
def test_chaos_reports_every_round(tmp_path: Path) -> None:
    report = _chaos(tmp_path, "--failures", "2", "--seeds", "1")
    (r,) = report["runs"]
    for key in ("rounds", "committed", "rolled_back", "failures_injected", "consistent", "seconds_lost_per_failure"):
        assert key in r
    assert r["failures_injected"] == 2 and r["consistent"] is True and r["seed"] == 1 and r["cpu_hogs"] == 0
    assert r["rounds"] == r["committed"] + r["rolled_back"] + r["split_then_healed"]
    assert r["committed"] >= 8
    # the schedule it ran, and the goodput against a run of the same sites without failures
    assert len(r["schedule"]) == r["failures_planned"] == 2 and {f["kind"] for f in r["schedule"]} <= {"kill", "hang"}
    (ref,) = report["references"]
    assert ref["failures_planned"] == 0 and ref["committed"] == ref["rounds"]
    assert sum(ref["useful_site_steps"].values()) == 3 * 10 * 20  # every step of every site taken in
    assert 0.2 < r["goodput"] < 1.2 and sum(r["useful_site_steps"].values()) < 3 * 10 * 20, r
    beyond = (r["seconds_lost"] - ref["seconds_lost"]) / 2
    assert r["seconds_lost_per_failure_beyond_reference"] == pytest.approx(beyond)


@pytest.mark.slow
@pytest.mark.timeout(320)
def test_chaos_soak_completes_with_every_core_busy(tmp_path: Path) -> None:
    """A short soak with one busy-looping process per core beside it (bounded, stopped by PID)."""
    hogs = os.cpu_count() or 2
    report = _chaos(tmp_path, "--failures", "3", "--seeds", "2", "--cpu-hogs", str(hogs), "--no-reference")
    (r,) = report["runs"]
    assert r["cpu_hogs"] == hogs and len(r["cpu_hog_pids"]) == hogs
    # a site killed late may still be restarting when the others finish: at least a quorum ends
    assert r["consistent"] is True and len(r["survivors"]) >= 2
    assert r["rounds"] == r["committed"] + r["rolled_back"] + r["split_then_healed"] and r["failures_injected"] >= 1
    assert report["summary"][0]["all_consistent"] is True
    assert not any(_alive(pid) for pid in r["cpu_hog_pids"])  # the hogs were stopped


def test_join_proof_binds_key_round_nonce_prover_and_claims(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from geotrain.elastic.auth import join_proof, load_secret
    from geotrain.errors import MembershipRefused

    p = join_proof(b"s" * 32, "7-1-2", "nonce", "A", b"{}")
    assert p == join_proof(b"s" * 32, "7-1-2", "nonce", "A", b"{}") and len(p) == 64
    for other in (
        join_proof(b"t" * 32, "7-1-2", "nonce", "A", b"{}"),
        join_proof(b"s" * 32, "7-1-3", "nonce", "A", b"{}"),
        join_proof(b"s" * 32, "7-1-2", "nonce2", "A", b"{}"),
        join_proof(b"s" * 32, "7-1-2", "nonce", "B", b"{}"),
        join_proof(b"s" * 32, "7-1-2", "nonce", "A", b'{"committed": 3}'),  # its claims are bound too
    ):
        assert other != p
    monkeypatch.setenv("GEOTRAIN_SECRET", "short")
    with pytest.raises(MembershipRefused, match="at least 16 bytes in environment variable GEOTRAIN_SECRET"):
        load_secret(ElasticConfig())
    f = tmp_path / "secret"
    f.write_text("x" * 40 + "\n")
    f.chmod(0o644)  # readable by every user of the machine: refused, naming the mode
    with pytest.raises(MembershipRefused, match="is open to other users \\(mode 644"):
        load_secret(ElasticConfig(secret_file=str(f)))
    f.chmod(0o600)
    assert load_secret(ElasticConfig(secret_file=str(f))) == b"x" * 40
    if os.geteuid() == 0:  # another user's file, even if closed to others
        os.chown(f, 4242, 4242)
        with pytest.raises(MembershipRefused, match="owner uid 4242"):
            load_secret(ElasticConfig(secret_file=str(f)))


def test_fault_plan_respects_spacing() -> None:
    from geotrain.bench.chaos import plan_faults

    plan = plan_faults(["A", "B", "C", "D"], rounds=30, H=100, failures=10, spacing=6, seed=3)
    assert len(plan) == 10 and len({(step - 1) // 100 for _, step, _ in plan}) == 10
    for site in "ABCD":
        rounds = sorted((step - 1) // 100 + 1 for s, step, _ in plan if s == site)
        assert all(b - a >= 6 for a, b in zip(rounds, rounds[1:], strict=False))
    assert {k for _, _, k in plan} <= {"kill", "hang"}


def test_round_outcomes_flag_a_committed_round_with_two_models() -> None:
    from geotrain.elastic.records import round_outcomes

    def rec(key: str, outcome: str, committed: int, h: str) -> dict[str, Any]:
        return {"key": key, "outcome": outcome, "committed": committed, "hash": h}

    good = {"A": [rec("k1", "committed", 1, "x"), rec("k2", "rolled_back", 1, "x")], "B": [rec("k1", "committed", 1, "x")]}
    assert round_outcomes(good) == {"rounds": 2, "committed": 1, "rolled_back": 1, "split": 0, "consistent_history": True}
    bad = {"A": [rec("k1", "committed", 1, "x")], "B": [rec("k1", "committed", 1, "y"), rec("k2", "rolled_back", 1, "y")]}
    out = round_outcomes(bad)
    assert out["consistent_history"] is False
    split = {"A": [rec("k1", "committed", 1, "x")], "B": [rec("k1", "rolled_back", 0, "w")]}
    assert round_outcomes(split)["split"] == 1


def test_useful_steps_count_what_committed_rounds_took_in() -> None:
    """The goodput's numerator: a rolled-back round discards its steps, a heal replaces the site's
    own with its source's, and in two tiers only region rounds take steps in (a failed world round
    loses nothing)."""
    from geotrain.elastic.records import useful_steps

    def rec(step: int, outcome: str = "committed", healers: tuple[str, ...] = (), part: int | None = None) -> dict[str, Any]:
        return {"step": step, "outcome": outcome, "healers": list(healers), **({"part": part} if part is not None else {})}

    a = [rec(10), rec(20, "rolled_back"), rec(30), rec(40)]
    b = [rec(10), rec(30, healers=("B",)), rec(40)]  # killed after step 10, healed from A at step 30
    assert useful_steps({"A": a, "B": b}) == {"A": 30, "B": 20}
    # two tiers: region rounds (part 2f) and world rounds (part 2f + 1); fragment 1's region round too
    tiers = [rec(10, part=0), rec(10, "rolled_back", part=1), rec(20, part=0), rec(25, part=2), rec(30, part=1)]
    assert useful_steps({"A": tiers}, tiers=True) == {"A": 25}
    assert useful_steps({"A": tiers}) == {"A": 30}  # read as one tier, the failed round would cost its 10 steps


def test_a_round_sums_the_fragment_of_its_source_and_a_site_on_another_heals() -> None:
    """Streaming DiLoCo in elastic mode: each site claims the fragment it syncs. The round sums
    the source's; a site about to sync another fragment (it missed rounds) heals from the source
    and takes the round's average for the source's fragment; a site that has run its steps (no
    fragment) takes part without healing; the next round meets at the furthest site's schedule."""
    from geotrain.elastic.view import Member, Schedule, heal_source, healers, round_part

    def m(site: str, committed: int, part: int, step: int = 10) -> Member:
        return Member(site, "s", committed, "h" if committed == 4 else "old", step=step, part=part)

    members = [m("A", 4, 1), m("B", 4, 1), m("C", 3, 0, step=5), m("D", 4, -1)]
    source = heal_source(members)
    assert source == "A" and round_part(members, source, ["A", "B", "C", "D"]) == 1
    assert healers(members, source, ["A", "B", "C", "D"]) == ["C"]
    same_committed_other_part = [m("A", 4, 1), m("B", 4, 0)]
    assert healers(same_committed_other_part, "A", ["A", "B"]) == ["B"]
    idle_source = [m("A", 4, -1), m("B", 4, 0)]  # A has run its steps: the round is B's fragment
    assert round_part(idle_source, "A", ["A", "B"]) == 0 and healers(idle_source, "A", ["A", "B"]) == []
    sched = Schedule([1, 1], 0)
    sched.round_steps, sched.round_rests = [40, 40], [0, 1]
    assert not sched.all_finished(40)  # B still owes one fragment's round
    sched.round_rests = [0, 0]
    assert sched.all_finished(40)


def test_one_fault_plan_per_site_holds_every_injection() -> None:
    """Failure injection is one plan per site (comm/faults.py), built from the whole run's
    fault.nan, fault.tamper and privacy.inject; each seam asks it, and an empty plan answers no."""
    from geotrain.comm.faults import FaultPlan
    from geotrain.config import load_config

    cfg = load_config(
        None,
        [
            "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}]",
            "fault.nan=[B@3]",
            "privacy.secure_aggregation=true",
            "privacy.inject=[B@2:drop]",
        ],
    )
    tampered = [("B", 30), ("A", 20)]  # (fault.tamper needs elastic mode, and privacy.inject plain mode)
    b = FaultPlan.for_site("B", cfg.fault.nan_at(), tampered, cfg.privacy.injections())
    x = torch.ones(4)
    b.corrupt_update(x, 2)
    assert torch.isfinite(x).all()
    b.corrupt_update(x, 3)
    assert torch.isnan(x).all()
    assert b.tampers(30) and not b.tampers(20) and b.secagg_fault(2) == "drop" and b.secagg_fault(3) is None
    empty = FaultPlan("A")
    assert not empty.tampers(20) and empty.secagg_fault(2) is None


def test_a_fault_is_judged_only_until_its_site_heals() -> None:
    """D, killed at t=100, came back and healed in the next round (quorum at 101.2) before anyone
    left it out; A's death at 108 rolled back a round that still had D in it. That rollback is A's,
    not D's (it was once counted as D's detection, 8.5 s)."""
    from geotrain.elastic.records import attribute_failures

    every = ["A", "B", "C", "D"]
    logs = {
        "B": [
            {"start": 100.2, "quorum_s": 1.0, "end": 101.5, "admitted": every, "healers": ["D"], "outcome": "committed"},
            {"start": 108.1, "quorum_s": 0.1, "end": 108.5, "admitted": every, "healers": [], "outcome": "rolled_back"},
            {"start": 109.0, "quorum_s": 0.1, "end": 109.4, "admitted": ["B", "C", "D"], "healers": [], "outcome": "committed"},
        ]
    }
    faults = [{"site": "D", "kind": "kill", "injected_at": 100.0}, {"site": "A", "kind": "kill", "injected_at": 108.0}]
    d, a = attribute_failures(faults, [{"site": "A", "time": 108.4}], logs)
    assert d["detection_seconds"] is None and d["excluded_after_seconds"] is None
    assert d["healed_after_seconds"] == pytest.approx(1.2)
    assert a["detection_seconds"] == pytest.approx(0.4) and a["excluded_after_seconds"] == pytest.approx(1.1)
    assert a["healed_after_seconds"] is None


@pytest.mark.slow
@pytest.mark.parametrize(
    "algorithm",
    [
        [],
        ["sync.algorithm=streaming", "sync.fragments=2", "sync.tau=2"],
        ["topology.regions=[{name: us, sites: [A]}, {name: eu, sites: [B]}]", "sync.region_every=3"],
    ],
    ids=["diloco", "streaming", "tiers"],
)
def test_elastic_checkpoints_resume_after_a_total_outage_exactly(tmp_path: Path, algorithm: list[str]) -> None:
    """Every process of the run (launcher, Lighthouse, all sites) SIGKILLed at once; started again
    with checkpoint.resume=auto, each site resumes from its own checkpoint and the run ends
    bit-identical to one that never stopped. Streaming DiLoCo's checkpoint at step 40 holds a
    fragment synced at 40 and merged at 42: its average is in the checkpoint, and the resumed run
    merges it at 42 and syncs the next fragment at 45, as the run that never stopped. In two tiers
    (a world round every third region round) the checkpoint at 40 falls between world rounds: it
    holds the region's model and momentum beside the world's."""
    common = [*ELASTIC, "train.steps=100", "checkpoint.every=20", *algorithm]
    whole = tmp_path / "whole"
    train_cli(whole, common, TWO)
    out = tmp_path / "outage"
    proc = subprocess.Popen(train_args(out, common, TWO), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 150
        while not all((out / "checkpoints" / s / "step-00000040" / "manifest.json").exists() for s in "AB"):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        pids = json.loads((out / "pids.json").read_text())
        for pid in [pids["launcher"], pids["zygote"], pids["lighthouse"], *pids["ranks"]]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
    finally:
        proc.kill()
        proc.wait()
    gone = time.monotonic() + 10  # SIGKILL is asynchronous: a loaded machine takes a moment to end them
    while any(_alive(p) for p in [pids["lighthouse"], *pids["ranks"]]) and time.monotonic() < gone:
        time.sleep(0.05)
    assert not any(_alive(p) for p in [pids["lighthouse"], *pids["ranks"]])
    train_cli(out, [*common, "checkpoint.resume=auto"], TWO)
    a, b = read_summary(whole), read_summary(out)
    resumed = json.loads((out / "elastic" / "summary-A.json").read_text())["started_at_step"]
    assert resumed >= 40 and resumed % 20 == 0
    assert a["global_param_hash"] == b["global_param_hash"] and a["consistent"] and b["consistent"]
