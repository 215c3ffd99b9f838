"""The membership coordinator: torchft's Lighthouse, as a process of its own.

The Lighthouse (:mod:`torchft.coordination`, a small Rust server) forms a quorum per round from
the sites that heartbeat to it, drops a site silent for the heartbeat timeout, and holds rounds
below the minimum number of sites. :func:`lighthouse_main` runs one until SIGTERM
(``geotrain lighthouse``, or ``python -m geotrain.elastic.lighthouse``);
:class:`LighthouseProcess` runs one beside a local launcher and restarts it if it dies (in
production: systemd or Kubernetes with restart=always, on a machine of its own).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geotrain.comm.procs import die_with_parent

if TYPE_CHECKING:
    from geotrain.config import ElasticConfig


def torchft_native() -> Any:
    """torchft's compiled extension (``LighthouseServer``, ``LighthouseClient``), loaded alone.
    ``torchft/__init__.py`` imports torch and torchft's Python modules: 1.5 s of CPU in a Lighthouse
    process that never uses them, 0.4 s in each rank (its torch is loaded already). Where the
    extension is not where torchft's own package keeps it: the public import. Loaded once per
    process (it is then ``sys.modules["torchft._torchft"]``, which torchft's own import reuses)."""
    if "torchft._torchft" in sys.modules:
        return sys.modules["torchft._torchft"]
    spec = importlib.util.find_spec("torchft")  # finds the package without running its __init__
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = Path(folder) / f"_torchft{suffix}"
            ext = importlib.util.spec_from_file_location("torchft._torchft", path) if path.exists() else None
            if ext is not None and ext.loader is not None:
                module = importlib.util.module_from_spec(ext)
                ext.loader.exec_module(module)
                sys.modules["torchft._torchft"] = module
                return module
    import torchft.coordination

    return torchft.coordination


def lighthouse_main(argv: list[str] | None = None) -> int:
    """``python -m geotrain.elastic.lighthouse --bind 127.0.0.1:PORT ...``: run a Lighthouse until SIGTERM."""
    LighthouseServer = torchft_native().LighthouseServer  # noqa: N806 (a class)
    ap = argparse.ArgumentParser(prog="geotrain lighthouse", description="geotrain's membership coordinator (torchft Lighthouse)")
    ap.add_argument("--bind", required=True, help="HOST:PORT (use a loopback or private address)")
    ap.add_argument("--min-sites", type=int, default=1)
    ap.add_argument("--heartbeat-timeout", type=float, default=2.0, help="seconds")
    ap.add_argument("--join-timeout", type=float, default=60.0, help="seconds")
    ap.add_argument("--address-file", default=None, help="write HOST:PORT here once listening (with port 0: the port chosen)")
    args = ap.parse_args(argv)
    die_with_parent()  # under geotrain's launcher: never outlive it
    server = LighthouseServer(
        bind=args.bind,
        min_replicas=args.min_sites,
        join_timeout_ms=int(args.join_timeout * 1000),
        quorum_tick_ms=50,
        heartbeat_timeout_ms=int(args.heartbeat_timeout * 1000),
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    address = f"{args.bind.rpartition(':')[0]}:{server.address().rpartition(':')[2]}"  # the port really bound
    if args.address_file:
        tmp = Path(args.address_file + ".tmp")
        tmp.write_text(address)
        tmp.replace(args.address_file)
    print(f"geotrain lighthouse on {address} (min sites {args.min_sites})", flush=True)
    stop.wait()
    server.shutdown()
    return 0


START_TIMEOUT_S = 60.0


class LighthouseProcess:
    """A Lighthouse in its own process on ``127.0.0.1:port``, restarted by :meth:`supervise` if it
    dies (on the same port). Port 0: the Lighthouse binds a port the kernel picks and reports it,
    so no other process can take it between choosing and binding. ``join_s``: how long a round
    that has the sites it needs waits for the live sites that have not asked yet (elastic quorum
    rounds: ``sync.quorum.grace_s``); ``lost_after_s``: how long a site that stopped beating is
    kept in quorums (``liveness.heartbeat_timeout_s``)."""

    def __init__(self, port: int, cfg: ElasticConfig, log: Path, join_s: float = 60.0, lost_after_s: float = 2.0) -> None:
        self.port, self.cfg, self.log, self.join_s, self.lost_after_s = port, cfg, log, join_s, lost_after_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "geotrain.elastic.lighthouse",
            "--bind",
            self.address,
            "--min-sites",
            str(self.cfg.min_sites),
        ]
        cmd += ["--heartbeat-timeout", str(self.lost_after_s), "--join-timeout", str(self.join_s)]
        # the Lighthouse never needs the run secret: it does not get it (a process that reads its
        # environment, or a crash dump of it, learns nothing)
        secret_vars = {"GEOTRAIN_SECRET", self.cfg.secret_env}
        env = {k: v for k, v in os.environ.items() if k not in secret_vars} | {"GEOTRAIN_PARENT_PID": str(os.getpid())}
        report = self.log.with_suffix(".address")
        report.unlink(missing_ok=True)
        if not self.port:
            cmd += ["--address-file", str(report)]
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.port:
            if report.exists():
                self.port = int(report.read_text().rpartition(":")[2])
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the Lighthouse did not start within {START_TIMEOUT_S:g}s; log: {self.log}")
            else:
                time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL it (failure injection); :meth:`supervise` brings it back."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def supervise(self) -> bool:
        """Restart it if it died; True if it had to."""
        if self.proc is not None and self.proc.poll() is not None:
            self.restarts += 1
            self.start()
            return True
        return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    sys.exit(lighthouse_main())
