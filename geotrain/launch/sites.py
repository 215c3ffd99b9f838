"""Launch an elastic run on this machine: every site its own job, a supervised Lighthouse, and
the failure injection that kills, hangs and restarts whole sites with real signals.

* Each site's G ranks form their own torch.distributed world (their own rendezvous port); sites
  meet only through :mod:`geotrain.elastic`, so a dead site never breaks a survivor's groups.
* The Lighthouse runs in its own process on 127.0.0.1 (unless ``elastic.lighthouse`` names one)
  and is restarted if it dies: the launcher is its supervisor (in production, run
  ``geotrain lighthouse`` under systemd or Kubernetes with restart=always on a machine of its own).
* A site that reaches an injected fault writes a request file; the launcher then SIGKILLs or
  SIGSTOPs every process of that site at once and, with ``fault.restart_after``, starts a fresh
  incarnation that heals from a live peer. Hung sites are SIGKILLed before they restart.
* The policy below, run by :class:`geotrain.launch.supervise.Supervisor`, handles each site's
  exits, fault requests, restarts and migrations.
* The run ends when every site has finished or is down for good; the summary merges the sites'
  own summaries and round logs (``OUT/elastic``) with the injected failures.

A shared membership secret is generated for the run (``elastic.secret_env`` in the children's
environment) unless the user provided one. It is kept in ``OUT/keys/run.secret`` (mode 0600), so
a run started again in the same folder (``checkpoint.resume=auto`` after an outage) is the same
run: its sealed checkpoints load.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from geotrain.comm.emulate.inprocess import state_path
from geotrain.comm.procs import host_store
from geotrain.comm.topology import Topology
from geotrain.config import Config
from geotrain.elastic.lighthouse import LighthouseProcess
from geotrain.elastic.records import merge_summaries
from geotrain.errors import DRAINED_EXIT, LaunchError
from geotrain.launch.spawn import describe_exit, forks_ranks, own_world_env
from geotrain.launch.supervise import Site, Supervisor

REFUSED_EXIT = 3  # a worker that failed membership authentication


def site_env(
    topo: Topology, wan_mode: str, site: int, incarnation: int, local: int, port: int, lighthouse: str, wan_key: str
) -> dict[str, str]:
    """A worker's environment in elastic mode (:func:`own_world_env`, and the Lighthouse)."""
    env = own_world_env(topo, wan_mode, site, incarnation, local, port, wan_key)
    env.update(GEOTRAIN_LIGHTHOUSE=lighthouse, GEOTRAIN_BIND_ADDR="127.0.0.1")
    return env


def _run_secret(path: Path) -> str:
    """The secret kept at ``path``, made (64 hex digits, mode 0600) if there is none yet."""
    kept = path.read_text().strip() if path.is_file() else ""
    if len(kept) >= 16:
        return kept
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    secret = secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


