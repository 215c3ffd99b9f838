"""Wide-area links emulated on one machine: the bytes a rank sends to another site take as long
as they would on the configured link.

In-process mode (``topology.links.emulate=inprocess``, no root needed):

* **Bandwidth, per link and shared.** Every directed site-to-site link has one "busy until"
  time kept in a small shared-memory file that all ranks of the run map (guarded by ``flock``).
  A rank sending ``n`` bytes across sites queues them on the link: they occupy it for
  ``8n / bandwidth`` seconds from when it is next free. All ranks of a site sending to the same
  site queue on the same link, so they share its capacity as flows on a real uplink do; another
  link (another destination site) runs in parallel. The pacing acts on each buffer actually
  handed to torch.distributed, at the moment it is sent.
* **Latency.** The sender tells the receiver when the last byte reaches the far end (end of
  its slot + one-way latency) in an 8-byte header; the receiver does not return the data before
  then. The sender does not wait (a socket send into a deep buffer), so latency delays delivery
  without occupying the link, and chunks in flight on several lanes keep the link busy across
  its latency, as TCP does with a window of the bandwidth-delay product.
* **Scheduled changes** (``topology.links.changes``): the file also holds the time the run's first
  rank mapped it; a send ``t`` seconds later uses the link as changed by then
  (:meth:`Topology.link_at`), e.g. a wide-area link 10x slower after a minute.
* The real bytes cross loopback at once, so loopback speed does not add to the emulated time
  as long as it is faster than the emulated link.

Kernel mode (``emulate=kernel``, :mod:`geotrain.comm.emulate.kernel`): each site runs in its own network
namespace and ``tc`` limits the bandwidth of the inter-site paths; only latency is added here
(this kernel has no ``netem``): the receiver holds data for one latency after it arrived.

Intra-site links are not emulated: ranks of a site talk at loopback speed. Headers are control
bytes of the emulation, not counted as payload.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from geotrain.comm.topology import Topology
from geotrain.config import LinkConfig
from geotrain.errors import LaunchError


def state_path(run_key: str) -> Path:
    """The shared link-state file of one run (``run_key``: e.g. the rendezvous port)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"geotrain-wan-{run_key}"


def _open_own(path: Path) -> int:
    """Open (creating, mode 0600) the run's link-state file, refusing one this user did not make.

    Its name is predictable and ``/dev/shm`` is writable by everyone, so another user could plant
    a file or a symlink there first, to read or steer this run's emulated links or to make it
    write through a link elsewhere. ``O_NOFOLLOW`` refuses a symlink; then the file must be a
    regular file of this user, with one name, that nobody else may read or write. Every rank of
    the run opens the same file, so ``O_EXCL`` cannot be used.

    Raises:
        LaunchError: naming the file and what is wrong with it.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise LaunchError(f"{path}: cannot open the run's link-state file ({exc.strerror}); a symlink there is refused") from None
    st = os.fstat(fd)
    why = (
        "not a regular file"
        if not stat.S_ISREG(st.st_mode)
        else f"owned by uid {st.st_uid}, not {os.geteuid()}"
        if st.st_uid != os.geteuid()
        else f"{st.st_nlink} names (a hard link)"
        if st.st_nlink != 1
        else f"mode {stat.S_IMODE(st.st_mode):o}, open to other users"
        if st.st_mode & 0o077
        else None
    )
    if why is not None:
        os.close(fd)
        raise LaunchError(f"{path}: the run's link-state file is {why}: refused (remove it if it is stale)")
    return fd


class SharedLinks:
    """``busy_until`` (CLOCK_MONOTONIC seconds) of every directed site pair, shared by all
    processes of a run through an mmap'd file; a thread lock plus ``flock`` make each
    reservation atomic across threads and processes."""

    def __init__(self, path: Path, num_sites: int) -> None:
        self.path = path
        self.n = num_sites
        self._t0_off = 8 * num_sites * num_sites  # after the busy times: when the run's emulation started
        size = self._t0_off + 8
        self._fd = _open_own(path)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            if os.fstat(self._fd).st_size < size:
                os.ftruncate(self._fd, size)
            self._mm = mmap.mmap(self._fd, size)
            (t0,) = struct.unpack_from("d", self._mm, self._t0_off)
            if t0 == 0:  # the first rank of the run to get here starts the clock of scheduled link changes
                struct.pack_into("d", self._mm, self._t0_off, time.monotonic())
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._lock = threading.Lock()

    @property
    def t0(self) -> float:
        """CLOCK_MONOTONIC time the run's link emulation started (shared by every rank of the run)."""
        return float(struct.unpack_from("d", self._mm, self._t0_off)[0])

    def reserve(self, src: int, dst: int, seconds: float, earliest: float) -> float:
        """Occupy link ``src -> dst`` for ``seconds`` from ``max(earliest, busy_until)``; the end time."""
        off = 8 * (src * self.n + dst)
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                (busy,) = struct.unpack_from("d", self._mm, off)
                end = max(earliest, busy) + seconds
                struct.pack_into("d", self._mm, off, end)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        return end

    def close(self, unlink: bool = False) -> None:
        self._mm.close()
        os.close(self._fd)
        if unlink:
            self.path.unlink(missing_ok=True)


class WanEmulator:
    """The link emulation seen by one rank (mode 'inprocess' or 'kernel')."""

    def __init__(self, topology: Topology, my_site: int, run_key: str, mode: str) -> None:
        if mode not in ("inprocess", "kernel"):
            raise ValueError(f"emulation mode must be 'inprocess' or 'kernel', not {mode!r}")
        self.topology = topology
        self.site = my_site
        self.mode = mode
        self.links = SharedLinks(state_path(run_key), topology.num_sites) if mode == "inprocess" else None

    @property
    def paces_bandwidth(self) -> bool:
        return self.links is not None

    def link(self, other_site: int) -> LinkConfig:
        """The link to ``other_site`` now, with the scheduled changes that have happened."""
        if self.links is None or not self.topology.changes:
            return self.topology.link(self.site, other_site)
        return self.topology.link_at(self.site, other_site, time.monotonic() - self.links.t0)

    def latency(self, other_site: int) -> float:
        return self.link(other_site).latency_s

    def pace(self, sends: Sequence[tuple[int, int]]) -> list[float]:
        """Queue ``sends`` = [(destination site, bytes)] on their links; each send's arrival time.

        A send occupies its link for ``8·bytes / bandwidth`` from when the link is next free (a FIFO
        shared by every rank of the site), and arrives one latency after its last byte left. The
        sender does not sleep: like a socket send into a deep buffer it returns at once, and the
        receiver holds the data until its arrival time, so several chunks in flight keep a link
        busy across its latency.
        """
        assert self.links is not None
        now = time.monotonic()
        out = []
        for dst, nbytes in sends:
            link = self.link(dst)
            end = self.links.reserve(self.site, dst, nbytes * 8 / link.bandwidth_bps, now)
            out.append(end + link.latency_s)
        return out

    @staticmethod
    def hold_until(t: float) -> None:
        """Sleep until CLOCK_MONOTONIC time ``t`` (delivery of delayed data)."""
        delay = t - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def close(self, unlink: bool = False) -> None:
        if self.links is not None:
            self.links.close(unlink)
