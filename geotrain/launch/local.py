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
rejoins the asynchronous rounds through the run's store (the policy below, run by
:class:`geotrain.launch.supervise.Supervisor`). Children also get ``PR_SET_PDEATHSIG`` so they die
if the launcher itself is killed: no orphans either way.
"""

from __future__ import annotations

import json
import sys
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
from geotrain.launch.spawn import describe_exit, forks_ranks, own_world_env, rank_env
from geotrain.launch.supervise import Site, Supervisor

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
    wan_mode = "inprocess" if cfg.topology.links.emulate == "kernel" else cfg.topology.links.emulate
    kills_done = [0] * topo.num_sites  # fault.kill steps carried out per site (a restarted site skips them)
    stores: list[Any] = []  # the rendezvous stores of sites started again (kept alive while they run)
    agent_of: dict[int, dict[str, str]] = {}  # their rendezvous agents' environment

    def start_rank(site: Site, local: int) -> tuple[dict[str, str], Path, str | None]:
        """The first incarnation joins the run's world; a site started again is a world of its own:
        its ranks find the run's store (and its link state) at the run's port, and rejoin the
        asynchronous rounds through it."""
        rank = topo.first_rank(site.index) + local
        log = out / "logs" / (f"rank{rank}.{site.incarnation}.log" if site.incarnation else f"rank{rank}.log")
        if site.incarnation:
            env = own_world_env(topo, wan_mode, site.index, site.incarnation, local, site.store.port, wan_key=str(port))
            env.update(agent_of[site.index], GEOTRAIN_RUN_PORT=str(port))
            env.update({REJOIN_ENV: "1", KILLS_DONE_ENV: str(kills_done[site.index])})
            return env, log, None
        env = {**rank_env(rank, topo.world_size, topo.world_size, port, wan_mode), **agent}
        if kernel is None:
            return env, log, None
        # the rank lives in its site's namespace; Gloo binds to its veth
        env.update(MASTER_ADDR=kernel.address(0), GLOO_SOCKET_IFNAME=IFNAME, GEOTRAIN_WAN_MODE="kernel")
        return env, log, kernel.namespaces[site.index]

    sup = Supervisor(topo.site_names, topo.workers, cfg_path, out, start_rank, console_print, fork, out / "pids.json")
    sites = sup.sites
    failure: list[str] = []
    # asynchronous quorum rounds go on without a site that dies (any but the first, which holds the
    # syncer) once training has started: its other ranks are killed too, and the run ends when
    # every live site's ranks have. A failure at the start (a missing corpus, say) still stops the
    # run, since the others would wait for it in the start's collectives.

    def lose(site: Site, why: str, come_back: bool = True) -> None:
        """Kill ``site``'s ranks and go on without it; with ``fault.restart_after`` (and
        ``come_back``: the run is not over) start it again that many seconds from now."""
        site.state = "down"
        if come_back and cfg.fault.restart_after:
            site.restart_at = time.monotonic() + cfg.fault.restart_after
        if site.incarnation and store is not None:  # the syncer reaches a site started again through the store only
            store.set(down_key(site.index), str(site.incarnation))
        site.kill()
        sup.say(f"[launcher] site {site.name} {why}; the asynchronous rounds go on without it")

    def restart(site: Site) -> None:
        site.store, site_agent = host_store(timeout_s=cfg.liveness.group_timeout_s, attempt=site.incarnation + 1)
        stores.append(site.store)
        agent_of[site.index] = site_agent
        sup.start(site)
        sup.say(f"[launcher] restarting site {site.name} (incarnation {site.incarnation})")

    def requests() -> None:
        """fault.kill requests, the syncer's reports of silent sites, and restarts that are due."""
        for f in sorted((out / "faults").glob("fault-*.json")):  # fault.kill: a site asked to be killed
            request = json.loads(f.read_text())
            f.unlink()
            site = sites[topo.site_names.index(request["site"])]
            kills_done[site.index] += 1
            lose(site, f"killed (fault injection at step {request['step']})")
        for site in sites[1:] if store is not None else ():  # the syncer lost it for silence
            if store.check([silent_key(site.index)]):
                k = int(store.get(silent_key(site.index)))
                store.delete_key(silent_key(site.index))
                if k == site.incarnation and site.state == "running":  # (not a report on an incarnation gone by)
                    lose(site, "was lost by the syncer (silent: stopped or hung); its ranks are killed")
        for site in sites:
            if site.restart_at is not None and time.monotonic() >= site.restart_at:
                site.restart_at = None
                if sites[0].procs[0].poll() is None:  # else the run is over: nothing to rejoin
                    restart(site)

    def policy(_now: float) -> bool:
        if tolerant:
            requests()
        ranks = [(topo.first_rank(s.index) + i, s, c) for s in sites for i, c in enumerate(s.codes())]
        bad = [(r, s, c) for r, s, c in ranks if c not in (None, 0) and s.state == "running"]
        started = tolerant and bad and first_step.exists() and first_step.stat().st_size > 0
        for r, s, c in sorted(bad, key=lambda x: (x[2] > 0, x[0])) if started else []:
            if s.index and s.state == "running":
                lose(
                    s, f"lost: rank {r} {describe_exit(c)} (log: {s.logs[r - topo.first_rank(s.index)]})"
                )  # any death comes back
        if tolerant and ranks[0][2] == 0 and summary_path.exists():  # the run is over: stop the sites it lost
            for name in json.loads(summary_path.read_text()).get("lost_sites", []):  # hung ones still run
                if sites[topo.site_names.index(name)].state == "running":
                    lose(
                        sites[topo.site_names.index(name)],
                        "was lost by the syncer (silent: stopped or hung); its ranks are killed",
                        come_back=False,
                    )
        bad = [(r, s, c) for r, s, c in bad if s.state == "running"]
        if bad:
            # a peer that lost its connection may exit in the same poll: name the cause first
            r, s, c = min(bad, key=lambda x: (x[2] > 0, x[0]))
            info = topo.info(r)
            failure.append(
                f"rank {r} (site {info.site}, local rank {info.local_rank}) {describe_exit(c)}; "
                f"stopped the other ranks. Log: {out / 'logs' / f'rank{r}.log'}"
            )
            if c != 0 and info.local_rank != 0:
                for line in (out / "logs" / f"rank{r}.log").read_text().strip().splitlines()[-5:]:
                    sup.say(f"[{info.tag}] {line}")
            return True
        return all(c is not None and (c == 0 or s.state != "running") for _, s, c in ranks)

    for site in sites:
        sup.start(site)
    sup.run(policy, on_poll, 0.2)
    if failure:
        raise LaunchError(failure[0])
    if not summary_path.exists():
        raise LaunchError(f"all ranks exited but {summary_path} was not written")
    return dict(json.loads(summary_path.read_text()))
