"""The zygote: a process that imports torch and the worker once, then forks every rank from itself.

A fresh interpreter spends about 3 s of CPU importing torch, the worker and ``torch._dynamo``
(which every torch optimizer imports). A launcher that starts four ranks on a two-core machine
waited about 6 s for that before any rank could rendezvous. Forked from the zygote, a rank starts
at once and shares those pages with its siblings.

Run as ``python -m geotrain.launch.zygote FD [MODULE ...]`` (modules to import on top, such as
:data:`HF_PRELOAD`) by :mod:`geotrain.launch.spawn`, which holds the
other end of the Unix ``SOCK_SEQPACKET`` socket ``FD``; or, in the ``geotrain`` command, a fork of
the launcher that has imported torch calls :func:`become`. One message each way:

- launcher -> zygote: ``{"spawn": {"argv", "env", "netns"}}`` with the write end of the rank's
  output pipe attached (SCM_RIGHTS); ``{"signal": [pid, signum]}``.
- zygote -> launcher: ``{"pid": pid}`` for each spawn (or ``{"error": text}``); ``{"exit": [pid,
  code]}`` when a rank ends (code as :class:`subprocess.Popen` gives it: negative for a signal).

The zygote computes nothing and starts no threads, so forking it is safe. It signals only ranks it
has not yet reaped, so a signal never reaches a PID the kernel gave to another process. It exits
when the launcher's end of the socket closes, which the kernel does when the launcher dies,
however it dies; its ranks die with it (``PR_SET_PDEATHSIG``). The zygote itself does not use
``PR_SET_PDEATHSIG``: that fires when the *thread* that started it ends, and a launcher may start
it from a thread that ends long before the process (a run launched from a worker thread).

Why not :mod:`multiprocessing`'s forkserver: it re-imports the launcher's ``__main__`` in the
server or in every child. A user's script that calls :func:`geotrain.api.train` without an
``if __name__ == "__main__":`` guard would be run again.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from geotrain.comm.procs import enter_netns, leave, name_process

WORKER = "geotrain.run.worker"
# imported once for every rank: the worker (torch, torch.distributed, geotrain) and torch._dynamo,
# which the first optimizer step imports anyway
PRELOAD = (WORKER, "torch._dynamo")
# what model.kind=hf ranks import on top (about 1 s of CPU each): the launcher asks for it by name
HF_PRELOAD = ("transformers.modeling_utils",)
MAX_MESSAGE = 1 << 20  # a rank's environment and arguments


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def _reap(sock: socket.socket, live: set[int]) -> None:
    while live:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        live.discard(pid)
        send(sock, {"exit": [pid, os.waitstatus_to_exitcode(status)]})


def serve(sock: socket.socket) -> dict[str, Any] | None:
    """Answer the launcher until its socket closes (return None). In a forked rank, return its
    spawn request."""
    live: set[int] = set()
    me = os.getpid()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd does the work
    while True:
        ready, _, _ = select.select([sock.fileno(), wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(sock, live)
        if sock.fileno() not in ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
        if not data:
            return None
        message = json.loads(data)
        if "signal" in message:
            pid, signum = message["signal"]
            if pid in live:  # not reaped yet: still this rank, alive or a zombie
                os.kill(pid, signum)
            continue
        try:
            pid = os.fork()
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            send(sock, {"error": f"fork failed: {exc}"})
            continue
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_r, wake_w):
                os.close(fd)
            sock.close()
            request: dict[str, Any] = message["spawn"]
            request["out_fd"] = fds[0]
            # known before the fork: a child that asked getppid() would get 1 if we died first
            request["parent"] = me
            return request
        for fd in fds:
            os.close(fd)
        live.add(pid)
        send(sock, {"pid": pid})


def run_rank(request: dict[str, Any]) -> int:
    """In the forked child: a session of its own, output to the launcher's pipe, the rank's
    environment, then the worker's ``main`` as ``python -m geotrain.run.worker`` would run it."""
    os.setsid()
    name_process("geotrain-rank")
    out = request["out_fd"]
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]
    os.environ.clear()
    os.environ.update(request["env"], GEOTRAIN_PARENT_PID=str(request["parent"]))  # the zygote: die with it
    worker = importlib.import_module(WORKER)
    sys.argv = [str(worker.__file__), *request["argv"]]
    if request["netns"]:
        try:
            enter_netns(request["netns"])  # a single thread so far, as setns needs
        except Exception:  # noqa: BLE001 - the rank's last word, in its log
            traceback.print_exc()
            return 1
    return int(worker.run_main(request["argv"]))


def main() -> int:
    become(socket.socket(fileno=int(sys.argv[1])), sys.argv[2:])
    return 0  # not reached


def become(sock: socket.socket, extra: Sequence[str]) -> None:
    """Be the zygote on ``sock`` from here on, in a fresh interpreter (:func:`main`) or in a
    launcher's forked child (:func:`geotrain.launch.spawn.prestart_zygote`); never returns.
    ``extra``: modules to import on top of :data:`PRELOAD` (a missing one: the rank that needs it
    says so itself)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher handles Ctrl-C and stops the ranks
    for name in PRELOAD:
        importlib.import_module(name)
    for name in extra:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    request = serve(sock)
    if request is None:  # the launcher is gone: go at once (no interpreter teardown), and the ranks with us
        os._exit(0)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    leave(run_rank(request))  # success or failure, no teardown: see leave()


if __name__ == "__main__":
    sys.exit(main())
