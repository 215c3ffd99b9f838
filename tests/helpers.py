"""Shared helpers for multi-process tests: real Gloo process groups on 127.0.0.1."""

from __future__ import annotations

import _thread
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from geotrain.comm.procs import run_ranks
from geotrain.comm.topology import Topology
from geotrain.config import TopologyConfig

__all__ = [
    "FOUR_SITES",
    "REPO",
    "PLAIN_SGD",
    "TINY",
    "drawn",
    "kernel_links_unavailable",
    "lines",
    "png_size",
    "read_summary",
    "run_ranks",
    "sum_mismatch",
    "train_args",
    "train_cli",
    "uniform_topology",
]

REPO = Path(__file__).resolve().parent.parent

# a model small enough for end-to-end runs in tests
TINY = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=16",
    "train.batch_size=4",
    "train.eval_batches=4",
    "train.log_every=1000",
    "optim.warmup_steps=0",
    # no loss.png and no report.html (matplotlib's 3 s of CPU a run): tests/test_report.py and
    # tests/test_cli_train.py turn them on
    "report.plot=false",
    "report.html=false",
]


# plain SGD without momentum, decay, warm-up or clipping: runs that must equal DDP exactly
PLAIN_SGD = [
    "optim.name=sgd",
    "optim.momentum=0.0",
    "optim.weight_decay=0.0",
    "optim.lr=0.05",
    "optim.schedule=constant",
    "optim.grad_clip=0",
]


FOUR_SITES = "topology:\n  sites: [{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}, {name: D, workers: 1}]\n"


def train_args(out: Path, overrides: list[str], topology: str | None = None) -> list[str]:
    """The ``geotrain train`` command line: TINY, no baseline, then ``overrides``; ``topology`` is
    YAML written beside ``out`` and passed as ``--config``."""
    args = [sys.executable, "-m", "geotrain", "train", "--out", str(out), "--set", "run.baseline=none"]
    if topology:
        cfg = out.parent / f"{out.name}.yaml"
        cfg.write_text(topology)
        args += ["--config", str(cfg)]
    for o in [*TINY, *overrides]:
        args += ["--set", o]
    return args


# GEOTRAIN_TEST_SUBPROCESS=1: train_cli runs every ``geotrain train`` as a process of its own
IN_PROCESS = os.environ.get("GEOTRAIN_TEST_SUBPROCESS") != "1"


