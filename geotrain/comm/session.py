"""One rank's communication, opened together and closed together: its process groups, the link
emulation of its site, and the collectives over them.

Used by the training entry point, the public API (:mod:`geotrain.api`), the benchmarks and the
multi-process tests, so they all set up a rank the same way.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from geotrain.comm.collectives import Collectives
from geotrain.comm.emulate import link_emulator
from geotrain.comm.groups import ProcessGroups
from geotrain.comm.topology import Topology

MIB = 1 << 20


def open_collectives(
    topology: Topology,
    *,
    backend: str = "auto",
    timeout_s: float = 300.0,
    lanes: int = 1,
    chunk_bytes: int = 4 * MIB,
    emulate: str = "off",
    run_key: str | None = None,
    links: Topology | None = None,
    site_index: int | None = None,
    site_mesh: bool = False,
) -> Collectives:
    """Initialise torch.distributed from the environment and build this rank's groups (cut from
    ``topology``), its link emulation in mode ``emulate`` and its collectives.

    Args:
        lanes, chunk_bytes: pipelining of fp32 all-reduces (see :mod:`geotrain.comm.collectives`).
        run_key: names the run's shared link state (default: MASTER_PORT, the same on every rank).
        links, site_index: the topology whose links are emulated and this rank's site in it, when
            the process group is not the whole run (elastic mode: a site's own world). Default:
            ``topology`` and this rank's site.
        site_mesh: also build the site's device mesh for FSDP2 (``sync.within_site=fsdp``).
    """
    groups = ProcessGroups.build(topology, backend, timeout_s, lanes=lanes, site_mesh=site_mesh)
    key = run_key if run_key is not None else os.environ.get("MASTER_PORT", "0")
    where = groups.me.site_index if site_index is None else site_index
    wan = link_emulator(links or topology, where, emulate, key)
    return Collectives(groups, chunk_bytes=chunk_bytes, wan=wan)


def close_collectives(comm: Collectives, *, unlink_links: bool) -> None:
    """Close ``comm``, its link emulation (removing the shared link state if ``unlink_links``:
    one rank of the run does) and its process groups."""
    try:
        comm.close()
        if comm.wan is not None:
            comm.wan.close(unlink=unlink_links)
    finally:
        comm.groups.destroy()


@contextlib.contextmanager
def rank_comm(
    topology: Topology, mode: str = "inprocess", lanes: int = 1, chunk_bytes: int = 4 * MIB
) -> Iterator[tuple[ProcessGroups, Collectives]]:
    """In a rank started by :func:`geotrain.comm.procs.run_ranks`: its Gloo groups and collectives
    over links emulated in ``mode`` ('off' for none); everything is closed on exit."""
    comm = open_collectives(topology, backend="gloo", timeout_s=600, lanes=lanes, chunk_bytes=chunk_bytes, emulate=mode)
    try:
        yield comm.groups, comm
    finally:
        close_collectives(comm, unlink_links=comm.groups.me.rank == 0)
