"""Start every rank of a run as a real OS process on this machine, and tear them all down.

Each rank is ``python -m geotrain.run.worker`` with the torch.distributed environment a launcher
like torchrun would give it, Gloo bound to the loopback interface (MASTER_ADDR=127.0.0.1,
GLOO_SOCKET_IFNAME=lo) — no byte leaves 127.0.0.0/8. Output of every rank goes to
``OUT/logs/rank{r}.log``; lines from each site's local rank 0 (and any error) are forwarded to
the console above a progress bar that follows rank 0's metrics.

If any rank exits non-zero, the others get SIGTERM, then SIGKILL after a grace period, and
:class:`LaunchError` names the site and rank that failed. With asynchronous quorum rounds
(``sync.quorum``) a site other than the first that fails once training has started (or that
``fault.kill`` names) is lost instead: its ranks are killed and the others go on
(:mod:`geotrain.round.hub`); so is a site the syncer loses for silence (stopped or hung): it
reports the loss in the run's store, and the launcher kills the site's processes. With
``fault.restart_after``, a site lost in any of these ways is started again that many seconds
later, as a torch.distributed world of its own (its rendezvous store hosted here too), and
rejoins the asynchronous rounds through the run's store. Children also get ``PR_SET_PDEATHSIG`` so they die
if the launcher itself is killed: no orphans either way.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from geotrain.comm.emulate import kernel as netns
from geotrain.comm.emulate.inprocess import state_path
from geotrain.comm.emulate.kernel import IFNAME, KernelLinks
from geotrain.comm.mailbox import down_key, silent_key
from geotrain.comm.procs import free_port, host_store
from geotrain.comm.topology import Topology
from geotrain.config import Config
from geotrain.errors import LaunchError
from geotrain.launch.spawn import (
    Rank,
    describe_exit,
    forks_ranks,
    own_world_env,
    rank_env,
    spawn_rank,
    stop_all,
    worker_args,
    zygote_pid,
)

REJOIN_ENV = "GEOTRAIN_REJOIN"  # a quorum-rounds site started again: its world is its own ranks
KILLS_DONE_ENV = "GEOTRAIN_KILLS_DONE"  # ... and the fault.kill steps of its site already carried out


def launch_local(
    cfg: Config,
    out: Path,
    console_print: Callable[[str], None] | None = print,
    on_poll: Callable[[], None] | None = None,
    fork: bool | None = None,
) -> dict[str, Any]:
    """Run one training job with every rank as a local process; return its summary. Ranks are
    forked from the zygote unless ``fork`` is False or the run will use CUDA (``fork=None``:
    :func:`geotrain.launch.spawn.forks_ranks` decides).

    Raises:
        LaunchError: a rank failed (all others have been stopped).
    """
    topo = Topology.from_config(cfg.topology)
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    cfg_path = out / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    summary_path = out / "summary.json"
    summary_path.unlink(missing_ok=True)
    if cfg.elastic.enabled:  # sites as separate jobs joined by the membership layer
        from geotrain.launch.sites import launch_elastic

        return launch_elastic(cfg, out, cfg_path, console_print, on_poll)
    kernel = _kernel_links(cfg, topo)
    # the rendezvous store is hosted here (no port race), except in kernel mode, where the ranks
    # rendezvous inside the first site's namespace, out of this process's network stack
    store, agent = host_store(timeout_s=cfg.liveness.group_timeout_s) if kernel is None else (None, {})
    port = store.port if store is not None else free_port()
    # a launcher that was SIGKILLed could not remove its link state: one left on this port would
    # give this run its clock (scheduled link changes would fire early) and its busy links
    state_path(str(port)).unlink(missing_ok=True)
    try:
        fork = forks_ranks(cfg.run.backend) if fork is None else fork
        return _launch(cfg, topo, out, cfg_path, summary_path, port, agent, kernel, console_print, on_poll, fork, store)
    finally:
        if kernel is not None:
            kernel.down()
        state_path(str(port)).unlink(missing_ok=True)  # the link state, if a rank died before removing it


def _kernel_links(cfg: Config, topo: Topology) -> KernelLinks | None:
    """The namespaces for kernel link emulation, set up; None for the other modes. Kernel mode
    that cannot run here falls back to in-process emulation with a one-line notice."""
    if cfg.topology.links.emulate != "kernel" or topo.num_sites == 1:
        return None
    why = netns.unavailable()
    if why is not None:
        print(f"geotrain: kernel link emulation unavailable ({why}); using in-process emulation", file=sys.stderr, flush=True)
        return None
    return KernelLinks(topo).up()


def _launch(
    cfg: Config,
    topo: Topology,
    out: Path,
    cfg_path: Path,
    summary_path: Path,
    port: int,
    agent: dict[str, str],
    kernel: KernelLinks | None,
    console_print: Callable[[str], None] | None,
    on_poll: Callable[[], None] | None,
    fork: bool,
    store: Any = None,
) -> dict[str, Any]:
    tolerant = cfg.sync.quorum is not None
    first_step = out / "metrics" / "rank0.jsonl"  # rank 0 logged a step: every rank is past the start's collectives
    if tolerant:
        first_step.unlink(missing_ok=True)  # an earlier run's (quorum rounds take no checkpoints to resume)
    procs: list[Rank] = []
    pumps: list[threading.Thread] = []
    wan_mode = "inprocess" if cfg.topology.links.emulate == "kernel" else cfg.topology.links.emulate
    for rank in range(topo.world_size):
        info = topo.info(rank)
        env = {**rank_env(rank, topo.world_size, topo.world_size, port, wan_mode), **agent}
        netns = None
        if kernel is not None:  # the rank lives in its site's namespace; Gloo binds to its veth
            env.update(MASTER_ADDR=kernel.address(0), GLOO_SOCKET_IFNAME=IFNAME, GEOTRAIN_WAN_MODE="kernel")
            netns = kernel.namespaces[info.site_index]
        forward = console_print if info.local_rank == 0 else None
        p, t = spawn_rank(worker_args(cfg_path, out), env, out / "logs" / f"rank{rank}.log", forward, netns, fork)
        procs.append(p)
        pumps.append(t)
    pids = {"launcher": os.getpid(), "zygote": zygote_pid(), "ranks": [p.pid for p in procs]}
    (out / "pids.json").write_text(json.dumps(pids))

    failure: str | None = None
    # asynchronous quorum rounds go on without a site that dies (any but the first, which holds the
    # syncer) once training has started: its other ranks are killed too, and the run ends when
    # every live site's ranks have. A failure at the start (a missing corpus, say) still stops the
    # run, since the others would wait for it in the start's collectives.
    lost: set[int] = set()
    restart_at: dict[int, float] = {}  # sites that died, and when they start again (fault.restart_after)
    incarnation = [0] * topo.num_sites
    kills_done = [0] * topo.num_sites  # fault.kill steps carried out per site (a restarted site skips them)
    stores: list[Any] = []  # the rendezvous stores of sites started again (kept alive while they run)

    def log_of(rank: int) -> Path:
        """``rank``'s log: ``rank<r>.log``, or ``rank<r>.<k>.log`` for its site's k-th restart."""
        k = incarnation[topo.info(rank).site_index]
        return out / "logs" / (f"rank{rank}.{k}.log" if k else f"rank{rank}.log")

    def lose(site: int, why: str, come_back: bool = True) -> None:
        """Kill ``site``'s ranks and go on without it; with ``fault.restart_after`` (and
        ``come_back``: the run is not over) start it again that many seconds from now."""
        lost.add(site)
        if come_back and cfg.fault.restart_after:
            restart_at[site] = time.monotonic() + cfg.fault.restart_after
        if incarnation[site] and store is not None:  # the syncer reaches a site started again through the store only
            store.set(down_key(site), str(incarnation[site]))
        for r in topo.site_ranks(site):
            if procs[r].poll() is None:
                procs[r].kill()
        if console_print is not None:
            console_print(f"[launcher] site {topo.site_names[site]} {why}; the asynchronous rounds go on without it")

    def restart(site: int) -> None:
        """Start ``site`` again: its ranks' world is the site alone; they find the run's store (and
        its link state) at the run's port, and rejoin the rounds through it."""
        incarnation[site] += 1
        site_store, site_agent = host_store(timeout_s=cfg.liveness.group_timeout_s, attempt=incarnation[site])
        stores.append(site_store)
        for local, rank in enumerate(topo.site_ranks(site)):
            env = own_world_env(topo, wan_mode, site, incarnation[site], local, site_store.port, wan_key=str(port))
            env.update(site_agent, GEOTRAIN_RUN_PORT=str(port), **{REJOIN_ENV: "1", KILLS_DONE_ENV: str(kills_done[site])})
            procs[rank], t = spawn_rank(
                worker_args(cfg_path, out), env, log_of(rank), console_print if local == 0 else None, None, fork
            )
            pumps.append(t)
        lost.discard(site)
        pids["ranks"] = [p.pid for p in procs]
        (out / "pids.json").write_text(json.dumps(pids))
        if console_print is not None:
            console_print(f"[launcher] restarting site {topo.site_names[site]} (incarnation {incarnation[site]})")

    try:
        while True:
            if tolerant:
                for f in sorted((out / "faults").glob("fault-*.json")):  # fault.kill: a site asked to be killed
                    request = json.loads(f.read_text())
                    f.unlink()
                    site = topo.site_names.index(request["site"])
                    kills_done[site] += 1
                    lose(site, f"killed (fault injection at step {request['step']})")
                for site in range(1, topo.num_sites) if store is not None else ():  # the syncer lost it for silence
                    if store.check([silent_key(site)]):
                        k = int(store.get(silent_key(site)))
                        store.delete_key(silent_key(site))
                        if k == incarnation[site] and site not in lost:  # (not a report on an incarnation gone by)
                            lose(site, "was lost by the syncer (silent: stopped or hung); its ranks are killed")
                for site, at in sorted(restart_at.items()):
                    if time.monotonic() >= at:
                        del restart_at[site]
                        if procs[0].poll() is None:  # else the run is over: nothing to rejoin
                            restart(site)
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0) and topo.info(r).site_index not in lost]
            started = tolerant and bad and first_step.exists() and first_step.stat().st_size > 0
            for r, c in sorted(bad, key=lambda rc: (rc[1] > 0, rc[0])) if started else []:
                site = topo.info(r).site_index
                if site and site not in lost:
                    lose(site, f"lost: rank {r} {describe_exit(c)} (log: {log_of(r)})")  # any death comes back
            if tolerant and codes[0] == 0 and summary_path.exists():  # the run is over: stop the sites it lost
                for name in json.loads(summary_path.read_text()).get("lost_sites", []):  # hung ones still run
                    if topo.site_names.index(name) not in lost:
                        lose(
                            topo.site_names.index(name),
                            "was lost by the syncer (silent: stopped or hung); its ranks are killed",
                            come_back=False,
                        )
            bad = [(r, c) for r, c in bad if topo.info(r).site_index not in lost]
            if bad:
                # a peer that lost its connection may exit in the same poll: name the cause first
                r, c = min(bad, key=lambda rc: (rc[1] > 0, rc[0]))
                info = topo.info(r)
                failure = (
                    f"rank {r} (site {info.site}, local rank {info.local_rank}) {describe_exit(c)}; "
                    f"stopped the other ranks. Log: {out / 'logs' / f'rank{r}.log'}"
                )
                if c != 0 and console_print is not None and info.local_rank != 0:
                    tail = (out / "logs" / f"rank{r}.log").read_text().strip().splitlines()[-5:]
                    for line in tail:
                        console_print(f"[{info.tag}] {line}")
                break
            if all(c is not None and (c == 0 or topo.info(r).site_index in lost) for r, c in enumerate(codes)):
                break
            if on_poll is not None:
                on_poll()
            time.sleep(0.2)
    finally:
        stop_all(procs)
        for t in pumps:
            t.join(timeout=2)
    if failure is not None:
        raise LaunchError(failure)
    if not summary_path.exists():
        raise LaunchError(f"all ranks exited but {summary_path} was not written")
    return dict(json.loads(summary_path.read_text()))
