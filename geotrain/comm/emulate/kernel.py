"""Kernel link emulation: one network namespace per site, joined through a bridge, with ``tc``
bandwidth limits on the inter-site paths.

Layout for a run (``ID`` = the launcher's PID, so names are unique per run and a dead run's
leftovers are recognisable)::

    gtw{ID}-br   router namespace: bridge br0 with one veth end p{i} per site
    gtw{ID}-s{i} site i: lo, and eth0 = 10.77.0.{i+1}/24 (the other veth end)

On each site's eth0, an HTB root qdisc has one class per other site j, limited to the
bandwidth of link (i, j) and selected by a u32 filter on j's address; everything else (the
site's own traffic never leaves lo) goes to an unlimited default class. Ranks of a site share
eth0, so they share each link's capacity as on a real uplink. This kernel has no ``netem``,
so latency is added in-process (:mod:`geotrain.comm.emulate.inprocess`, mode 'kernel').

Set-up and tear-down are idempotent. A launcher killed outright (SIGKILL) cannot clean up, so
set-up also starts a small watchdog process (its own session) that deletes the run's namespaces
as soon as the launcher is gone; and :func:`cleanup_stale`, run before every set-up, deletes
those of any run whose launcher is dead. Deleting a namespace removes its veth ends, qdiscs and
filters with it.
Needs root and iproute2 (``ip``, ``tc``); :func:`unavailable` says why not, for the one-line
fallback notice.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from types import TracebackType

from geotrain.comm.topology import Topology

PREFIX = "gtw"
IFNAME = "eth0"
_NAME = re.compile(rf"^{PREFIX}(\d+)-")
_WATCHDOG = """
import os, subprocess, sys, time
parent = int(sys.argv[1])
while os.getppid() == parent:
    time.sleep(0.5)
for name in sys.argv[2:]:
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, check=check, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why kernel emulation cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "not running as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) not found"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _ip("ip", "netns", "add", probe)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        detail = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        return f"cannot create a network namespace ({detail})"
    finally:
        _ip("ip", "netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> list[str]:
    """geotrain's namespaces that exist now."""
    out = _ip("ip", "netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if _NAME.match(n)]


def cleanup_stale() -> list[str]:
    """Delete the namespaces of runs whose launcher process is gone; the names deleted."""
    gone = []
    for name in list_namespaces():
        m = _NAME.match(name)
        assert m is not None
        if not _alive(int(m.group(1))):
            _ip("ip", "netns", "del", name, check=False)
            gone.append(name)
    return gone


class KernelLinks:
    """The namespaces, veth pairs and tc rules of one run (a context manager)."""

    def __init__(self, topology: Topology, run_id: int | None = None) -> None:
        self.topology = topology
        self.run_id = os.getpid() if run_id is None else run_id
        self.router = f"{PREFIX}{self.run_id}-br"
        self.namespaces = [f"{PREFIX}{self.run_id}-s{i}" for i in range(topology.num_sites)]
        self._watchdog: subprocess.Popen[bytes] | None = None
        if topology.num_sites > 250:
            raise ValueError("kernel link emulation supports at most 250 sites")

    @staticmethod
    def address(site: int) -> str:
        return f"10.77.0.{site + 1}"

    def up(self) -> KernelLinks:
        """Create everything (after removing stale runs' leftovers); on any failure tear down and raise."""
        cleanup_stale()
        self.down()
        try:
            self._create()
            self._watchdog = subprocess.Popen(
                [sys.executable, "-c", _WATCHDOG, str(os.getpid()), self.router, *self.namespaces], start_new_session=True
            )
        except BaseException:
            self.down()
            raise
        return self

    def _create(self) -> None:
        r = self.router
        _ip("ip", "netns", "add", r)
        _ip("ip", "-n", r, "link", "set", "lo", "up")
        _ip("ip", "-n", r, "link", "add", "br0", "type", "bridge")
        _ip("ip", "-n", r, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            _ip("ip", "netns", "add", ns)
            _ip("ip", "-n", ns, "link", "set", "lo", "up")
            _ip("ip", "-n", r, "link", "add", f"p{i}", "type", "veth", "peer", "name", IFNAME, "netns", ns)
            _ip("ip", "-n", r, "link", "set", f"p{i}", "master", "br0")
            _ip("ip", "-n", r, "link", "set", f"p{i}", "up")
            _ip("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", IFNAME)
            _ip("ip", "-n", ns, "link", "set", IFNAME, "up")
            self._shape(i, ns)

    def _shape(self, i: int, ns: str) -> None:
        dev = ("dev", IFNAME)
        _ip("tc", "-n", ns, "qdisc", "add", *dev, "root", "handle", "1:", "htb", "default", "999")
        _ip("tc", "-n", ns, "class", "add", *dev, "parent", "1:", "classid", "1:999", "htb", "rate", "100gbit")
        for j in range(self.topology.num_sites):
            if j == i:
                continue
            rate = int(self.topology.link(i, j).bandwidth_bps)
            burst = max(32 << 10, rate // 8 // 500)  # about 2 ms of data, at least a few segments
            cls = f"1:{10 + j}"
            _ip(
                "tc", "-n", ns, "class", "add", *dev, "parent", "1:", "classid", cls, "htb",
                "rate", f"{rate}bit", "ceil", f"{rate}bit", "burst", str(burst), "cburst", str(burst),
            )  # fmt: skip
            _ip(
                "tc", "-n", ns, "filter", "add", *dev, "parent", "1:", "protocol", "ip", "prio", "1",
                "u32", "match", "ip", "dst", f"{self.address(j)}/32", "flowid", cls,
            )  # fmt: skip

    def down(self) -> None:
        """Delete this run's namespaces (and with them veths, qdiscs, filters); idempotent."""
        if self._watchdog is not None:
            with contextlib.suppress(ProcessLookupError):
                self._watchdog.send_signal(signal.SIGKILL)
            self._watchdog.wait()
            self._watchdog = None
        for ns in [*self.namespaces, self.router]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                _ip("ip", "netns", "del", ns, check=False)

    def __enter__(self) -> KernelLinks:
        return self.up()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.down()
