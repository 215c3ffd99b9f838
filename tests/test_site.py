"""``geotrain site``: one command per site of an elastic run, its refusals, and bounded waits; and
the deployment itself tried like separate machines: the Lighthouse and each site in a network
namespace of its own (own network stack, addresses assigned there), each started by the
documented command; a site killed and brought back, all ending bit-identical."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from geotrain.comm.emulate import kernel as netns
from geotrain.comm.procs import free_port
from geotrain.config import ElasticConfig, LivenessConfig, load_config
from geotrain.errors import ConfigError, ElasticTimeout
from tests.helpers import kernel_links_unavailable

pytestmark = pytest.mark.timeout(240)

SECRET = {"GEOTRAIN_SECRET": "a-test-secret-of-enough-bytes"}
SITES = """topology:
  sites: [{name: A, workers: 1}, {name: B, workers: 1}]
  links: {emulate: "off"}
model: {n_layer: 1, n_embd: 32, n_head: 2, block_size: 16}
train: {steps: 80, batch_size: 4, eval_every: 0, eval_batches: 2, log_every: 1000, threads: 1}
optim: {warmup_steps: 0}
sync: {algorithm: diloco, H: 10}
run: {baseline: none}
elastic: {enabled: true, min_sites: 1}
"""


def _site(cfg: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "geotrain", "site", "--config", str(cfg), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture
def cfg_file(tmp_path: Path) -> Path:
    path = tmp_path / "elastic.yaml"
    path.write_text(SITES)
    return path


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--site", "Z", "--lighthouse", "127.0.0.1:1"], SECRET, "--site: must be one of A, B (got 'Z')"),
        (["--site", "A"], SECRET, "--lighthouse: give HOST:PORT"),
        (["--site", "A", "--lighthouse", "nohost"], SECRET, "--lighthouse: expected HOST:PORT"),
        (["--site", "A", "--lighthouse", "127.0.0.1:1"], {"GEOTRAIN_SECRET": ""}, "no membership secret"),
        (["--site", "A", "--lighthouse", "127.0.0.1:1", "--bind", "192.0.2.77"], SECRET, "--bind: no network interface"),
        (["--site", "A", "--lighthouse", "127.0.0.1:1", "--set", "elastic.enabled=false"], SECRET, "elastic.enabled:"),
    ],
)
def test_site_refuses_missing_settings(cfg_file: Path, args: list[str], env: dict[str, str], message: str) -> None:
    proc = _site(cfg_file, *args, "--out", str(cfg_file.parent / "out"), env=env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr


def test_a_site_whose_lighthouse_never_answers_stops_within_the_wait_bound(cfg_file: Path) -> None:
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    proc = _site(
        cfg_file, "--site", "A", "--lighthouse", f"127.0.0.1:{port}", "--set", "liveness.wait_timeout_s=3",
        "--out", str(cfg_file.parent / "out"), env=SECRET,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "elastic wait timed out" in proc.stdout + proc.stderr and "liveness.wait_timeout_s=3" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert time.monotonic() - t0 < 90


def test_coordinator_waits_are_bounded_postponed_or_not() -> None:
    """Rounds postponed while the Lighthouse is unreachable (DiLoCo.finish retries them) and the
    start rendezvous both end with ElasticTimeout after liveness.wait_timeout_s."""
    from geotrain.elastic.coordinator import Coordinator

    live = LivenessConfig(heartbeat_s=0.05, heartbeat_timeout_s=0.5, wait_timeout_s=1.5)
    c = Coordinator(ElasticConfig(enabled=True), f"127.0.0.1:{free_port()}", "A", 1, "127.0.0.1:1", lambda _: None, live)
    try:
        t0 = time.monotonic()
        with pytest.raises(ElasticTimeout, match=r"liveness.wait_timeout_s=1.5.*Lighthouse .* unreachable"):
            while time.monotonic() - t0 < 30:
                assert c.quorum(True, committed=0, joining=False, data={}) is None
                time.sleep(0.05)
        assert 1.5 <= time.monotonic() - t0 < 10
        with pytest.raises(ElasticTimeout):  # not postponable (the start rendezvous): raises, does not spin
            c.quorum(False, committed=0, joining=False, data={})
    finally:
        c.close()


def test_a_site_private_corpus_is_checked_only_where_that_site_runs(tmp_path: Path) -> None:
    from geotrain.launch.preflight import preflight

    own = tmp_path / "a.txt"
    own.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    text = SITES.replace("{name: A, workers: 1}", f"{{name: A, workers: 1, corpus: {own}}}")
    text = text.replace("{name: B, workers: 1}", "{name: B, workers: 1, corpus: /only/on/site/B/data.txt}")
    (tmp_path / "c.yaml").write_text(text)
    cfg = load_config(tmp_path / "c.yaml")  # B's corpus exists on B's machine only: loading is fine
    preflight(cfg, site=0)
    with pytest.raises(ConfigError, match=r"topology.sites\[1\].corpus: file or directory not found on this machine"):
        preflight(cfg, site=1)
    with pytest.raises(ConfigError, match=r"topology.sites\[1\].corpus"):
        preflight(cfg)  # one machine for every site: all are checked


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "the worker needs the torch.distributed environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set)"),
        (
            {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
            "GEOTRAIN_SITE_INDEX: elastic mode needs it set to 0..1 (got None)",
        ),
    ],
)
def test_worker_refuses_a_missing_environment_in_one_line(cfg_file: Path, env: dict[str, str], message: str) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "GEOTRAIN_"))}
    cmd = [sys.executable, "-m", "geotrain.run.worker", "--config", str(cfg_file), "--out", str(cfg_file.parent / "w")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**base, **env})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr[-2000:]


# ----------------------------------------------------------------- separate "machines" (netns)

_WHY = kernel_links_unavailable()


@contextlib.contextmanager
def _machines(n: int) -> Iterator[tuple[list[str], list[str]]]:
    """``n`` network namespaces on one bridge (addresses 10.77.0.1..n), removed afterwards."""
    from geotrain.comm.topology import Topology
    from geotrain.config import Config

    names = [{"name": f"m{i}", "workers": 1} for i in range(n)]
    topo = Topology.from_config(Config.model_validate({"topology": {"sites": names}}).topology)
    links = netns.KernelLinks(topo).up()
    try:
        yield links.namespaces, [links.address(i) for i in range(n)]
    finally:
        links.down()


def _start(ns: str, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "geotrain", *args],
            stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **SECRET}, start_new_session=True,
        )  # fmt: skip


def _committed(out: Path, site: str) -> int:
    path = out / "elastic" / f"rounds-{site}.jsonl"
    if not path.exists():
        return 0
    return sum(json.loads(x)["outcome"] == "committed" for x in path.read_text().splitlines() if x.strip())


@contextlib.contextmanager
def _deployment(cfg_file: Path, machines: int) -> Iterator[tuple[Callable[[int, str, int], subprocess.Popen[bytes]], Path]]:
    """min_sites=2; the Lighthouse on machine 0 and ``site(i, name, incarnation)`` starting a site
    on machine i; yields that and the run's folder. Every process is killed on the way out."""
    cfg_file.write_text(SITES.replace("min_sites: 1", "min_sites: 2"))
    out = cfg_file.parent / "run"
    out.mkdir()
    procs: list[subprocess.Popen[bytes]] = []
    with _machines(machines) as (spaces, addrs):
        lighthouse = f"{addrs[0]}:29510"
        try:
            procs.append(_start(spaces[0], ["lighthouse", "--bind", lighthouse, "--min-sites", "2"], out / "lh.log"))

            def site(i: int, name: str, incarnation: int) -> subprocess.Popen[bytes]:
                args = ["site", "--config", str(cfg_file), "--site", name, "--lighthouse", lighthouse]
                args += ["--bind", addrs[i], "--incarnation", str(incarnation), "--out", str(out)]
                p = _start(spaces[i], args, out / f"{name}.{incarnation}.log")
                procs.append(p)
                return p

            yield site, out
        finally:
            for p in procs:
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGKILL)
                p.wait()