def launch_elastic(
    cfg: Config,
    out: Path,
    cfg_path: Path,
    console_print: Callable[[str], None] | None = print,
    on_poll: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Run one elastic training job (see the module docstring); return the merged summary.

    Raises:
        LaunchError: no site finished.
    """
    topo = Topology.from_config(cfg.topology)
    ecfg = cfg.elastic_rounds  # (secure aggregation: the Lighthouse forms quorums of 3 sites at least)
    (out / "elastic").mkdir(parents=True, exist_ok=True)
    for old in (out / "elastic").iterdir():
        old.unlink()
    wan_key = f"elastic-{os.getpid()}-{secrets.token_hex(4)}"
    if not ecfg.secret_file and len(os.environ.get(ecfg.secret_env, "")) < 16:
        os.environ[ecfg.secret_env] = _run_secret(out / "keys" / "run.secret")  # inherited by every site
    lighthouse: LighthouseProcess | None = None
    if ecfg.lighthouse:
        address = ecfg.lighthouse
    else:
        (out / "logs").mkdir(parents=True, exist_ok=True)
        lighthouse = LighthouseProcess(
            0, ecfg, out / "logs" / "lighthouse.log", cfg.lighthouse_join_s, cfg.liveness.heartbeat_timeout_s
        )  # it reports its port
        lighthouse.start()
        address = lighthouse.address
    injected: list[dict[str, Any]] = []
    crashes: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    handled: set[str] = set()
    t_start = time.monotonic()

    def start_rank(site: Site, local: int) -> tuple[dict[str, str], Path, str | None]:
        if local == 0:  # the site's rendezvous, one per incarnation
            site.store, agent[site.index] = host_store(timeout_s=cfg.liveness.group_timeout_s, attempt=site.incarnation)
        env = site_env(topo, cfg.topology.links.emulate, site.index, site.incarnation, local, site.store.port, address, wan_key)
        env.update(agent[site.index])
        suffix = f".{site.incarnation}" if site.incarnation else ""
        return env, out / "logs" / f"rank{topo.first_rank(site.index) + local}{suffix}.log", None

    agent: dict[int, dict[str, str]] = {}
    sup = Supervisor(
        topo.site_names, topo.workers, cfg_path, out, start_rank, console_print, forks_ranks(cfg.run.backend),
        out / "pids.json", lambda: {"lighthouse": lighthouse.proc.pid if lighthouse is not None and lighthouse.proc else None},
    )  # fmt: skip
    sites, say = sup.sites, sup.say

    def live(site: Site) -> bool:
        return site.state == "running" and (out / "elastic" / f"live-{site.name}.{site.incarnation}").exists()

    def inject(request: dict[str, Any], path: Path) -> None:
        site = sites[topo.site_names.index(request["site"])]
        left = sum(live(s) for s in sites if s is not site)
        if left < 1:  # never take down the last live site: nobody could heal the others
            path.with_suffix(".skip").touch()
            skipped.append(request)
            say(f"[launcher] fault skipped: {request['kind']} {site.name} would leave {left} live sites")
            return
        sig = signal.SIGKILL if request["kind"] == "kill" else signal.SIGSTOP
        site.signal(sig)
        now = time.monotonic()
        injected.append({**request, "injected_at": now, "incarnation": site.incarnation})
        site.state = "down" if sig == signal.SIGKILL else "stopped"
        if cfg.fault.restart_after:
            site.restart_at = now + cfg.fault.restart_after
        say(f"[launcher] fault injected: {request['kind']} site {site.name} at step {request['step']}")

    def migrate(site: Site) -> None:
        """fault.migrate: every rank of the site left right after a committed round (DRAINED_EXIT);
        a new incarnation with the same data slice starts at once and heals from a live site."""
        now = time.monotonic()
        drained = json.loads((out / "elastic" / f"drained-{site.name}.{site.incarnation}.json").read_text())
        injected.append({"site": site.name, "kind": "migrate", "injected_at": now, "incarnation": site.incarnation})
        say(f"[launcher] site {site.name} drained after committed round {drained['committed']}; starting it again")
        sup.start(site)

    def policy(now: float) -> bool:
        for f in sorted((out / "elastic").glob("fault-*.json")):
            if f.name not in handled:
                try:
                    request = json.loads(f.read_text())
                except json.JSONDecodeError:  # not yet whole (the writer renames it into place): next poll
                    continue
                handled.add(f.name)
                inject(request, f)
        for s in sites:
            if s.restart_at is not None and now >= s.restart_at and not any(live(o) for o in sites if o is not s):
                s.restart_at = None  # the run is over: nobody is left to heal from
                say(f"[launcher] not restarting site {s.name}: no live site is left to heal from")
            if s.restart_at is not None and now >= s.restart_at:
                s.signal(signal.SIGKILL)  # a hung site is killed before its new incarnation starts
                for p in s.procs:
                    p.wait()
                say(f"[launcher] restarting site {s.name} (incarnation {s.incarnation + 1})")
                sup.start(s)
            if s.state != "running":
                continue
            codes = s.codes()
            if all(c == DRAINED_EXIT for c in codes):
                migrate(s)
                continue
            if all(c == 0 for c in codes):
                s.state = "finished"
            elif any(c not in (None, 0) for c in codes):
                code = next(c for c in codes if c not in (None, 0))
                kind = "refused" if code == REFUSED_EXIT else "crash"
                crashes.append({"site": s.name, "kind": kind, "injected_at": now, "exit": describe_exit(int(code))})
                s.signal(signal.SIGKILL)
                s.state = "down"
                say(f"[launcher] site {s.name} {describe_exit(int(code))}; the other sites carry on")
        if lighthouse is not None and lighthouse.supervise():
            say("[launcher] the Lighthouse had died: restarted it on the same address")
            sup.write_pids()
        if all(s.state in ("finished", "down", "stopped") and s.restart_at is None for s in sites):
            return True  # a site hung for good is stopped with the rest
        joining = [s for s in sites if s.state == "running" and not live(s)]
        if any(s.state == "finished" for s in sites) and joining and not any(live(s) for s in sites):
            for s in joining:  # restarted too late: the others finished, nobody can heal it
                say(f"[launcher] stopping site {s.name}: the run ended before it could rejoin")
                s.signal(signal.SIGTERM)
                s.state = "down"
        return False

    try:
        for s in sites:
            sup.start(s)
        sup.run(policy, on_poll, 0.05)
    finally:
        if lighthouse is not None:
            lighthouse.stop()
        state_path(wan_key).unlink(missing_ok=True)
    summary = merge_summaries(out, topo, injected + crashes, cfg.liveness.heartbeat_timeout_s, time.monotonic() - t_start)
    if summary is None:
        raise LaunchError(f"no site finished the run; logs under {out / 'logs'}")
    summary["faults_skipped"] = skipped
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
