"""``geotrain site``: run one site of an elastic job on this machine, the way each datacenter
starts its part of a real multi-site run (docs/ELASTIC.md, "Deploying across machines").

The site's G ranks are local processes forming the site's own torch.distributed world; the site
meets the others only through the Lighthouse (``--lighthouse``) and the round store its local
rank 0 hosts on ``--bind`` (the address the other sites reach this machine at). Every setting a
worker needs is given here or refused, never defaulted behind the user's back:

==========================  ==============================================================
``GEOTRAIN_SITE_INDEX``     this site's index in ``topology.sites`` (from ``--site NAME``)
``GEOTRAIN_INCARNATION``    0 on the first start, N > 0 when restarted (heals before step 1)
``GEOTRAIN_LIGHTHOUSE``     HOST:PORT of the Lighthouse (``--lighthouse`` or elastic.lighthouse)
``GEOTRAIN_BIND_ADDR``      where this site's round store and cross-site Gloo groups listen (``--bind``)
``GEOTRAIN_WAN_KEY``        this site's link-emulation state (one per site)
secret                      ``elastic.secret_env`` (default GEOTRAIN_SECRET) or elastic.secret_file
==========================  ==============================================================

The site's rendezvous store is hosted here on 127.0.0.1 (:func:`geotrain.comm.procs.host_store`:
port 0, no port race) and the workers join it as torchrun's workers join their agent's store; the
site's in-site Gloo traffic stays on loopback too. Only what other sites dial listens on
``--bind``: local rank 0's round store and each rank's round groups. Before, the site's own store
and in-site links (unauthenticated, carrying pickles) listened on ``--bind`` as well.
"""

from __future__ import annotations

import fcntl
import signal
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from geotrain.comm.emulate.inprocess import state_path
from geotrain.comm.procs import host_store
from geotrain.comm.topology import Topology
from geotrain.config import Config
from geotrain.elastic.auth import load_secret
from geotrain.elastic.records import drain_file
from geotrain.errors import DRAINED_EXIT, ConfigError, LaunchError, MembershipRefused
from geotrain.launch.preflight import preflight
from geotrain.launch.spawn import describe_exit, forks_ranks, rank_env
from geotrain.launch.supervise import Site, Supervisor

_SIOCGIFADDR = 0x8915


def interface_of(address: str) -> str:
    """The network interface of this machine that holds IPv4 ``address`` (Gloo binds to it).

    Raises:
        ConfigError: no interface has it.
    """
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                got = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
        if socket.inet_ntoa(got[20:24]) == address:
            return name
    raise ConfigError(f"--bind: no network interface of this machine has the address {address}")


def site_settings(cfg: Config, site: str, lighthouse: str | None) -> tuple[int, str]:
    """The site's index and the Lighthouse address, or a one-line refusal naming what is missing.

    Raises:
        ConfigError: elastic mode off, unknown site, no Lighthouse, no secret.
    """
    if not cfg.elastic.enabled:
        raise ConfigError("elastic.enabled: geotrain site runs one site of an elastic run; set it to true")
    names = [s.name for s in cfg.topology.sites]
    if site not in names:
        raise ConfigError(f"--site: must be one of {', '.join(names)} (got {site!r})")
    address = lighthouse or cfg.elastic.lighthouse
    if not address:
        raise ConfigError("--lighthouse: give HOST:PORT of the running `geotrain lighthouse` (or set elastic.lighthouse)")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--lighthouse: expected HOST:PORT (got {address!r})")
    try:
        load_secret(cfg.elastic)
    except MembershipRefused as exc:
        raise ConfigError(f"{exc} (every site needs the same secret)") from None
    return names.index(site), address


def run_site(
    cfg: Config,
    out: Path,
    site: str,
    lighthouse: str | None,
    bind: str,
    incarnation: int,
    console_print: Callable[[str], None] | None = print,
) -> Path | None:
    """Run this machine's site until it finishes; the path of its summary. SIGUSR1 drains it: its
    ranks stop after the site's next committed round, and None is returned (migration: start
    the site again elsewhere with the next ``incarnation``; it heals from a live site).

    Raises:
        ConfigError: a missing or invalid setting (nothing was started).
        LaunchError: a rank failed (the others have been stopped); names the rank and its log.
    """
    index, address = site_settings(cfg, site, lighthouse)
    preflight(cfg, site=index)
    interface_of(bind)  # refuse an address this machine does not hold, before anything starts
    topo = Topology.from_config(cfg.topology)
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    (out / "elastic").mkdir(exist_ok=True)
    cfg_path = out / f"config-{site}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    summary = out / "elastic" / f"summary-{site}.json"
    summary.unlink(missing_ok=True)
    drain_file(out, site).unlink(missing_ok=True)  # a drain asked of an earlier run here is not this one's
    # the site's own rendezvous and in-site Gloo traffic stay on loopback (its ranks all run here);
    # only the round store and the round groups, which other sites dial, live on --bind
    store, agent = host_store("127.0.0.1", cfg.liveness.group_timeout_s, attempt=incarnation)
    wan_key = f"site-{site}-{store.port}"
    state_path(wan_key).unlink(missing_ok=True)  # one left by a SIGKILLed launcher would lend this run its clock
    mode = "inprocess" if cfg.topology.links.emulate == "inprocess" else "off"  # the real network is the link
    workers = topo.workers[index]

    def start_rank(_site: Site, local: int) -> tuple[dict[str, str], Path, str | None]:
        env = rank_env(local, workers, workers, store.port, mode)
        env.update(
            MASTER_ADDR="127.0.0.1",
            GLOO_SOCKET_IFNAME="lo",
            **agent,
            GEOTRAIN_SITE_INDEX=str(index),
            GEOTRAIN_INCARNATION=str(incarnation),
            GEOTRAIN_LIGHTHOUSE=address,
            GEOTRAIN_BIND_ADDR=bind,
            GEOTRAIN_WAN_KEY=wan_key,
        )
        suffix = f".{incarnation}" if incarnation else ""
        return env, out / "logs" / f"{site}-rank{local}{suffix}.log", None

    sup = Supervisor([site], [workers], cfg_path, out, start_rank, console_print, forks_ranks(cfg.run.backend))
    me = sup.sites[0]
    me.incarnation = incarnation - 1  # (its first start here is the run's incarnation ``incarnation``)
    stop = {"signal": 0}
    ended: dict[str, Any] = {}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    def on_drain(_signum: int, _frame: object) -> None:  # SIGUSR1: leave after the next committed round
        drain_file(out, site).touch()

    def policy(_now: float) -> bool:
        codes = me.codes()
        if all(c == DRAINED_EXIT for c in codes):  # left right after a committed round (SIGUSR1)
            ended["drained"] = True
            return True
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0, DRAINED_EXIT)]
        if failed:
            i, code = failed[0]
            ended["error"] = f"site {site} rank {i} {describe_exit(int(code))}; log: {me.logs[i]}"
            return True
        if stop["signal"]:
            ended["error"] = f"site {site} stopped by {signal.Signals(stop['signal']).name}"
            return True
        return all(c == 0 for c in codes)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, on_drain)
    try:
        sup.start(me)
        sup.run(policy, None, 0.05)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        state_path(wan_key).unlink(missing_ok=True)
    if "error" in ended:
        raise LaunchError(ended["error"])
    if ended.get("drained"):
        return None
    if not summary.exists():
        raise LaunchError(f"site {site} ended without a summary; logs under {out / 'logs'}")
    return summary