@pytest.mark.slow
@pytest.mark.skipif(_WHY is not None, reason=f"network namespaces unavailable: {_WHY}")
def test_sites_on_separate_network_stacks_survive_a_killed_site_and_end_identical(cfg_file: Path) -> None:
    """min_sites=2: while B is dead, A pauses (and stays a heal source); B comes back and heals from it."""
    with _deployment(cfg_file, 3) as (site, out):
        a, b = site(1, "A", 0), site(2, "B", 0)
        deadline = time.monotonic() + 150
        while _committed(out, "B") < 2:  # B has taken part in rounds: now kill it
            assert time.monotonic() < deadline and a.poll() is None and b.poll() is None, (out / "B.0.log").read_text()[-3000:]
            time.sleep(0.1)
        os.kill(b.pid, signal.SIGKILL)  # its workers die with it (parent-death signal)
        b.wait()
        # B comes back only once A has paused: a fixed delay raced A's failed round (which
        # waits out B's authentication) and B could be back before A asked again
        while "training paused: fewer than elastic.min_sites=2" not in (out / "A.0.log").read_text():
            assert time.monotonic() < deadline and a.poll() is None, (out / "A.0.log").read_text()[-3000:]
            time.sleep(0.1)
        b2 = site(2, "B", 1)
        for p, log in ((a, "A.0.log"), (b2, "B.1.log")):
            assert p.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, (out / log).read_text()[-3000:]
    summaries = {s: json.loads((out / "elastic" / f"summary-{s}.json").read_text()) for s in ("A", "B")}
    hashes = {s: summaries[s]["global_param_hash"][s] for s in ("A", "B")}
    assert hashes["A"] == hashes["B"], hashes
    assert "healed from A" in (out / "logs" / "B-rank0.1.log").read_text()
    assert "training paused: fewer than elastic.min_sites=2" in (out / "A.0.log").read_text()
    rounds = [json.loads(x) for x in (out / "elastic" / "rounds-A.jsonl").read_text().splitlines() if x.strip()]
    assert all(len(r["admitted"]) >= 2 for r in rounds if r["outcome"] == "committed")  # never below min_sites
    assert summaries["A"]["rounds_committed"] == summaries["B"]["rounds_committed"] >= 6