def train_cli(
    out: Path, overrides: list[str], topology: str | None = None, expect_rc: int = 0, timeout: float = 220
) -> subprocess.CompletedProcess[str]:
    """``geotrain train`` with :func:`train_args`' command line; asserts the exit code.

    By default the command runs in this test process (:func:`_in_process`): its ranks, Lighthouse
    and sites are still processes of their own, forked from this process's zygote, which is
    started once and kept, as :mod:`geotrain.api` keeps it. That spares each run the launcher's
    import of torch and the zygote's of the worker and ``torch._dynamo``, about 4 s of CPU of the
    6.75 s that a tiny 2x2 run of the command costs (``benchmarks/results/launch_start.json``).
    The tests of the command's own process (``tests/test_cli_train.py``, ``test_launch.py``, the
    killed launcher) start it as a process, and so does every run here with
    GEOTRAIN_TEST_SUBPROCESS=1."""
    args = train_args(out, overrides, topology)
    proc = _in_process(args, timeout) if IN_PROCESS else _subprocess(args, out, timeout)
    assert proc.returncode == expect_rc, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _subprocess(args: list[str], out: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``args`` as a process of its own; past ``timeout`` stop every process it started and show
    where it stood."""
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_run(out, p)
            stdout, stderr = p.communicate()
            logs = "".join(f"\n--- {f.name}\n" + f.read_text()[-1500:] for f in sorted((out / "logs").glob("*.log")))
            raise AssertionError(f"timed out after {timeout}s:\n{stdout[-4000:]}{stderr[-2000:]}{logs}") from None
    return subprocess.CompletedProcess(args, p.returncode, stdout, stderr)


def _in_process(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``args`` (``python -m geotrain ...``) as the ``geotrain`` command would, in this process:
    its output captured, its exit code returned, and this process's environment restored after
    (an elastic launcher puts the run's secret there for its sites). Past ``timeout`` the run is
    interrupted as by Ctrl-C: the launcher stops every process it started and exits 130."""
    from typer.main import get_command

    from geotrain.cli import app

    env = dict(os.environ)
    stdout, stderr = io.StringIO(), io.StringIO()
    fired = threading.Event()

    def interrupt() -> None:
        fired.set()
        _thread.interrupt_main()

    timer = threading.Timer(timeout, interrupt)
    timer.start()
    code: Any = 0
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = get_command(app).main(args=args[3:], prog_name="geotrain", standalone_mode=False)
            except SystemExit as exc:
                code = exc.code
    except KeyboardInterrupt:
        if not fired.is_set():
            raise
    finally:
        timer.cancel()
        os.environ.clear()
        os.environ.update(env)
    if fired.is_set():
        raise AssertionError(f"timed out after {timeout}s:\n{stdout.getvalue()[-4000:]}{stderr.getvalue()[-2000:]}")
    return subprocess.CompletedProcess(args, code or 0, stdout.getvalue(), stderr.getvalue())


def _kill_run(out: Path, launcher: subprocess.Popen[str]) -> None:
    """SIGKILL a timed-out run's launcher and, by PID (``OUT/pids.json``), its ranks, zygote and
    Lighthouse, which run in sessions of their own."""
    launcher.kill()
    pids_file = out / "pids.json"
    pids = json.loads(pids_file.read_text()) if pids_file.exists() else {}
    for pid in [*pids.get("ranks", []), pids.get("zygote"), pids.get("lighthouse")]:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def read_summary(out: Path) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def uniform_topology(sites: int, workers: int) -> Topology:
    """``sites`` sites named s0, s1, ... with ``workers`` ranks each."""
    cfg = TopologyConfig.model_validate({"sites": [{"name": f"s{i}", "workers": workers} for i in range(sites)]})
    return Topology.from_config(cfg)


def sum_mismatch(comm: Any, how: str, n: int, dtype: Any, seed: int) -> tuple[str, int, str, float] | None:
    """Sum ``randn(n)`` (seeded) with ``comm`` — 'hierarchical', 'flat', 'intra' (site) or 'across'
    (sites, input identical within a site) — and with ``dist.all_reduce`` on the matching group;
    ``(how, n, dtype, max error)`` if they differ, else None."""
    import torch
    import torch.distributed as dist

    g = comm.groups
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    ref = x.clone()
    if how == "intra":
        dist.all_reduce(ref, group=g.intra)
        comm.all_reduce_intra(x)
    elif how == "across":
        dist.all_reduce(ref, group=g.inter)
        comm.all_reduce_across_sites(x)
    else:
        dist.all_reduce(ref)
        comm.all_reduce(x, how)
    if torch.allclose(x, ref, rtol=1e-5, atol=1e-5):
        return None
    return (how, n, str(dtype), float((x - ref).abs().max()))


@contextlib.contextmanager
def drawn() -> Any:
    """The matplotlib figures saved inside the block, so a test can read what a plot drew (its
    axes' lines and bars) instead of the size of its PNG."""
    from matplotlib.figure import Figure

    figures: list[Any] = []
    real = Figure.savefig

    def keep(self: Any, *args: Any, **kwargs: Any) -> Any:
        figures.append(self)
        return real(self, *args, **kwargs)

    Figure.savefig = keep  # type: ignore[method-assign]
    try:
        yield figures
    finally:
        Figure.savefig = real  # type: ignore[method-assign]


def lines(ax: Any) -> dict[str, tuple[list[float], list[float]]]:
    """An axes' lines by label: (x data, y data)."""
    return {ln.get_label(): ([float(v) for v in ln.get_xdata()], [float(v) for v in ln.get_ydata()]) for ln in ax.get_lines()}


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's header; raises if ``path`` is not a PNG."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path}: not a PNG"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def kernel_links_unavailable() -> str | None:
    """Why the kernel-link tests cannot run here (root and iproute2 are needed), or None.

    They skip where that is so, except when ``GEOTRAIN_REQUIRE_KERNEL_LINKS=1`` (``.ci/run`` sets
    it on a machine that has both): then a missing one is an error, not a quiet skip.
    """
    from geotrain.comm.emulate import kernel

    why = kernel.unavailable()
    if why is not None and os.environ.get("GEOTRAIN_REQUIRE_KERNEL_LINKS") == "1":
        raise RuntimeError(f"GEOTRAIN_REQUIRE_KERNEL_LINKS=1 but kernel link emulation is unavailable: {why}")
    return why
