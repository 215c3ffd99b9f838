"""Failure handling of the local launcher: a killed rank stops the job cleanly, no orphans; ranks
forked from the zygote (or started fresh) behave as processes of their own."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from geotrain.comm.procs import free_port
from tests.test_training import TINY


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().split(") ", 1)[1].split()[1])


def _start(tmp_path: Path) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    args = [
        sys.executable,
        "-m",
        "geotrain",
        "train",
        "--out",
        str(tmp_path),
        "--set",
        "train.steps=100000",
        "--set",
        "run.baseline=none",
    ] + [a for o in TINY for a in ("--set", o)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    metrics = tmp_path / "metrics" / "rank0.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists() and metrics.stat().st_size > 0 and (tmp_path / "pids.json").exists():
            return proc, json.loads((tmp_path / "pids.json").read_text())
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("training did not start")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_killed_rank_fails_the_job_naming_site_and_rank(tmp_path: Path) -> None:
    proc, started = _start(tmp_path)
    pids = started["ranks"]
    t0 = time.monotonic()
    os.kill(pids[2], signal.SIGKILL)  # rank 2 = site B, local rank 0
    _, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1
    assert (
        elapsed < 60
    )  # the launcher polls its ranks every 50 ms; 60 s is only what a missed death would take (the run is endless)
    assert "rank 2 (site B, local rank 0) was killed by SIGKILL" in err, err
    time.sleep(0.5)
    assert not any(_alive(p) for p in pids)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_killing_the_launcher_takes_the_ranks_down(tmp_path: Path) -> None:
    proc, started = _start(tmp_path)
    pids = [*started["ranks"], started["zygote"]]  # the zygote dies with the launcher, the ranks with it
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def _rank_env(**extra: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")} | extra


def _waiting_rank(tmp_path: Path, fork: bool) -> tuple[Any, threading.Thread, Path]:
    """A rank that waits in the rendezvous for a peer that never comes (rank 0 of 2, for up to 60 s)."""
    from geotrain.launch.spawn import spawn_rank, worker_args

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("topology:\n  sites: [{name: A, workers: 1}, {name: B, workers: 1}]\nliveness:\n  group_timeout_s: 60\n")
    env = _rank_env(RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env["GEOTRAIN_PARENT_PID"] = str(os.getpid())
    log = tmp_path / "rank.log"
    p, t = spawn_rank(worker_args(cfg, tmp_path / "out"), env, log, None, fork=fork)
    return p, t, log


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fork", [True, False], ids=["forked", "fresh"])
def test_a_rank_is_a_real_process_of_its_own_with_popens_exit_codes(tmp_path: Path, fork: bool) -> None:
    from geotrain.launch.spawn import spawn_rank, worker_args

    # no torch.distributed environment: the worker says so and exits 2, into its log
    log = tmp_path / "bare.log"
    p, t = spawn_rank(worker_args(tmp_path / "none.yaml", tmp_path / "out"), _rank_env(), log, None, fork=fork)
    assert p.wait(timeout=60) == 2
    t.join(timeout=10)
    assert "the worker needs the torch.distributed environment (RANK, WORLD_SIZE" in log.read_text()

    p, t, log = _waiting_rank(tmp_path, fork)
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.5)  # still waiting for its peer
    assert p.poll() is None and _alive(p.pid)
    assert os.getsid(p.pid) == p.pid  # a session of its own: the terminal's Ctrl-C goes to the launcher only
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == -signal.SIGTERM
    assert not _alive(p.pid)
    p.kill()  # a rank already reaped is never signalled (its PID may be someone else's by now)
    t.join(timeout=10)


@pytest.mark.timeout(120)
def test_ranks_die_with_their_zygote(tmp_path: Path) -> None:
    from geotrain.launch import spawn

    p, t, _ = _waiting_rank(tmp_path, fork=True)
    zygote = spawn.zygote_pid()
    assert zygote is not None and _parent(p.pid) == zygote
    os.kill(zygote, signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL  # PR_SET_PDEATHSIG; the launcher sees the zygote's end
    deadline = time.monotonic() + 10
    while _alive(p.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(p.pid)
    q, u, _ = _waiting_rank(tmp_path, fork=True)  # the next rank gets a new zygote
    assert spawn.zygote_pid() not in (None, zygote)
    q.kill()
    assert q.wait(timeout=30) == -signal.SIGKILL
    t.join(timeout=10)
    u.join(timeout=10)


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0, reason="handing a PID on again (kernel.ns_last_pid) needs root")
def test_a_rank_given_an_earlier_ranks_pid_is_not_taken_for_it(tmp_path: Path) -> None:
    """The kernel hands PIDs on again (pid_max is 32768 here), and a zygote kept for many runs (the
    tests, geotrain.api) forks thousands of ranks. A new rank with the PID of one that exited must
    not be read as exited with its code: a launcher took such a site for finished at its start,
    stopped the others, and never signalled it again."""
    from geotrain.launch.spawn import spawn_rank, worker_args

    p, t = spawn_rank(worker_args(tmp_path / "none.yaml", tmp_path / "out"), _rank_env(), tmp_path / "bare.log", None, fork=True)
    assert p.wait(timeout=60) == 2  # (no torch.distributed environment)
    t.join(timeout=10)
    for _ in range(20):  # another process may take the PID first (the tests run in parallel)
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(p.pid - 1))
        q, pump, _ = _waiting_rank(tmp_path, fork=True)
        if q.pid == p.pid:
            break
        q.kill()
        q.wait(timeout=30)
        pump.join(timeout=10)
    else:
        pytest.skip("the PID was taken by other processes 20 times")
    time.sleep(0.5)
    assert q.poll() is None and _alive(q.pid)  # running, and a signal still reaches it
    q.kill()
    assert q.wait(timeout=30) == -signal.SIGKILL
    pump.join(timeout=10)


@pytest.mark.timeout(120)
def test_the_zygote_outlives_the_thread_that_started_it(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG fires when the *thread* that started a process ends. A run launched from a
    worker thread (as tests and services do) must not take the zygote, and so the next run's
    ranks, with it when that thread returns."""
    from geotrain.launch import spawn

    spawn.stop_zygote()
    started: list[Any] = []
    t = threading.Thread(target=lambda: started.append(_waiting_rank(tmp_path, fork=True)))
    t.start()
    t.join(timeout=60)
    p, pump, _ = started[0]
    zygote = spawn.zygote_pid()
    time.sleep(1.0)
    assert zygote is not None and _alive(zygote) and p.poll() is None
    q, pump2, _ = _waiting_rank(tmp_path, fork=True)
    assert spawn.zygote_pid() == zygote  # the same zygote serves the next rank
    for r in (p, q):
        r.kill()
        assert r.wait(timeout=30) == -signal.SIGKILL
    pump.join(timeout=10)
    pump2.join(timeout=10)


