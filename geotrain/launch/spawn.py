"""Starting and stopping worker processes: the environment a rank gets, one process per rank
with its output copied to a log file, and a clean teardown.

Each rank is ``python -m geotrain.run.worker`` with the torch.distributed environment a launcher
like torchrun would give it, Gloo bound to the loopback interface (MASTER_ADDR=127.0.0.1,
GLOO_SOCKET_IFNAME=lo). Children get ``PR_SET_PDEATHSIG`` (they call
:func:`geotrain.comm.procs.die_with_parent` first thing), so they die if the launcher is killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

GRACE_SECONDS = 3.0


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _pump(stream: IO[str], logfile: Path, forward: Callable[[str], None] | None) -> None:
    with open(logfile, "w") as f:
        for line in stream:
            f.write(line)
            f.flush()
            if forward is not None:
                forward(line.rstrip("\n"))


def rank_env(rank: int, world: int, local_world: int, port: int, wan_mode: str) -> dict[str, str]:
    """The environment of one worker process: ours, minus an outer torchrun's, plus the
    torch.distributed rendezvous on 127.0.0.1 and geotrain's own settings."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "GROUP_RANK"))}
    return {
        **base,
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(local_world),  # ranks sharing this machine: sets threads per rank
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": os.environ.get("GEOTRAIN_GLOO_IFNAME", "lo"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONUNBUFFERED": "1",
        "GEOTRAIN_PARENT_PID": str(os.getpid()),
        "GEOTRAIN_WAN_MODE": wan_mode,
    }


def spawn_rank(
    cmd: list[str], env: dict[str, str], logfile: Path, forward: Callable[[str], None] | None
) -> tuple[subprocess.Popen[str], threading.Thread]:
    """Start one worker in its own session; a thread copies its output to ``logfile`` (and ``forward``)."""
    p = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True
    )
    assert p.stdout is not None
    t = threading.Thread(target=_pump, args=(p.stdout, logfile, forward), daemon=True)
    t.start()
    return p, t


def worker_cmd(cfg_path: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "geotrain.run.worker", "--config", str(cfg_path), "--out", str(out)]


def stop_all(procs: list[subprocess.Popen[str]]) -> None:
    """SIGTERM every live rank, SIGKILL what is left after the grace period, reap all."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
