"""Cost of the security layer of elastic mode, measured in real exchanges and real rounds.

1. **The exchange at 64 MiB, with and without it, side by side.** Two processes run geotrain's
   elastic exchange (:class:`geotrain.elastic.exchange.Exchange`: ring all-reduce over a real Gloo
   group whose rendezvous goes through the authenticated round store, paced by the link
   emulation) on a 64 MiB fp32 pseudo-gradient, alternating rounds with the real frame cipher
   (AES-256-GCM per frame) and with no cipher at all (the same bytes on the wire, nothing sealed,
   copied or opened); at 1 and 10 Gbit/s and unpaced loopback. Median of ``--reps`` rounds each.
2. **A default elastic run.** ``geotrain train`` with the default model and links (2 sites x 1
   worker, 1 Gbit/s between sites); every committed round's record gives ``exchange_s`` and
   ``seal_s``/``open_s`` (time this rank spent encrypting outgoing and decrypting received
   frames in that round; both are on the critical path).
3. Alone: AES-256-GCM and HMAC-SHA256 throughput on one core, one signed audit line (Ed25519
   sign + append), verifying a chain per line, one checkpoint manifest HMAC.

Prints a table, writes JSON.

    python benchmarks/security.py [--rounds 10] [--reps 9] [--json benchmarks/results/security.json]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def hmac_throughput(nbytes: int, reps: int = 20) -> float:
    """GB/s of HMAC-SHA256 over ``nbytes`` on one core (median of ``reps``)."""
    data, key = os.urandom(nbytes), os.urandom(32)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        hmac.new(key, data, hashlib.sha256).digest()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def aead_throughput(nbytes: int, reps: int = 10) -> float:
    """GB/s of sealing and opening ``nbytes`` with the frame cipher on one core (median)."""
    import torch

    from geotrain.elastic.auth import FrameCipher

    cipher, x = FrameCipher(os.urandom(32)), torch.randn(nbytes // 4)
    y = torch.empty_like(x)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        cipher.open(b"ctx", cipher.seal(b"ctx", x), y)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times) / 1e9


class _NoCipher:
    """No cipher at all: the exchange without security. Sends a buffer of the sealed size, reused
    and never written (no copy, no page faults), and opens nothing: what remains is the transport."""

    _buffers: dict[int, object] = {}

    def __init__(self, key: bytes) -> None:
        pass

    def seal(self, context: bytes, data):  # type: ignore[no-untyped-def]
        import torch

        from geotrain.elastic.auth import sealed_size

        size = sealed_size(data.numel() * data.element_size())
        if size not in self._buffers:
            self._buffers[size] = torch.zeros(size, dtype=torch.uint8)
        return self._buffers[size]

    def open(self, context: bytes, sealed, into) -> bool:  # type: ignore[no-untyped-def]
        return True


def _exchange_worker(rank: int, store: str, run_key: str, gbps: float, nbytes: int, reps: int, out) -> None:  # type: ignore[no-untyped-def]
    import torch

    from geotrain.comm.emulate.inprocess import WanEmulator
    from geotrain.comm.topology import Topology
    from geotrain.config import Config
    from geotrain.elastic import exchange
    from geotrain.elastic.auth import RunKeys, SealedStore
    from geotrain.elastic.roundstore import Monitor, connect
    from geotrain.elastic.view import RoundView

    torch.set_num_threads(1)
    sites = [{"name": "A", "workers": 1}, {"name": "B", "workers": 1}]
    inter = {"bandwidth_bps": gbps * 1e9 if gbps else 1e12, "latency_s": 0.0}
    cfg = Config.model_validate({"topology": {"sites": sites, "links": {"inter": inter}}})
    topo = Topology.from_config(cfg.topology)
    wan = WanEmulator(topo, rank, run_key, "inprocess") if gbps else None
    keys = RunKeys(b"benchmark-secret-0123456789")
    site = "AB"[rank]
    shard = torch.randn(nbytes // 4)
    group, times = None, {"aead": [], "copy": []}
    real = exchange.FrameCipher
    for r in range(2 * reps + 1):
        kind = "aead" if r % 2 else "copy"
        exchange.FrameCipher = real if kind == "aead" else _NoCipher  # type: ignore[misc]
        other = "AB"[1 - rank]
        view = RoundView(key=f"k{r}", round_id=f"r{r}", admitted=["A", "B"], source="A", frame_keys={other: keys.payload})
        sealed = SealedStore(connect(store, keys.store, 30), keys, f"round/r{r}")
        monitor = Monitor(SealedStore(connect(store, keys.store, 30), keys, f"hb/r{r}"), site, ["AB"[1 - rank]], 0.5, 60)
        x = exchange.Exchange(
            view,
            site,
            0,
            ["A", "B"],
            wan,
            monitor,
            sealed,
            group,
            shard.clone(),
            None,
            lambda n: 300.0,
            300.0,
            lambda n: None,
            None,
        )
        t = time.perf_counter()
        x.start()
        assert x.wait() and x.error is None, x.error
        seconds = time.perf_counter() - t
        monitor.stop()
        group = x.group
        if r:  # round 0 creates the group
            times[kind].append(seconds)
    exchange.FrameCipher = real  # type: ignore[misc]
    if rank == 0:
        out.put({k: statistics.median(v) for k, v in times.items()})


def exchange_64mib(gbps: float, reps: int, nbytes: int = 64 << 20) -> dict[str, float]:
    """Median seconds of one elastic exchange of ``nbytes`` between two processes with the frame
    cipher and with none (``gbps`` 0: unpaced loopback)."""
    import multiprocessing as mp

    from geotrain.comm.authstore import AuthStoreServer
    from geotrain.elastic.auth import RunKeys

    server = AuthStoreServer("127.0.0.1", RunKeys(b"benchmark-secret-0123456789").store)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    run_key = f"bench-security-{os.getpid()}-{int(gbps)}"
    procs = [ctx.Process(target=_exchange_worker, args=(r, server.address, run_key, gbps, nbytes, reps, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = out.get(timeout=900)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        server.close()
        with contextlib.suppress(OSError):
            os.unlink(f"/dev/shm/geotrain-wan-{run_key}")
    return {"gbps": gbps, "with_s": got["aead"], "without_s": got["copy"], "overhead": got["aead"] / got["copy"] - 1}


def audit_costs(lines: int = 200) -> dict[str, float]:
    """Seconds per signed audit line (Ed25519 sign + append) and per line verified (whole chain),
    on a round record shaped like a 4-site secure-aggregation round; and one manifest HMAC."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from geotrain.privacy.audit import AuditChain, verify_chain
    from geotrain.run.checkpoint import Seal

    sites = ["A", "B", "C", "D"]
    record = {
        "kind": "round",
        "site": "A",
        "status": "committed",
        "participants": sites,
        "survivors": sites,
        "dropped": [],
        "epsilon": 1.234,
        "guard": "own update finite",
    }
    with tempfile.TemporaryDirectory() as tmp:
        chain = AuditChain(Path(tmp) / "audit.jsonl", Ed25519PrivateKey.generate(), "A")
        times = []
        for r in range(lines):
            t = time.perf_counter()
            chain.append({**record, "round": r})
            times.append(time.perf_counter() - t)
        chain.close({})
        t = time.perf_counter()
        checked = verify_chain(chain.path)
        verify_s = (time.perf_counter() - t) / (lines + 2)
        assert not checked.findings
    seal = Seal(os.urandom(32), "run")
    manifest = {"step": 1, "world_size": 64, "files": {f"rank{r}.pt": "0" * 64 for r in range(64)}, "run": "run"}
    t = time.perf_counter()
    for _ in range(100):
        seal.mac(manifest)
    return {
        "audit_sign_append_s": statistics.median(times),
        "audit_verify_s_per_line": verify_s,
        "manifest_hmac_s_64_ranks": (time.perf_counter() - t) / 100,
    }