# A run whose fragment exchange lasts about a minute: 2 sites x 2 workers, Streaming DiLoCo, a
# 15 kbit/s link. A fragment's exchange crosses it in a background thread while the ranks train on.
_SLOW_EXCHANGE = """
topology:
  sites: [{name: A, workers: 2}, {name: B, workers: 2}]
  links: {inter: {bandwidth_bps: 1.5e4, latency_s: 0.02}}
train: {steps: 1000, log_every: 1, threads: 1}
sync: {algorithm: streaming, H: 200, fragments: 4, tau: 150, lanes: 2, chunk_bytes: 65536}
run: {baseline: none}
liveness: {group_timeout_s: 300}
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("fork", [True, False], ids=["zygote", "torchrun"])
def test_a_failing_rank_exits_at_once_while_its_exchange_is_on_the_wire(tmp_path: Path, fork: bool) -> None:
    """Rank 1 is SIGKILLed while rank 0's lane threads hold a fragment's chunks from site B until
    the slow link would have delivered them (about 35 s). Rank 0's training thread fails at its
    next in-site all-reduce, long before the fragment is due (tau = 150 steps: site A may run
    seconds ahead of site B without reaching the merge, where it would wait for the exchange). The rank must exit within 10 s of the
    kill, forked by the zygote or started as torchrun starts it (``python -m
    geotrain.run.worker``): its lane and exchange threads are daemons and a worker leaves with
    ``os._exit`` (``comm/procs.leave``). With non-daemon threads and the interpreter's exit it
    took 34.8 s and 35.0 s: shutdown joined the lane threads until the transfer ended. The bound
    is far above what the exit takes on a loaded machine (0.1 s here)."""
    from geotrain.launch.spawn import rank_env, spawn_rank, stop_all, worker_args

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(_SLOW_EXCHANGE)
    port = free_port()
    ranks = []
    for r in range(4):
        env = {**rank_env(r, 4, 4, port, "inprocess"), "GEOTRAIN_PARENT_PID": str(os.getpid())}
        ranks.append(spawn_rank(worker_args(cfg, tmp_path / "out"), env, tmp_path / f"rank{r}.log", None, fork=fork))
    procs = [p for p, _ in ranks]
    try:
        logs = [tmp_path / "rank0.log", tmp_path / "rank2.log"]  # each site's local rank 0 prints its steps

        def sending(log: Path) -> bool:  # a fragment is on the wire: 'in flight  0.xxx MB' above zero
            text = log.read_text() if log.exists() else ""
            return any("in flight" in line and "in flight  0.000 MB" not in line for line in text.splitlines())

        deadline = time.monotonic() + 90
        while not all(sending(log) for log in logs):
            assert time.monotonic() < deadline, "no exchange started:\n" + logs[0].read_text()
            assert procs[0].poll() is None, logs[0].read_text()
            time.sleep(0.05)
        time.sleep(1.0)  # both sides sent their first chunks; by the link's clock they arrive in about 35 s
        procs[1].kill()
        t0 = time.monotonic()
        with contextlib.suppress(subprocess.TimeoutExpired):
            procs[0].wait(timeout=60)
        elapsed = time.monotonic() - t0
        code = procs[0].poll()
        assert code is not None and code > 0, f"rank 0 still running {elapsed:.1f} s after the kill"
        assert elapsed < 10, f"rank 0 exited {elapsed:.1f} s after its site-mate was killed"
        assert re.search("Connection (closed|reset) by peer", logs[0].read_text())  # it failed on the lost peer
    finally:
        stop_all(procs)
        for _, pump in ranks:
            pump.join(timeout=10)


def test_threads_are_shared_with_every_geotrain_rank_on_the_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several `geotrain site` commands rehearsed on one machine each know only their own site's
    ranks (LOCAL_WORLD_SIZE): the auto thread rule also counts the geotrain ranks running on the
    machine (a Lighthouse and three 1-worker sites on 2 cores: 217.6 s with 2 threads per rank
    and 6 pauses for lost heartbeats, 22.2 s with the rule, which gives each 1)."""
    from geotrain.comm import procs

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(12)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    # stand-ins for ranks of other sites: processes running a file at the worker's path (a process
    # that only mentions the name, as `grep geotrain.run.worker` does, is not one)
    stand_in = tmp_path / "geotrain" / "run" / "worker.py"
    stand_in.parent.mkdir(parents=True)
    stand_in.write_text("import time\ntime.sleep(60)\n")
    mention = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", "x", "geotrain.run.worker"])
    others = [mention, *(subprocess.Popen([sys.executable, str(stand_in)]) for _ in range(3))]
    # the scan sees this test's processes only: ranks of tests running beside it (pytest-xdist)
    # would come and go in the count
    listdir = os.listdir
    mine = [str(p.pid) for p in others] + [str(os.getpid())]
    monkeypatch.setattr(os, "listdir", lambda path: mine if path == "/proc" else listdir(path))
    base = 0  # (this test runs no rank)
    try:
        deadline = time.monotonic() + 20
        while procs.host_ranks() < base + 3 and time.monotonic() < deadline:  # (their exec takes a moment)
            time.sleep(0.05)
        assert procs.host_ranks() == base + 3
        assert procs.rank_threads(0) == 12 // (base + 3) == 4
        assert procs.rank_threads(5) == 5  # as configured
        monkeypatch.setattr(os, "getloadavg", lambda: (40.0, 0.0, 0.0))
        hint = procs.oversubscribed()
        assert hint is not None and "load is 40.0 on 12 core(s)" in hint and f"{base + 3} geotrain rank(s)" in hint
        monkeypatch.setattr(os, "getloadavg", lambda: (3.0, 0.0, 0.0))
        assert procs.oversubscribed() is None
    finally:
        for p in others:
            p.kill()
            p.wait()


def test_more_ranks_than_gpus_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """NCCL puts one rank on each GPU: this machine has none, so any nccl run starts too many
    (once a raw 'invalid device ordinal' traceback from a rank); gloo and auto (gloo here) run."""
    import torch

    from geotrain.comm.groups import gpus_for

    have = torch.cuda.device_count()
    assert gpus_for(have + 1, "nccl").startswith(f"run.backend: nccl runs one rank per GPU; this machine has {have} GPU(s)")
    assert gpus_for(have, "nccl") == "" and gpus_for(64, "gloo") == ""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "geotrain", "train", "--set", "run.backend=nccl", "--out", str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if have >= 4:
        pytest.skip("this machine has a GPU per rank of the default run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"geotrain: config error: run.backend: nccl runs one rank per GPU; this machine has {have} GPU(s) and the run "
        "starts 4 rank(s) here (topology.sites' workers); give it fewer workers per machine, or use run.backend=gloo"
    ]
    assert not (out / "logs").exists()
