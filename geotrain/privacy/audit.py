"""A record of rounds that cannot be quietly rewritten: each site's audit log is a hash chain of
JSON lines, every line signed by that site (Ed25519, ``cryptography``).

A line is ``{"seq": n, "prev": sha256 of line n-1, ...the record..., "sig": Ed25519 over the rest}``
(keys sorted, so the signed bytes are canonical). Line 0 (``kind: genesis``) names the site and its
public key; round lines (``kind: round``) follow, one per aggregation, committed or rolled back;
the last line (``kind: end``) closes the chain when the site finishes. Each site keeps its own
key (``<dir>/<site>.key``, mode 0600, reused by later runs in the same place; ``<site>.pub`` is
the public half to publish).

:func:`verify_logs` checks every chain on its own — a line whose signature fails is *altered*
(it fills a hole in the sequence) or *forged* (it does not); a missing sequence number is a
*removed* line; a line whose number is below one already seen is *reordered*; a signed line
that does not link to its predecessor came from another chain (*forged*); a chain without its
closing line was *truncated* (or its site stopped early) — and then the sites' agreement on each
round's outcome (status, participants, survivors, ε). Pinning the public keys (``--keys``) also
catches a chain rewritten from scratch under a new key.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from geotrain.comm.identity import public_hex, site_key

__all__ = ["AuditChain", "public_hex", "site_key", "verify_chain", "verify_dir", "verify_logs"]

GENESIS_PREV = "0" * 64
AGREED = ("status", "participants", "survivors", "epsilon")  # what every site must record alike per round


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _line_hash(line: str) -> str:
    return hashlib.sha256(line.encode()).hexdigest()


class AuditChain:
    """One site's signed audit log.

    A run that starts fresh replaces any old file at ``path`` with a new chain whose genesis line
    carries the run's ``nonce`` (agreed by every site, so a log of another run signed with the
    same key shows). A run resumed from a checkpoint carries its chain on (:meth:`begin`): a
    ``resume`` line after what the interrupted run wrote, and every later round record marked
    with the attempt (0, then 1, 2, ... per resume), since the rounds after the checkpoint are
    done again. ``start=False``: nothing is written until :meth:`begin`.
    """

    def __init__(
        self, path: Path, key: Ed25519PrivateKey, site: str, run: str | None = None, nonce: str | None = None, start: bool = True
    ) -> None:
        self.path, self.key, self.site, self.run, self.nonce = path, key, site, run, nonce
        self.seq, self.prev = 0, GENESIS_PREV
        self.attempt = 0
        self.closed = False
        self.note = ""  # what begin() did, for the run's log
        if start:
            self.begin()

    def begin(self, resumed_at: int = 0) -> None:
        """Start the chain: fresh, or (``resumed_at`` > 0) carried on from the file if it is this
        site's intact chain of this key; one that is not is kept beside as ``.replaced``."""
        if resumed_at > 0 and self.path.exists():
            chain = verify_chain(self.path, {self.site: public_hex(self.key)})
            problems = [f for f in chain.findings if f.problem != "truncated"]  # a crash leaves no closing line
            lines = self.path.read_text().splitlines()
            if not problems and chain.site == self.site and lines:
                last = json.loads(lines[-1])
                genesis = json.loads(lines[0])
                self.seq, self.prev = int(last["seq"]) + 1, _line_hash(lines[-1])
                self.nonce = genesis.get("nonce")
                self.attempt = 1 + sum(1 for x in lines if json.loads(x).get("kind") == "resume")
                self.append({"kind": "resume", "site": self.site, "attempt": self.attempt, "at_step": resumed_at})
                self.note = f"audit log carried on (attempt {self.attempt}, after step {resumed_at})"
                return
            kept = self.path.with_name(self.path.name + ".replaced")
            os.replace(self.path, kept)
            self.note = f"audit log not carried on ({'; '.join(map(str, problems)) or 'not this site'}): kept as {kept.name}"
        self.path.unlink(missing_ok=True)
        self.append(
            {"kind": "genesis", "site": self.site, "public_key": public_hex(self.key), "run": self.run, "nonce": self.nonce}
        )

    def append(self, record: dict[str, Any]) -> None:
        body = {**record, "seq": self.seq, "prev": self.prev}
        line = json.dumps({**body, "sig": self.key.sign(_canonical(body)).hex()}, sort_keys=True)
        with self.path.open("a") as f:
            f.write(line + "\n")
        self.seq, self.prev = self.seq + 1, _line_hash(line)

    def close(self, summary: dict[str, Any]) -> None:
        """The closing line (``kind: end``); once: later calls do nothing."""
        if not self.closed:
            self.append({"kind": "end", "site": self.site, **summary})
            self.closed = True