def elastic_rounds(rounds: int, h: int) -> tuple[list[dict], dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        env = {**os.environ, "GEOTRAIN_SECRET": os.urandom(24).hex()}
        sets = [
            "elastic.enabled=true",
            "run.baseline=none",
            "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}]",
            f"sync.H={h}",
            f"train.steps={rounds * h}",
            "train.eval_every=0",
            "train.save_final=false",
        ]
        cmd = [sys.executable, "-m", "geotrain", "train", "--out", str(out)]
        for s in sets:
            cmd += ["--set", s]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode:
            raise SystemExit(proc.stdout[-2000:] + proc.stderr[-2000:])
        recs = [json.loads(x) for x in (out / "elastic" / "rounds-A.jsonl").read_text().splitlines() if x.strip()]
        summary = json.loads((out / "summary.json").read_text())
    return [r for r in recs if r["outcome"] == "committed"], summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--h", type=int, default=20)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    exchanges = [exchange_64mib(g, args.reps) for g in (1.0, 10.0, 0.0)]
    recs, summary = elastic_rounds(args.rounds, args.h)
    params = int(summary["params"]) if "params" in summary else None
    shares = [(r["seal_s"] + r["open_s"]) / r["exchange_s"] for r in recs if r.get("exchange_s")]
    result = {
        "setup": "elastic exchange, 2 sites x 1 worker; frames sealed with AES-256-GCM in 4 MiB pieces (1 MiB chunks) under a key per pair of sites and round",
        "exchange_64mib": exchanges,
        "target_overhead_64mib": 0.05,
        "params": params,
        "rounds_committed": len(recs),
        "median_exchange_s": statistics.median(r["exchange_s"] for r in recs),
        "median_seal_s": statistics.median(r["seal_s"] for r in recs),
        "median_open_s": statistics.median(r["open_s"] for r in recs),
        "median_crypto_share": statistics.median(shares),
        "max_crypto_share": max(shares),
        "aes_gcm_seal_open_gbps_one_core": aead_throughput(64 << 20),
        "hmac_sha256_gbps_one_core": hmac_throughput(4 * (params or 800_000)),
        **audit_costs(),
    }
    result["audit_sign_share_of_exchange"] = result["audit_sign_append_s"] / result["median_exchange_s"]
    rows = [
        (
            "64 MiB exchange at " + ("loopback" if e["gbps"] == 0 else f"{e['gbps']:g} Gbit/s"),
            f"{e['with_s']:.3f} s encrypted vs {e['without_s']:.3f} s plain: {e['overhead']:+.1%} (target <= +5%)",
        )
        for e in exchanges
    ]
    rows += [
        ("default run: params (fp32 pseudo-gradient)", f"{params:,}" if params else "?"),
        ("rounds committed", str(result["rounds_committed"])),
        ("median exchange s / round", f"{result['median_exchange_s']:.4f}"),
        ("median seal s, open s / round", f"{result['median_seal_s']:.4f}, {result['median_open_s']:.4f}"),
        (
            "seal + open / exchange (median, max)",
            f"{result['median_crypto_share']:.2%}, {result['max_crypto_share']:.2%}",
        ),
        ("AES-256-GCM seal + open, one core", f"{result['aes_gcm_seal_open_gbps_one_core']:.2f} GB/s"),
        ("HMAC-SHA256 one core", f"{result['hmac_sha256_gbps_one_core']:.2f} GB/s"),
        (
            "audit line: Ed25519 sign + append",
            f"{result['audit_sign_append_s'] * 1e6:.0f} us ({result['audit_sign_share_of_exchange']:.3%} of the exchange)",
        ),
        ("audit verify, per line", f"{result['audit_verify_s_per_line'] * 1e6:.0f} us"),
        ("checkpoint manifest HMAC (64 ranks)", f"{result['manifest_hmac_s_64_ranks'] * 1e6:.0f} us"),
    ]
    width = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"{a:<{width}}  {b}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
