"""Wide-area links emulated on one machine, so every claim about slow links is measured.

- :mod:`.inprocess`: pacing and delay inside geotrain (a shared FIFO per directed site pair,
  delivery-time headers for latency); no root needed. The default.
- :mod:`.kernel`: a network namespace per site behind a bridge, ``tc`` HTB limits per
  destination site; latency still in-process (no ``netem`` here). Needs root and iproute2.

:func:`link_emulator` gives a rank the emulator of a mode; :func:`describe_links` the line the
run log prints.
"""

from __future__ import annotations

from geotrain.comm.emulate.inprocess import WanEmulator
from geotrain.comm.topology import Topology


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
