"""Cost of authenticating the cross-site payload in elastic mode, measured inside real rounds.

Runs ``geotrain train`` in elastic mode with the default model and links (2 sites x 1 worker,
1 Gbit/s between sites), then reads every committed round's record: ``exchange_s`` (healing +
ring all-reduce of the pseudo-gradient, on the emulated link) and ``mac_s`` (time this rank spent
computing and checking the frames' HMAC-SHA256 in that round, measured in the same round) and
``mac_verify_s`` (its part checking received frames, after they arrived: on the critical path;
the outgoing MACs are computed while the frame is in flight). Also
times HMAC-SHA256 alone on the default pseudo-gradient (one core), one signed audit line (Ed25519
sign + append), verifying a chain per line, and one checkpoint manifest HMAC. Prints a table,
writes JSON.

    python benchmarks/security.py [--rounds 10] [--json benchmarks/results/security.json]
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    recs, summary = elastic_rounds(args.rounds, args.h)
    params = int(summary["params"]) if "params" in summary else None
    shares = [r["mac_s"] / r["exchange_s"] for r in recs if r.get("exchange_s")]
    exposed = [r["mac_verify_s"] / r["exchange_s"] for r in recs if r.get("exchange_s")]
    result = {
        "setup": "elastic DiLoCo, default model and links (2 sites x 1 worker, 1 Gbit/s inter-site), HMAC-SHA256 per frame",
        "params": params,
        "rounds_committed": len(recs),
        "median_exchange_s": statistics.median(r["exchange_s"] for r in recs),
        "median_mac_s": statistics.median(r["mac_s"] for r in recs),
        "median_mac_share": statistics.median(shares),
        "max_mac_share": max(shares),
        "median_verify_s": statistics.median(r["mac_verify_s"] for r in recs),
        "median_verify_share": statistics.median(exposed),
        "max_verify_share": max(exposed),
        "target_share": 0.05,
        "hmac_sha256_gbps_one_core": hmac_throughput(4 * (params or 800_000)),
        **audit_costs(),
    }
    result["audit_sign_share_of_exchange"] = result["audit_sign_append_s"] / result["median_exchange_s"]
    rows = [
        ("params (fp32 pseudo-gradient)", f"{params:,}" if params else "?"),
        ("rounds committed", str(result["rounds_committed"])),
        ("median exchange s / round", f"{result['median_exchange_s']:.4f}"),
        ("median MAC s / round", f"{result['median_mac_s']:.4f}"),
        (
            "all MAC work / exchange (median, max)",
            f"{result['median_mac_share']:.2%}, {result['max_mac_share']:.2%}",
        ),
        ("median verify s / round", f"{result['median_verify_s']:.4f}"),
        (
            "verify (critical path) / exchange",
            f"median {result['median_verify_share']:.2%}, max {result['max_verify_share']:.2%} (target <= 5%)",
        ),
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
