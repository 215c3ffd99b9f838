"""Every combination of the 16 settings a lab turns on together: pairs and triples that each load
alone load together, but for the refusals docs/COMPOSE.md gives a reason of mathematics or physics
for; no refusal in the config says "yet"; and a seeded sample of 12 accepted triples runs end to
end with real processes, a site killed and restarted wherever the membership heals, every site
ending on one model with a finite eval loss below the first one."""

from __future__ import annotations

import itertools
import math
import os
import random
import re
from pathlib import Path

import pytest

from geotrain.config import load_config
from tests.helpers import REPO, read_summary, train_cli

# the 16 settings, each loading alone on three sites of two workers (tiers: four sites in two
# regions; a quorum of k of n sites with k > n / 2)
SETTINGS: dict[str, list[str]] = {
    "streaming": ["sync.algorithm=streaming"],
    "int8": ["sync.codec=int8"],
    "sparseloco": ["sync.codec=sparseloco"],
    "fsdp": ["sync.within_site=fsdp"],
    "elastic": ["elastic.enabled=true"],
    "quorum": ["sync.quorum={sites: 2}"],
    "tiers": ["sync.region_every=2"],
    "adapt": ["sync.adapt={target: 0.9}"],
    "pace": ["sync.pace=adaptive"],
    "unequal": [],
    "secagg": ["privacy.secure_aggregation=true"],
    "dp-example": ["privacy.dp.unit=example", "privacy.dp.noise_multiplier=1.0"],
    "checkpoint": ["checkpoint.every=50"],
    "muon": ["optim.name=muon"],
    "bf16": ["train.precision=bf16"],
    "compile": ["train.compile=true"],
}
CLASHES = [{"int8", "sparseloco"}]  # two codecs set one field: no pair


def topology(names: tuple[str, ...]) -> str:
    """The sites a combination runs on: three, or four in two regions with tiers; sites of 2, 1,
    1 (and 1) workers when unequal, else of two workers each."""
    n = 4 if "tiers" in names else 3
    workers = [2] + [1 if "unequal" in names else 2] * (n - 1)
    sites = ", ".join(f"{{name: {chr(65 + i)}, workers: {w}}}" for i, w in enumerate(workers))
    text = f"topology:\n  sites: [{sites}]\n"
    if "tiers" in names:
        text += "  regions: [{name: eu, sites: [A, B]}, {name: us, sites: [C, D]}]\n"
    return text


def overrides(names: tuple[str, ...]) -> list[str]:
    out = [o for n in names for o in SETTINGS[n]]
    if "quorum" in names and "tiers" in names:  # (k > n / 2 on four sites)
        out = [o.replace("sync.quorum={sites: 2}", "sync.quorum={sites: 3}") for o in out]
    return out


def refusal(names: tuple[str, ...]) -> str | None:
    """The config's one-line refusal of ``names`` together, or None if it loads."""
    from yaml import safe_load

    topo = safe_load(topology(names))["topology"]
    sites = "topology.sites=" + str(topo["sites"]).replace("'", "")
    regions = ["topology.regions=" + str(topo["regions"]).replace("'", "")] if "regions" in topo else []
    try:
        load_config(None, [sites, *regions, *overrides(names)])
    except ValueError as exc:
        return str(exc).splitlines()[-1]
    return None


def combinations(k: int) -> tuple[int, dict[tuple[str, ...], str]]:
    """How many combinations of ``k`` settings were tried (each of whose smaller combinations
    loads, and no two setting one field), and the refused ones with their one-line errors."""
    tried, refused = 0, {}
    smaller: dict[tuple[str, ...], str] = combinations(k - 1)[1] if k > 2 else {}
    for names in itertools.combinations(SETTINGS, k):
        if any(c <= set(names) for c in CLASHES) or any(sub in smaller for sub in itertools.combinations(names, k - 1)):
            continue
        tried += 1
        why = refusal(names)
        if why is not None:
            refused[names] = why
    return tried, refused


def documented(section: str) -> set[tuple[str, ...]]:
    """The combinations docs/COMPOSE.md lists as refused in ``section``, rows ``| `a` | `b` | ... | reason |``."""
    text = (REPO / "docs" / "COMPOSE.md").read_text()
    body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    rows = [row.split("|")[1:-2] for row in body.splitlines() if row.startswith("| `")]  # (the last cell: the reason)
    return {tuple(re.findall(r"`([\w-]+)`", "".join(cells))) for cells in rows}


