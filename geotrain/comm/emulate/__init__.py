"""Wide-area links emulated on one machine, so every claim about slow links is measured.

- :mod:`.inprocess`: pacing and delay inside geotrain (a shared FIFO per directed site pair,
  delivery-time headers for latency); no root needed. The default.
- :mod:`.kernel`: a network namespace per site behind a bridge, ``tc`` HTB limits per
  destination site; latency still in-process (no ``netem`` here). Needs root and iproute2.

:func:`link_mode` says which mode a rank can use, :func:`link_emulator` gives it the emulator
of that mode, :func:`describe_links` the line the run log prints.
"""

from __future__ import annotations

import os

from geotrain.comm.emulate.inprocess import WanEmulator
from geotrain.comm.topology import Topology


def link_mode(requested: str) -> tuple[str, str | None]:
    """The mode this rank emulates links in, and a notice when it differs from ``requested``.

    geotrain's launcher states the mode it set up in GEOTRAIN_WAN_MODE (kernel mode needs the
    namespaces it creates); without it, kernel mode falls back to in-process pacing."""
    mode = os.environ.get("GEOTRAIN_WAN_MODE", requested)
    if mode == "kernel" and "GEOTRAIN_WAN_MODE" not in os.environ:
        return "inprocess", "kernel link emulation needs geotrain's launcher (network namespaces); using in-process emulation"
    return mode, None


def link_emulator(topo: Topology, site_index: int, mode: str, run_key: str) -> WanEmulator | None:
    """The emulation one rank of site ``site_index`` uses in ``mode`` ('off', 'inprocess' or
    'kernel'; the kernel's namespaces must already be up); None when nothing is emulated.
    ``run_key`` names the run's shared link state (every rank of the run passes the same)."""
    if mode == "off" or topo.num_sites == 1:
        return None
    return WanEmulator(topo, site_index, run_key, mode)


def describe_links(topo: Topology, wan: WanEmulator | None) -> str:
    """'inprocess emulation, A-B 1000 Mbit/s 20 ms, ...' (or: not emulated)."""
    if wan is None:
        return "not emulated (loopback speed)"
    parts = []
    for a in range(topo.num_sites):
        for b in range(a + 1, topo.num_sites):
            link = topo.link(a, b)
            parts.append(
                f"{topo.site_names[a]}-{topo.site_names[b]} {link.bandwidth_bps / 1e6:g} Mbit/s {link.latency_s * 1e3:g} ms"
            )
    return f"{wan.mode} emulation, " + ", ".join(parts)
