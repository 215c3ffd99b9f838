"""Ranks as processes: free ports, network namespaces, dying with the parent, and running a
Python function as every rank of a small job (real processes, real Gloo groups).

Used by the benchmarks and the tests. Each rank is a spawned process with the torch.distributed
environment on 127.0.0.1 (or, in kernel link-emulation mode, on its site's namespace address:
the child enters its network namespace first thing, before torch is imported, so every socket
it opens lives there). Nothing here imports torch at module level, for that reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

CLONE_NEWNET = 0x40000000


def free_port() -> int:
    """A port free now (it may be taken before it is used: prefer :func:`host_store`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def host_store(host: str = "127.0.0.1", timeout_s: float = 300.0, attempt: int = 0) -> tuple[Any, dict[str, str]]:
    """A torch.distributed rendezvous store hosted by this (launching) process on ``host`` at a
    port the kernel picks: nothing is checked, closed and bound again later, so no other process
    can take the port in between. Returns the store (keep it alive while the ranks run; its port
    is ``store.port``) and the environment that makes the ranks join it as clients instead of
    hosting one (torchrun's agent-store protocol)."""
    store = listening_store(host, timeout_s)
    return store, {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": str(attempt)}


def listening_socket(host: str, backlog: int) -> socket.socket:
    """A TCP socket listening on ``host`` only (IPv4 or IPv6), at a port the kernel picks."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def listening_store(host: str, timeout_s: float) -> Any:
    """A ``TCPStore`` server listening on ``host`` only, at a port the kernel picks.

    ``TCPStore(host, port, is_master=True)`` listens on every interface whatever ``host`` says
    (``host`` is only what clients dial). So the listening socket is made here, bound to ``host``,
    and handed to the store (``master_listen_fd``), which then owns it.
    """
    from datetime import timedelta

    import torch.distributed as dist

    sock = listening_socket(host, 512)
    try:
        port = sock.getsockname()[1]
        store = dist.TCPStore(
            host,
            port,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store closes it
    return store


def name_process(name: str) -> None:
    """Set the name ``ps``, ``top`` and ``/proc/PID/comm`` show for this process (at most 15
    bytes): a process forked from another keeps that one's command line."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def die_with_parent() -> None:
    """Called first thing in a worker started by this launcher (GEOTRAIN_PARENT_PID set): ask the
    kernel to SIGKILL this process when the launcher dies, and exit if it already has."""
    parent = os.environ.get("GEOTRAIN_PARENT_PID")
    if not parent:
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != int(parent):  # the launcher died before prctl took effect
        os._exit(1)


def host_ranks() -> int:
    """How many geotrain ranks run on this machine now (a rank counts itself), whatever started
    them: processes running ``geotrain.run.worker`` (torchrun, fresh interpreters) and ranks
    forked by a zygote (a ``geotrain.launch.zygote`` process whose parent is one too). Read from
    ``/proc``; 0 where it cannot be read."""
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return 0
    cmd: dict[int, bytes] = {}
    parent: dict[int, int] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd[pid] = f.read()
            with open(f"/proc/{pid}/stat", "rb") as f:
                parent[pid] = int(f.read().rsplit(b") ", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue

    def runs(argv: list[bytes], module: str) -> bool:  # python [-u] -m MODULE ..., or python .../MODULE/PATH.py ...
        path = module.replace(".", "/").encode() + b".py"
        return any(a == b"-m" and b == module.encode() for a, b in zip(argv, argv[1:], strict=False)) or any(
            a.endswith(path) for a in argv[1:2]
        )

    argvs = {pid: c.split(b"\0") for pid, c in cmd.items()}
    zygotes = {pid for pid, argv in argvs.items() if runs(argv, "geotrain.launch.zygote")}
    return sum(
        1 for pid, argv in argvs.items() if runs(argv, "geotrain.run.worker") or parent.get(pid) in zygotes and pid in zygotes
    )


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def rank_threads(requested: int) -> int:
    """Threads per rank: as configured, else this machine's cores divided among the geotrain ranks
    on it: the ranks of this process's world here (``LOCAL_WORLD_SIZE``) or, if more, every
    geotrain rank running on the machine now (several ``geotrain site`` commands rehearsed on one
    machine each see only their own site's ranks; together they oversubscribed its cores, and a
    starved site missed its heartbeats)."""
    if requested:
        return requested
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, _cores() // max(1, local_world, host_ranks()))


def oversubscribed() -> str | None:
    """A hint when this machine's run queue exceeds its cores (1-minute load average), else None."""
    cores = _cores()
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None
    if load <= 1.5 * cores:
        return None
    return (
        f"this machine's load is {load:.1f} on {cores} core(s), with {host_ranks()} geotrain rank(s) on it: "
        "ranks starve each other (set train.threads to cores / ranks on the machine; docs/ELASTIC.md)"
    )


def leave(code: int) -> None:
    """End this worker process now with ``code``, without the interpreter's teardown: flush the
    standard streams, then ``os._exit``.

    The teardown joins every non-daemon thread and runs every finalizer; after a failure a thread
    may be blocked on a dead, hung or slow peer (the whole collective timeout), and after a
    success it only copies pages inherited from the zygote (about 2 s of CPU per rank). The worker
    has closed its own files, metrics and threads on every path before it gets here.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def enter_netns(name: str) -> None:
    """Move the calling (single-threaded) process into network namespace ``name`` (needs root)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _entry(rank: int, env: dict[str, str], netns: str | None, fn: Callable[..., Any], args: tuple[Any, ...], queue: Any) -> None:
    try:
        if netns:
            enter_netns(netns)
        os.environ.clear()  # the caller's environment when it called run_ranks, not the server's
        os.environ.update(env)
        import torch

        torch.set_num_threads(1)
        queue.put((rank, fn(rank, *args), None))
    except Exception:  # report to the parent instead of hanging it
        queue.put((rank, None, traceback.format_exc()))
        sys.exit(1)


# "__main__": the caller's script is imported once, in the server (as with "spawn", it needs an
# ``if __name__ == "__main__":`` guard), so the children need not import it again
RANKS_PRELOAD = ["__main__", "torch", "torch.distributed", "geotrain.comm.session"]


def run_ranks(
    world: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 120,
    netns: Sequence[str | None] | None = None,
    addrs: Sequence[str] | None = None,
    ifname: Sequence[str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``world`` processes forked from multiprocessing's forkserver,
    which imported torch once; return the results by rank.

    ``netns``/``addrs``/``ifname`` (per rank) put rank r in a network namespace, rendezvous at
    ``addrs[0]`` and bind Gloo to ``ifname[r]``; by default everything is on loopback.
    Every child is joined (killed if it hangs) before this returns or raises.
    """
    import multiprocessing

    # forked from a server that imported torch once (not a fresh interpreter per rank, 1-2 s of
    # CPU each); it computes nothing and starts no thread, so forking it is safe
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(RANKS_PRELOAD)
    queue = ctx.Queue()
    store, agent = (None, {}) if addrs else host_store()  # namespaces: the rendezvous lives in one of them
    port = store.port if store is not None else free_port()
    procs = []
    for r in range(world):
        env = {
            **os.environ,
            "RANK": str(r),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": addrs[0] if addrs else "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": ifname[r] if ifname else "lo",
            "LOCAL_WORLD_SIZE": str(world),
            **agent,
        }
        ns = netns[r] if netns else None
        procs.append(ctx.Process(target=_entry, args=(r, env, ns, fn, args, queue)))
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, value, err = queue.get(timeout=timeout)
            if err:
                raise RuntimeError(f"rank {rank} failed:\n{err}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.join()
    return [results[r] for r in range(world)]
