"""What the sites' round records say: every round committed, rolled back or split, whether
every committed round count maps to one global model, the time failures cost the survivors,
and one merged summary of an elastic run.

Each site's local rank 0 appends one JSON line per round to ``OUT/elastic/rounds-<site>.jsonl``
(kept across incarnations, so the record survives kills); finished sites write
``OUT/elastic/summary-<site>.json``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from geotrain.comm.topology import REGION, Topology


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One round's record, one JSON line (a site's local rank 0, after the round's outcome)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def drain_file(out: Path, site: str) -> Path:
    """The request that drains ``site`` right after its next committed round (migration: SIGUSR1 to
    `geotrain site`, or fault.migrate); its local rank 0 reads it there and removes it."""
    return out / "elastic" / f"drain-{site}"


def read_rounds(out: Path) -> dict[str, list[dict[str, Any]]]:
    """Every site's round records (all incarnations), in order."""
    logs = {}
    for f in sorted((out / "elastic").glob("rounds-*.jsonl")):
        logs[f.stem.removeprefix("rounds-")] = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return logs


def round_outcomes(logs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """What the sites' records say about every round: committed, rolled back, split, and whether
    every committed round count maps to one global model (``consistent``; in two tiers, after a
    region round, one model per region)."""
    by_key: dict[str, set[str]] = {}
    hashes: dict[tuple[int, str], set[str]] = {}
    for recs in logs.values():
        for r in recs:
            if r.get("key"):
                by_key.setdefault(r["key"], set()).add(r["outcome"])
            if r["outcome"] == "committed":
                scope = r.get("region", "") if _region_round(r) else ""
                hashes.setdefault((r["committed"], scope), set()).add(r["hash"])
    committed = sum(1 for o in by_key.values() if o == {"committed"})
    rolled = sum(1 for o in by_key.values() if o == {"rolled_back"})
    return {
        "rounds": len(by_key),
        "committed": committed,
        "rolled_back": rolled,
        "split": len(by_key) - committed - rolled,
        "consistent_history": all(len(h) == 1 for h in hashes.values()),
    }


def _region_round(r: dict[str, Any]) -> bool:
    """Whether a round record of two tiers is a region round (its wire part: 2 x fragment + tier)."""
    return bool(r.get("part", 1) % 2 == REGION)


def seconds_lost(logs: dict[str, list[dict[str, Any]]]) -> float:
    """Wall time the surviving sites lost to failures (mean over sites): the whole of every
    rolled-back round (its inner steps are discarded) plus quorum waits beyond the usual (in two
    tiers, the usual of the round's tier: a world round follows its region round at once, so its
    quorum forms sooner)."""
    per_site = []
    for recs in logs.values():
        if not recs:
            continue
        waits: dict[Any, list[float]] = {}
        for r in recs:
            if r["outcome"] == "committed":
                waits.setdefault(r.get("part"), []).append(r.get("quorum_s", 0.0))
        usual = {tier: statistics.median(w) for tier, w in waits.items()}
        lost = 0.0
        for prev, r in zip(recs, recs[1:], strict=False):
            if r["outcome"] == "rolled_back":
                lost += r["end"] - prev["end"]
            else:
                lost += max(0.0, r.get("quorum_s", 0.0) - usual.get(r.get("part"), 0.0))
        per_site.append(lost)
    return statistics.mean(per_site) if per_site else 0.0


def useful_steps(logs: dict[str, list[dict[str, Any]]], tiers: bool = False) -> dict[str, int]:
    """Per site, the inner steps whose work a committed round took in: walking a site's records,
    a committed round of the lowest tier (the region's in two tiers) takes in its steps since the
    site's previous round of that tier; a rolled-back one discards them, and a heal replaces them
    with its source's state (a world round of two tiers that fails loses nothing: its regions
    have committed that work). Streaming DiLoCo's fragment rounds come every H/F steps, so a
    failed fragment costs H/F steps: its fragment's share of H steps of work."""
    useful: dict[str, int] = {}
    for site, recs in logs.items():
        done = last = 0
        for r in recs:
            if site in r.get("healers", []):
                last = r["step"]
            elif tiers and not _region_round(r):
                continue
            elif r["outcome"] == "committed":
                done, last = done + max(0, r["step"] - last), r["step"]
            else:
                last = r["step"]
        useful[site] = done
    return useful


def round_seconds(logs: dict[str, list[dict[str, Any]]]) -> float:
    """Median wall time of one committed round (inner steps + exchange), over all sites."""
    spans = [
        r["end"] - prev["end"]
        for recs in logs.values()
        for prev, r in zip(recs, recs[1:], strict=False)
        if r["outcome"] == "committed"
    ]
    return statistics.median(spans) if spans else 0.0


def _unique_events(summaries: Any) -> list[dict[str, Any]]:
    """The guard events of every site, once each (a healed site carries its source's record too)."""
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for s in summaries:
        for e in s.get("guard_events", []):
            seen.setdefault((e["round"], e["fragment"], e["site"]), e)
    return sorted(seen.values(), key=lambda e: (e["round"], e["site"]))


def attribute_failures(
    failures: list[dict[str, Any]], events: list[dict[str, Any]], logs: dict[str, list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """For each injected fault (``site``, ``kind``, ``injected_at``): when the survivors first acted on
    it (``detection_seconds``: a detection event, a round with the site in it rolled back, or a
    quorum without it), when a quorum first left it out (``excluded_after_seconds``) and when its
    next incarnation healed (``healed_after_seconds``); None where that did not happen. Seconds
    are counted from the fault. ``events``: the sites' ``detected`` entries; ``logs``:
    :func:`read_rounds`."""
    rounds = [(r, r["start"] + r.get("quorum_s", 0.0)) for recs in logs.values() for r in recs]  # with its quorum time
    detected = []
    ordered = sorted(failures, key=lambda x: x["injected_at"])
    for i, fail in enumerate(ordered):
        t, site = fail["injected_at"], fail["site"]
        # the fault's episode ends when its site heals (a quorum with its next incarnation as a
        # healer) or at its next fault: a site restarted fast enough to heal in the very next
        # round was never excluded, and a later round rolled back for another site's fault is not
        # this one's
        nxt = next((f["injected_at"] for f in ordered[i + 1 :] if f["site"] == site), float("inf"))
        healed = [q for r, q in rounds if t <= q < nxt and site in r.get("healers", [])]
        until = min([nxt, *healed])
        seen = [e["time"] - t for e in events if e["site"] == site and t <= e["time"] < until]
        seen += [  # a round with the site in it that failed after the fault: the survivors noticed
            r["end"] - t
            for r, _ in rounds
            if r["outcome"] == "rolled_back" and t <= r["end"] < until and site in r.get("admitted", [])
        ]
        excluded = [q - t for r, q in rounds if t <= q < until and site not in r.get("admitted", [site])]
        seen += excluded  # a quorum without it: the survivors have acted on the failure
        detected.append(
            {
                "site": fail["site"],
                "kind": fail["kind"],
                **({"step": fail["step"]} if "step" in fail else {}),
                "detection_seconds": min(seen) if seen else None,
                "excluded_after_seconds": min(excluded) if excluded else None,
                "healed_after_seconds": min(healed) - t if healed else None,
            }
        )
    return detected


def merge_summaries(
    out: Path, topo: Topology, failures: list[dict[str, Any]], heartbeat_timeout_s: float, wall: float
) -> dict[str, Any] | None:
    """One run summary from the finished sites' summaries, their round logs and the failures."""
    finished = {}
    for name in topo.site_names:
        f = out / "elastic" / f"summary-{name}.json"
        if f.exists():
            finished[name] = json.loads(f.read_text())
    if not finished:
        return None
    logs = read_rounds(out)
    events = [e for s in finished.values() for e in s.get("detected", [])]
    detected = attribute_failures(failures, events, logs)
    first = finished[next(iter(finished))]
    hashes = {name: s["global_param_hash"][name] for name, s in finished.items()}
    outcomes = round_outcomes(logs)
    lost = seconds_lost({k: v for k, v in logs.items() if k in finished})
    return {
        **first,
        "sites": list(topo.site_names),
        "survivors": list(finished),
        # each site's guard judges its own updates (sync.guard): the run's rejections are their union
        "guard_rejections": {k: v for s in finished.values() for k, v in s.get("guard_rejections", {}).items() if v},
        "guard_events": _unique_events(finished.values()),
        "world_size": topo.world_size,
        # each site's own tokens (sites of different sizes or paces differ); a site that healed counts
        # from its source's step, as if it had trained the steps it missed (nominal)
        "tokens": sum(s["tokens"] for s in finished.values()),
        "steps": max(s["steps"] for s in finished.values()),
        "rounds": outcomes["rounds"],
        "rounds_committed": max(s["rounds_committed"] for s in finished.values()),
        "rounds_rolled_back": outcomes["rolled_back"],
        "rounds_split": outcomes["split"],
        "consistent": outcomes["consistent_history"] and len(set(hashes.values())) == 1,
        "failures": detected,
        "seconds_lost": lost,
        "round_seconds": round_seconds(logs),
        "heartbeat_timeout_s": heartbeat_timeout_s,
        "global_param_hash": hashes,
        "hashes_agree_within_sites": all(s["hashes_agree_within_sites"] for s in finished.values()),
        "inter_site_bytes": sum(s["inter_site_bytes"] for s in finished.values()),
        "inter_region_bytes": sum(s.get("inter_region_bytes", 0) for s in finished.values()),
        "intra_site_bytes": sum(s["intra_site_bytes"] for s in finished.values()),
        "wall_seconds": wall,
        "per_site": {
            name: {
                **{k: s[k] for k in ("steps", "rounds", "rounds_committed", "started_at_step", "final_eval_loss")},
                "epsilon": s.get("epsilon"),  # site-level DP: each site's own accountant
            }
            for name, s in finished.items()
        },
        "per_rank": [r for s in finished.values() for r in s["per_rank"]],
    }