def test_every_setting_loads_alone() -> None:
    assert {n: refusal((n,)) for n in SETTINGS} == dict.fromkeys(SETTINGS)


def test_refused_pairs_are_exactly_the_documented_ones_and_few() -> None:
    tried, refused = combinations(2)
    assert tried == 119
    assert set(refused) == documented("Pairs refused"), sorted(set(refused) ^ documented("Pairs refused"))
    assert len(refused) <= 8
    for why in refused.values():  # one line that starts with the field it names
        assert re.match(r"[a-z_.]+: \S", why) and "\n" not in why, why


def test_refused_triples_are_exactly_the_documented_ones_and_few() -> None:
    tried, refused = combinations(3)
    assert tried > 400, tried
    assert set(refused) == documented("Triples refused"), sorted(set(refused) ^ documented("Triples refused"))
    assert len(refused) <= 12
    text = (REPO / "docs" / "COMPOSE.md").read_text()
    assert f"**{tried} triples**" in text and f"**{len(refused)} of them**" in text


def test_no_refusal_in_the_config_says_yet() -> None:
    """A refusal gives its reason; "not combined ... yet" is debt, not a reason."""
    for f in sorted((REPO / "geotrain" / "config").glob("*.py")):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if re.search(r"\byet\b", line) and ("Error" in line or '"' in line):
                raise AssertionError(f"{f.name}:{i}: {line.strip()}")


def run_options(names: tuple[str, ...]) -> list[str]:
    """A short run of ``names`` together: 30 steps of H = 5 (two fragments, τ = 1), a site
    killed at step 12 and restarted where the membership heals it (elastic rounds, whose live sites
    wait for it; a hub's quorum rounds, which take it back), checkpoints every 10 steps."""
    out = [o.replace("checkpoint.every=50", "checkpoint.every=10") for o in overrides(names)]
    out += ["train.steps=30", "sync.H=5", "train.eval_every=0", "sync.fragments=2", "sync.tau=1"]
    if "adapt" in names:
        out = [o for o in out if not o.startswith("sync.adapt")] + ["sync.adapt={target: 0.9, H_min: 2, H_max: 20}"]
    hub = "quorum" in names and "elastic" not in names
    if ("elastic" in names or hub) and not (hub and "checkpoint" in names):  # (a checkpoint needs every rank alive)
        out += ['fault.kill=["B@12"]', "fault.restart_after=0.5"]
    if "elastic" in names and "quorum" not in names:
        out += [f"elastic.min_sites={4 if 'tiers' in names else 3}"]
    return out


SAMPLE_SEED = int(os.environ.get("GEOTRAIN_COMBINATION_SEED", "20261202"))


@pytest.mark.slow
@pytest.mark.timing  # (a killed site must come back before the others end)
@pytest.mark.timeout(1500)
def test_a_seeded_sample_of_accepted_triples_runs_end_to_end(tmp_path: Path) -> None:
    _, refused = combinations(3)
    _, refused_pairs = combinations(2)
    accepted = [
        t
        for t in itertools.combinations(SETTINGS, 3)
        if t not in refused
        and not any(c <= set(t) for c in CLASHES)
        and not any(p in refused_pairs for p in itertools.combinations(t, 2))
    ]
    sample = random.Random(SAMPLE_SEED).sample(accepted, 12)
    print(f"seed {SAMPLE_SEED}: " + "; ".join("+".join(t) for t in sample))
    for names in sample:
        out = tmp_path / "-".join(names)
        train_cli(out, run_options(names), topology(names), timeout=300)
        s = read_summary(out)
        hashes = set(s["global_param_hash"].values())
        curve = s["runs"][0]["eval_curve"]  # (the top level of the summary leaves the curve out)
        assert curve and math.isfinite(curve[0]["eval_loss"]), names
        first = curve[0]["eval_loss"]
        assert len(hashes) == 1 and s["hashes_agree_within_sites"], names
        assert s.get("consistent", True), names
        assert math.isfinite(s["final_eval_loss"]) and s["final_eval_loss"] < first, (names, first, s["final_eval_loss"])