@pytest.mark.slow
@pytest.mark.skipif(_WHY is not None, reason=f"network namespaces unavailable: {_WHY}")
def test_a_site_migrates_to_another_machine_with_geotrain_site_commands(cfg_file: Path) -> None:
    """The documented sequence: SIGUSR1 to B's `geotrain site` drains it after a committed round
    (exit 0); `geotrain site --site B --incarnation 1` on another machine (address) heals from A.
    min_sites=2: A pauses while B moves (else this tiny run would end before B is back)."""
    with _deployment(cfg_file, 4) as (site, out):
        a, b = site(1, "A", 0), site(2, "B", 0)
        deadline = time.monotonic() + 150
        while _committed(out, "B") < 2:
            assert time.monotonic() < deadline and a.poll() is None and b.poll() is None, (out / "B.0.log").read_text()[-3000:]
            time.sleep(0.1)
        os.kill(b.pid, signal.SIGUSR1)
        assert b.wait(timeout=60) == 0, (out / "B.0.log").read_text()[-3000:]
        assert "drained after a committed round" in (out / "B.0.log").read_text()
        b2 = site(3, "B", 1)  # another machine: another address
        for p, log in ((a, "A.0.log"), (b2, "B.1.log")):
            assert p.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, (out / log).read_text()[-3000:]
    summaries = {s: json.loads((out / "elastic" / f"summary-{s}.json").read_text()) for s in ("A", "B")}
    assert summaries["A"]["global_param_hash"]["A"] == summaries["B"]["global_param_hash"]["B"]
    assert "healed from A" in (out / "logs" / "B-rank0.1.log").read_text()
    rounds = [json.loads(x) for x in (out / "elastic" / "rounds-A.jsonl").read_text().splitlines() if x.strip()]
    assert all(r["outcome"] == "committed" for r in rounds), "B left between rounds: none rolled back"


def _start_rank(rank: int, seeds: list[int]) -> str:
    import torch
    import torch.distributed as dist

    from geotrain.errors import StartMismatch
    from geotrain.models import build_model
    from geotrain.run.state import check_same_start

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(seeds[rank])
        from geotrain.config import ModelConfig

        model = build_model(ModelConfig(n_layer=1, n_embd=16, n_head=2, block_size=8))
        try:
            check_same_start(model, dist.group.WORLD)
        except StartMismatch as exc:
            return str(exc)
        return "same"
    finally:
        dist.destroy_process_group()


def test_initial_models_are_compared_before_step_one() -> None:
    from tests.helpers import run_ranks

    assert run_ranks(2, _start_rank, [7, 7]) == ["same", "same"]
    got = run_ranks(3, _start_rank, [7, 7, 8])
    assert got[0] == got[1] == got[2] and got[0].startswith("the initial model of rank(s) 2 differs from rank 0's")


@pytest.mark.slow
def test_sites_started_with_different_seeds_are_refused_at_the_rendezvous(cfg_file: Path) -> None:
    from geotrain.elastic.lighthouse import LighthouseProcess

    lh = LighthouseProcess(0, ElasticConfig(), cfg_file.parent / "lh.log")
    lh.start()
    try:
        cmd = [sys.executable, "-m", "geotrain", "site", "--config", str(cfg_file), "--lighthouse", lh.address]
        env = {**os.environ, **SECRET}
        procs = [
            subprocess.Popen(
                [*cmd, "--site", s, "--set", f"train.seed={seed}", "--out", str(cfg_file.parent / "out")],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )  # fmt: skip
            for s, seed in (("A", 1), ("B", 2))
        ]
        outs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        lh.stop()
    for p, text in zip(procs, outs, strict=True):
        assert p.returncode == 1, text[-2000:]
        assert "membership refused: the initial model of site(s)" in text and "differs from site" in text


