"""Kernel link emulation: namespaces, tc shaping, clean-up after crashes, and training inside it.
Needs root and iproute2; skipped cleanly otherwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from geotrain.comm.emulate import kernel as netns
from geotrain.config import load_config
from geotrain.launch.local import launch_local
from tests.helpers import REPO, TINY, kernel_links_unavailable, uniform_topology

_WHY = kernel_links_unavailable()
needs_root = pytest.mark.skipif(_WHY is not None, reason=f"kernel emulation unavailable: {_WHY}")


def _ours(run_id: int) -> list[str]:
    return [n for n in netns.list_namespaces() if n.startswith(f"{netns.PREFIX}{run_id}-")]


@needs_root
@pytest.mark.timeout(60)
def test_setup_shapes_each_destination_and_teardown_is_idempotent() -> None:
    topo = uniform_topology(3, 1)
    k = netns.KernelLinks(topo)
    with k:
        assert sorted(_ours(k.run_id)) == sorted([k.router, *k.namespaces])
        classes = subprocess.run(
            ["tc", "-n", k.namespaces[0], "class", "show", "dev", "eth0"], capture_output=True, text=True
        ).stdout
        assert "1:11" in classes and "1:12" in classes and "rate 1Gbit" in classes
        k.up()  # idempotent: rebuilt, not duplicated
        assert sorted(_ours(k.run_id)) == sorted([k.router, *k.namespaces])
    assert _ours(k.run_id) == []
    k.down()  # again: nothing to do, no error


@needs_root
@pytest.mark.timeout(60)
def test_sigkilled_owner_leaves_nothing_behind() -> None:
    code = (
        "import time; from geotrain.comm.emulate.kernel import KernelLinks; from tests.helpers import uniform_topology; "
        "k = KernelLinks(uniform_topology(2, 1)).up(); print('up', flush=True); time.sleep(60)"
    )
    p = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "up"
        assert len(_ours(p.pid)) == 3
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        deadline = time.monotonic() + 10
        while _ours(p.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _ours(p.pid) == []  # the watchdog removed them
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        netns.KernelLinks(uniform_topology(2, 1), run_id=p.pid).down()


@needs_root
@pytest.mark.timeout(60)
def test_stale_namespaces_of_dead_runs_are_removed() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{netns.PREFIX}{dead.pid}-s0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in netns.cleanup_stale()
        assert name not in netns.list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.mark.slow
@needs_root
@pytest.mark.timeout(300)
def test_training_in_kernel_mode(tmp_path: Path) -> None:
    cfg = load_config(
        None, [*TINY, "train.steps=6", "sync.H=3", "topology.links.emulate=kernel", "topology.links.inter.bandwidth_bps=1e8"]
    )
    s = launch_local(cfg, tmp_path / "k", console_print=None)
    assert s["link_emulation"] == "kernel"
    assert len(set(s["global_param_hash"].values())) == 1 and s["inter_site_bytes"] > 0
    assert [n for n in netns.list_namespaces() if n.startswith(f"{netns.PREFIX}{os.getpid()}-")] == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kernel_mode_falls_back_with_a_notice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(netns, "unavailable", lambda: "not running as root")
    cfg = load_config(None, [*TINY, "train.steps=4", "sync.H=2", "topology.links.emulate=kernel"])
    s = launch_local(cfg, tmp_path / "f", console_print=None)
    assert s["link_emulation"] == "inprocess"
    err = capsys.readouterr().err
    assert "kernel link emulation unavailable (not running as root); using in-process emulation" in err
