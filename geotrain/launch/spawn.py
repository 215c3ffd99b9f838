"""Starting and stopping worker processes: the environment a rank gets, one process per rank
with its output copied to a log file, and a clean teardown.

Each rank runs :func:`geotrain.run.worker.main` (what ``python -m geotrain.run.worker`` runs)
with the torch.distributed environment a launcher like torchrun would give it, Gloo bound to the
loopback interface (MASTER_ADDR=127.0.0.1, GLOO_SOCKET_IFNAME=lo), in a session of its own. Ranks
are forked from the launcher's zygote (:mod:`geotrain.launch.zygote`), which imported torch and
the worker once; each is still a real process with its own PID, signals, exit status and output
pipe. Children get ``PR_SET_PDEATHSIG`` (they call :func:`geotrain.comm.procs.die_with_parent`
first thing): a rank dies with the zygote, and the zygote exits when the launcher's socket closes.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

from geotrain.comm.procs import name_process
from geotrain.comm.topology import Topology
from geotrain.errors import LaunchError
from geotrain.launch.zygote import MAX_MESSAGE, WORKER, send

GRACE_SECONDS = 3.0
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")  # NVIDIA, AMD (ROCm)
ZYGOTE_START_S = 300.0  # importing torch on a loaded machine; a bound all the same


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _pump(stream: IO[str], logfile: Path, forward: Callable[[str], None] | None) -> None:
    with stream, open(logfile, "w") as f:
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


def own_world_env(
    topo: Topology, wan_mode: str, site: int, incarnation: int, local: int, port: int, wan_key: str
) -> dict[str, str]:
    """A worker's environment when its site is its own torch.distributed world (local rank =
    rank; elastic mode, or a quorum-rounds site started again): the rendezvous at ``port``, the
    run's link state under ``wan_key``, and the site and incarnation the worker reads back
    (:func:`geotrain.run.worker.elastic_env`). Every site on this machine shares its cores."""
    env = rank_env(local, topo.workers[site], topo.world_size, port, wan_mode)
    env.update(GEOTRAIN_WAN_KEY=wan_key, GEOTRAIN_SITE_INDEX=str(site), GEOTRAIN_INCARNATION=str(incarnation))
    return env


class Rank(Protocol):
    """A running rank as the launchers see it: a :class:`subprocess.Popen` or a :class:`RankProcess`."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class RankProcess:
    """One rank forked by the zygote: the part of :class:`subprocess.Popen` the launchers use
    (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``). Exit codes follow Popen's: negative
    for a signal."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self._zygote = zygote
        self.pid = pid

    def poll(self) -> int | None:
        return self._zygote.exit_code(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        code = self._zygote.wait(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        self._zygote.signal(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _ForkedZygote:
    """A zygote forked from the launcher itself: the part of :class:`subprocess.Popen` that
    :class:`_Zygote` uses (its exit is awaited on a pidfd, not polled)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(pid)

    def _reaped(self, status: int) -> int:
        """Its exit code from the wait status, its pidfd closed."""
        self.returncode = os.waitstatus_to_exitcode(status)
        os.close(self._pidfd)
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._reaped(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None and timeout is not None and not select.select([self._pidfd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired("zygote", timeout)
        if self.returncode is None:  # it has exited (the pidfd is readable), or no bound was asked for
            return self._reaped(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def _fork_zygote(theirs: socket.socket, ours: socket.socket, preload: Sequence[str]) -> _ForkedZygote:
    """Fork this launcher into its zygote: the torch it imported is shared, not imported again
    (1.5-2 s of CPU a run). Only while the launcher has one thread, so the fork copies a quiet
    process, as the zygote's own forks do."""
    pid = os.fork()
    if pid == 0:
        try:
            from geotrain.launch import zygote

            name_process("geotrain-zygote")  # its command line is the launcher's
            ours.close()
            os.setsid()  # Ctrl-C reaches the launcher, which stops the ranks
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            os.environ.pop("GEOTRAIN_PARENT_PID", None)
            zygote.become(theirs, preload)
        except BaseException:  # noqa: BLE001 - its last word, on the launcher's stderr
            traceback.print_exc()
        finally:
            os._exit(1)  # become() never returns; after an exception the launcher sees the socket close
    return _ForkedZygote(pid)


class _Zygote:
    """The launcher's end of its zygote: spawn requests, signals, and a thread that records exits.
    ``fork``: fork this process (torch imported, one thread) instead of starting an interpreter."""

    def __init__(self, preload: Sequence[str] = (), fork: bool = False) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc: subprocess.Popen[bytes] | _ForkedZygote
        with theirs:
            if fork:
                self.proc = _fork_zygote(theirs, ours, preload)
            else:
                env = {k: v for k, v in os.environ.items() if k != "GEOTRAIN_PARENT_PID"}
                env.setdefault("OMP_NUM_THREADS", "1")  # OpenMP reads it once, when torch loads: as each rank had it
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "geotrain.launch.zygote", str(theirs.fileno()), *preload],
                    pass_fds=[theirs.fileno()],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # Ctrl-C reaches the launcher, which stops the ranks
                )
        self.sock = ours
        self._exits: dict[int, int] = {}
        self._replies: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._closed = False
        self._lock = threading.Lock()  # one spawn request at a time
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            with self._cond:
                if not data:
                    self._closed = True
                else:
                    message = json.loads(data)
                    if "exit" in message:
                        pid, code = message["exit"]
                        self._exits[pid] = code
                    else:
                        # a new rank: the kernel hands PIDs on again, so an exit recorded under its PID
                        # was an earlier rank's (the zygote's messages come in order: its own exit is later)
                        if "pid" in message:
                            self._exits.pop(int(message["pid"]), None)
                        self._replies.append(message)
                self._cond.notify_all()
            if not data:
                return

    def alive(self) -> bool:
        return not self._closed and self.proc.poll() is None

    def spawn(self, argv: list[str], env: dict[str, str], out_fd: int, netns: str | None) -> int:
        with self._lock:
            send(self.sock, {"spawn": {"argv": argv, "env": env, "netns": netns}}, [out_fd])
            with self._cond:
                if not self._cond.wait_for(lambda: self._replies or self._closed, ZYGOTE_START_S):
                    raise LaunchError(f"the zygote did not fork a rank within {ZYGOTE_START_S:.0f} s")
                if not self._replies:
                    raise LaunchError(f"the zygote (pid {self.proc.pid}) exited; its error is above")
                reply = self._replies.pop(0)
        if "error" in reply:
            raise LaunchError(f"could not start a rank: {reply['error']}")
        return int(reply["pid"])

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            if pid not in self._exits and self._closed:  # the zygote died: so did its ranks (PDEATHSIG)
                return -signal.SIGKILL
            return self._exits.get(pid)

    def wait(self, pid: int, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or self._closed, timeout)
        return self.exit_code(pid)

    def signal(self, pid: int, sig: int) -> None:
        if self.exit_code(pid) is None:
            with contextlib.suppress(OSError):
                send(self.sock, {"signal": [pid, int(sig)]})


_zygote: _Zygote | None = None
_zygote_lock = threading.Lock()


def _the_zygote(preload: Sequence[str] = (), fork: bool = False) -> _Zygote:
    """This process's zygote, started on first use and again if it has died (``preload``: modules
    it imports on top, when this call starts it; ``fork``: by forking this process)."""
    global _zygote
    with _zygote_lock:
        if _zygote is None or not _zygote.alive():
            _zygote = _Zygote(preload, fork)
        return _zygote


def stop_zygote(now: bool = False) -> None:
    """Stop this process's zygote (its ranks die with it); the next rank starts a new one.
    ``now``: SIGKILL it at once (a launcher that refused its config before starting any rank; the
    zygote would otherwise finish importing torch before it saw its socket close)."""
    global _zygote
    with _zygote_lock:
        z, _zygote = _zygote, None
    if z is None:
        return
    if now:
        z.proc.kill()
    with contextlib.suppress(OSError):
        z.sock.shutdown(socket.SHUT_RDWR)  # it exits when its socket closes; so does our reader
    try:
        z.proc.wait(timeout=GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        z.proc.kill()
        z.proc.wait()


def zygote_pid() -> int | None:
    """The PID of this process's zygote while it runs (for ``OUT/pids.json``)."""
    z = _zygote
    return z.proc.pid if z is not None and z.alive() else None


def _one_thread() -> bool:
    """Whether this process has one thread, as Python and the kernel count them (and has pidfds,
    to await a forked zygote's exit): then forking it copies a quiet process."""
    try:
        return threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1 and hasattr(os, "pidfd_open")
    except OSError:  # no /proc
        return False


def prestart_zygote(backend: str, preload: Sequence[str] = ()) -> None:
    """Start the zygote now, when this run's ranks will be forked whatever torch says (Gloo, or
    ``auto`` on a machine with no GPU device node), so that its imports overlap the launcher's own
    checks (``preload``: modules it imports on top, such as
    :data:`~geotrain.launch.zygote.HF_PRELOAD` for a Hugging Face model). A launcher that then
    refuses its config calls :func:`stop_zygote` with ``now=True``.

    A launcher that has one thread so far (the ``geotrain`` command, before its checks) imports
    torch, which its checks and stores need anyway, and forks itself into the zygote, which then
    imports only the worker and ``torch._dynamo``; otherwise the zygote is a fresh interpreter.
    In the environment, ``GEOTRAIN_ZYGOTE_EARLY=0`` turns this off (the zygote starts with the
    first rank) and ``GEOTRAIN_ZYGOTE_FORK=0`` makes the zygote a fresh interpreter
    (``benchmarks/launch_start.py`` measures the differences)."""
    if os.environ.get("GEOTRAIN_ZYGOTE_EARLY") == "0":
        return
    if backend == "gloo" or (backend == "auto" and not any(os.path.exists(d) for d in GPU_DEVICE_NODES)):
        fork = os.environ.get("GEOTRAIN_ZYGOTE_FORK") != "0" and _one_thread()
        if fork:
            os.environ.setdefault("OMP_NUM_THREADS", "1")  # OpenMP reads it once, when torch loads: as each rank had it
            import torch  # noqa: F401 - shared with the zygote from here on

        _the_zygote(preload, fork)


def forks_ranks(backend: str) -> bool:
    """Whether a run's ranks are forked from the zygote: yes unless they will use CUDA, which must
    not be set up in a process that forks, so those ranks start as fresh interpreters."""
    if backend != "auto":
        return backend == "gloo"
    import torch

    return not torch.cuda.is_available()  # here, in the launcher, which never forks


def spawn_rank(
    argv: list[str],
    env: dict[str, str],
    logfile: Path,
    forward: Callable[[str], None] | None,
    netns: str | None = None,
    fork: bool = True,
) -> tuple[Rank, threading.Thread]:
    """Start one worker (``argv``: its command-line arguments) in its own session, in network
    namespace ``netns`` if given: forked from the zygote, or with ``fork=False`` as a fresh
    ``python -m geotrain.run.worker``. A thread copies its output to ``logfile`` (and ``forward``)."""
    rank: Rank
    if fork:
        zygote = _the_zygote()
        read, write = os.pipe()
        try:
            rank = RankProcess(zygote, zygote.spawn(argv, env, write, netns))
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
        stream: IO[str] = os.fdopen(read, "r", buffering=1, errors="replace")
    else:
        cmd = [sys.executable, "-m", WORKER, *argv]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        popen = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True
        )
        assert popen.stdout is not None
        rank, stream = popen, popen.stdout
    t = threading.Thread(target=_pump, args=(stream, logfile, forward), daemon=True)
    t.start()
    return rank, t


def worker_args(cfg_path: Path, out: Path) -> list[str]:
    return ["--config", str(cfg_path), "--out", str(out)]


def stop_all(procs: Sequence[Rank]) -> None:
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