def test_ports_are_bound_where_they_are_chosen(tmp_path: Path) -> None:
    """The Lighthouse binds a port the kernel picks and reports it; a rendezvous store is hosted
    by the launcher itself. Neither checks a port, closes it and binds it again later."""
    import socket

    from geotrain.comm.procs import host_store
    from geotrain.elastic.lighthouse import LighthouseProcess

    lh = LighthouseProcess(0, ElasticConfig(), tmp_path / "lh.log")
    lh.start()
    try:
        assert lh.port > 0 and lh.address == f"127.0.0.1:{lh.port}"
        with socket.create_connection(("127.0.0.1", lh.port), timeout=5):
            pass  # it is listening there, not merely free
        assert lh.proc is not None
        lh.kill()
        assert lh.supervise() and lh.port == int(lh.address.rpartition(":")[2])  # restarted on the same port
    finally:
        lh.stop()
    store, env = host_store()
    assert store.port > 0 and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    with socket.create_connection(("127.0.0.1", store.port), timeout=5):
        pass


def test_a_long_round_of_inner_steps_is_not_a_wait(tmp_path: Path) -> None:
    """wait_timeout_s counts time spent waiting for a quorum, not the inner steps between rounds."""
    from geotrain.elastic.coordinator import Coordinator
    from geotrain.elastic.lighthouse import LighthouseProcess

    lh = LighthouseProcess(0, ElasticConfig(), tmp_path / "lh.log")
    lh.start()
    live = LivenessConfig(heartbeat_s=0.05, heartbeat_timeout_s=0.5, wait_timeout_s=1.0)
    c = Coordinator(ElasticConfig(enabled=True), lh.address, "A", 1, "127.0.0.1:1", lambda _: None, live)
    try:
        for _ in range(2):
            assert c.quorum(False, committed=0, joining=False, data={}) is not None
            time.sleep(1.5)  # a round of inner steps longer than wait_timeout_s
    finally:
        c.close()
        lh.stop()


def _listening(pid: int) -> set[str]:
    """The IPv4 addresses process ``pid`` listens on, as its own network namespace sees them."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            link = str(fd.readlink()) if fd.is_symlink() else ""
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = set()
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                out.add(socket.inet_ntoa(bytes.fromhex(f[1].split(":")[0])[::-1]))
    return out


def _children(pid: int) -> list[int]:
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(d.name))
    return kids


@pytest.mark.slow
@pytest.mark.skipif(_WHY is not None, reason=f"network namespaces unavailable: {_WHY}")
def test_a_sites_own_traffic_stays_on_loopback(cfg_file: Path) -> None:
    """Two sites of two workers on separate network stacks: the site's rendezvous store (the
    launcher) and its in-site Gloo links listen on 127.0.0.1; only the round store and the round
    groups, which the other site dials, listen on --bind. Before, the site's own store and in-site
    links (unauthenticated, carrying pickles) listened on --bind too."""
    cfg_file.write_text(SITES.replace("workers: 1", "workers: 2").replace("steps: 80", "steps: 400"))
    out = cfg_file.parent / "run"
    out.mkdir()
    procs: list[subprocess.Popen[bytes]] = []
    seen: dict[str, dict[str, set[str]]] = {"A": {}, "B": {}}
    with _machines(3) as (spaces, addrs):
        lighthouse = f"{addrs[0]}:29510"
        try:
            procs.append(_start(spaces[0], ["lighthouse", "--bind", lighthouse, "--min-sites", "2"], out / "lh.log"))
            sites = {}
            for i, name in ((1, "A"), (2, "B")):
                args = ["site", "--config", str(cfg_file), "--site", name, "--lighthouse", lighthouse]
                sites[name] = _start(spaces[i], [*args, "--bind", addrs[i], "--out", str(out)], out / f"{name}.log")
                procs.append(sites[name])
            deadline = time.monotonic() + 150
            while _committed(out, "A") < 2 or _committed(out, "B") < 2:
                assert time.monotonic() < deadline and all(p.poll() is None for p in sites.values()), (out / "A.log").read_text()[
                    -3000:
                ]
                time.sleep(0.1)
            for name, p in sites.items():  # the launcher (ip netns exec's child), its zygote and ranks
                for pid in [p.pid, *(c for k in _children(p.pid) for c in [k, *_children(k)])]:
                    seen[name][str(pid)] = _listening(pid)
            for p in sites.values():
                assert p.wait(timeout=max(1.0, deadline - time.monotonic())) == 0
        finally:
            for p in procs:
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGKILL)
                p.wait()
    for (name, per_pid), bind in zip(seen.items(), addrs[1:], strict=True):
        everything = set().union(*per_pid.values())
        assert everything <= {"127.0.0.1", bind}, (name, per_pid)
        assert "127.0.0.1" in everything and bind in everything, (name, per_pid)  # in-site on loopback, rounds on --bind
        assert per_pid[str(sites[name].pid)] == {"127.0.0.1"}, (name, per_pid)  # the site's rendezvous store: loopback only