@dataclass
class Finding:
    file: str
    line: int  # 1-based line number in the file (0: the file as a whole)
    problem: str  # removed | reordered | altered | forged | truncated | disagreement | unreadable
    detail: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.problem}: {self.detail}"


@dataclass
class Chain:
    """What one file holds once checked: its site, key, findings and the round lines that verify."""

    file: str
    site: str | None = None
    public_key: str | None = None
    findings: list[Finding] = field(default_factory=list)
    rounds: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (line number, record)
    ended: str | None = None  # the closing line's outcome: completed, or failed with the error
    nonce: str | None = None  # the run's nonce in the genesis line (None in logs from before it)


def _signed_ok(pub: Ed25519PublicKey, rec: dict[str, Any]) -> bool:
    body = {k: v for k, v in rec.items() if k != "sig"}
    try:
        pub.verify(bytes.fromhex(str(rec.get("sig", ""))), _canonical(body))
        return True
    except (InvalidSignature, ValueError):
        return False


def verify_chain(path: Path, trusted: dict[str, str] | None = None) -> Chain:
    """Check one site's chain (``trusted``: site -> pinned public key hex; the site is the one its
    genesis line names)."""
    chain = Chain(path.name)
    report = chain.findings.append
    lines = path.read_text().splitlines()
    parsed: list[dict[str, Any] | None] = []
    for line in lines:
        try:
            rec = json.loads(line)
            parsed.append(rec if isinstance(rec, dict) else None)
        except ValueError:
            parsed.append(None)
    genesis = next((r for r in parsed if r is not None and r.get("kind") == "genesis"), None)
    claimed = str(genesis.get("public_key", "")) if genesis is not None else None
    chain.site = str(genesis.get("site")) if genesis is not None else None
    chain.nonce = str(genesis["nonce"]) if genesis is not None and genesis.get("nonce") is not None else None
    pinned = (trusted or {}).get(chain.site) if chain.site is not None else None
    key_hex = pinned or claimed
    if pinned is not None and claimed is not None and claimed != pinned:
        report(Finding(path.name, 1, "forged", f"signed by key {claimed[:16]}..., the trusted key is {pinned[:16]}..."))
    try:
        pub = Ed25519PublicKey.from_public_bytes(bytes.fromhex(key_hex or ""))
    except ValueError:
        report(Finding(path.name, 0, "unreadable", "no genesis line with a valid public key: nothing can be verified"))
        return chain
    chain.public_key = key_hex
    valid: list[tuple[int, int, dict[str, Any], str]] = []  # (line number, seq, record, line hash)
    bad: list[tuple[int, dict[str, Any] | None]] = []
    for n, (line, rec) in enumerate(zip(lines, parsed, strict=True), start=1):
        if rec is not None and isinstance(rec.get("seq"), int) and _signed_ok(pub, rec):
            valid.append((n, rec["seq"], rec, _line_hash(line)))
        else:
            bad.append((n, rec))
    explained: set[int] = set()
    highest = -1
    for n, seq, _, _ in valid:  # file order must follow the sequence
        if seq <= highest:
            report(Finding(path.name, n, "reordered", f"seq {seq} comes after seq {highest}"))
        highest = max(highest, seq)
    by_seq: dict[int, tuple[int, dict[str, Any], str]] = {}
    for n, seq, rec, h in valid:
        if seq in by_seq:
            report(Finding(path.name, n, "forged", f"repeats seq {seq} of line {by_seq[seq][0]} (a replayed line)"))
            explained.add(n)
        else:
            by_seq[seq] = (n, rec, h)
    for seq in range(highest + 1):
        if seq in by_seq:
            n, rec, _ = by_seq[seq]
            before = by_seq.get(seq - 1)
            expected = GENESIS_PREV if seq == 0 else (before[2] if before else None)
            if expected is not None and rec.get("prev") != expected:
                report(Finding(path.name, n, "forged", f"seq {seq} does not link to line {before[0] if before else '?'}"))
            continue
        lo = by_seq[seq - 1][0] if seq - 1 in by_seq else 0
        hi = next((by_seq[s][0] for s in range(seq + 1, highest + 1) if s in by_seq), len(lines) + 1)
        hole = [n for n, rec in bad if lo < n < hi and n not in explained and (rec is None or rec.get("seq") in (seq, None))]
        if hole:
            explained.add(hole[0])
            report(Finding(path.name, hole[0], "altered", f"seq {seq} does not match its signature"))
        else:
            report(
                Finding(path.name, hi if hi <= len(lines) else len(lines), "removed", f"seq {seq} is missing before this line")
            )
    for n, _ in bad:
        if n not in explained:
            report(Finding(path.name, n, "forged", "not signed by this site's key"))
    last = by_seq.get(highest)
    if last is None or last[1].get("kind") != "end":
        n = last[0] if last else 0
        report(
            Finding(
                path.name, n, "truncated", "no closing line after this one: lines removed from the end, or the site stopped early"
            )
        )
    elif last[1].get("outcome") is not None:  # logs written before the outcome was recorded have none
        chain.ended = str(last[1]["outcome"]) + (f" ({last[1].get('error')})" if last[1].get("error") else "")
    chain.rounds = [(n, rec) for n, _, rec, _ in valid if rec.get("kind") == "round"]
    return chain


def verify_logs(files: list[Path], trusted: dict[str, str] | None = None) -> tuple[list[Chain], list[Finding]]:
    """Every chain in ``files`` checked on its own, then the sites' agreement on every round
    (``trusted``: site -> pinned public key). Returns the chains and all findings."""
    chains = [verify_chain(f, trusted) for f in sorted(files)]
    findings = [x for c in chains for x in c.findings]
    for site in sorted(set(trusted or {}) - {c.site for c in chains}):
        findings.append(Finding(site, 0, "removed", f"no audit log of site {site} (its key is pinned)"))
    nonces = {c.nonce for c in chains if c.nonce is not None}
    if len(nonces) > 1:  # every site's chain of one run starts with the run's one nonce
        ref = next(c for c in chains if c.nonce is not None)
        for c in chains:
            if c.nonce is not None and c.nonce != ref.nonce:
                why = f"a chain of another run (nonce {c.nonce[:12]}... vs {str(ref.nonce)[:12]}... in {ref.file})"
                findings.append(Finding(c.file, 1, "disagreement", why))
    seen: dict[tuple[int, int], list[tuple[Chain, int, dict[str, Any]]]] = {}
    for c in chains:
        for n, rec in c.rounds:  # a resumed run does the rounds after its checkpoint again: one attempt each
            seen.setdefault((int(rec["round"]), int(rec.get("attempt", 0))), []).append((c, n, rec))
    for (round_id, _attempt), recs in sorted(seen.items()):
        first_chain, first_n, first = recs[0]
        for c, n, rec in recs[1:]:
            differ = [k for k in AGREED if rec.get(k) != first.get(k)]
            if differ:
                detail = ", ".join(f"{k} {rec.get(k)!r} vs {first.get(k)!r} at {first_chain.file}:{first_n}" for k in differ)
                findings.append(Finding(c.file, n, "disagreement", f"round {round_id}: {detail}"))
    return chains, findings


def verify_dir(run_dir: Path, keys: Path | None = None) -> tuple[list[str], list[Finding]]:
    """``geotrain audit verify``: every ``audit*.jsonl`` in ``run_dir`` checked (``keys``: a JSON
    file of site -> pinned public key hex); the lines to print and the findings.

    Raises:
        ValueError: no audit log in ``run_dir``, or an unreadable ``keys`` file (one line).
    """
    files = sorted(run_dir.glob("audit*.jsonl"))
    if not files:
        raise ValueError(f"no audit*.jsonl in {run_dir}")
    trusted = None
    if keys is not None:
        try:
            trusted = json.loads(keys.read_text())
        except (OSError, ValueError):
            trusted = None
        if not isinstance(trusted, dict) or not all(isinstance(v, str) for v in trusted.values()):
            raise ValueError(f"--keys {keys}: not a JSON object of site -> public key hex")
    chains, findings = verify_logs(files, trusted)
    lines = [
        f"{c.file}: site {c.site}, "
        + (f"key {c.public_key[:16]}..." if c.public_key else "no key")
        + f", {len(c.rounds)} round lines verified"
        + (f", run {c.ended}" if c.ended else "")
        for c in chains
    ]
    lines += [str(f) for f in findings]
    if not findings:
        lines.append(f"audit verify: {len(chains)} chain(s) intact and in agreement")
    return lines, findings
