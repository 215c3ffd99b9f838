"""Two tiers in elastic mode (``elastic.enabled`` with ``sync.region_every``, the round engine, geotrain/round/):
region rounds and world rounds are elastic rounds. Real processes on 127.0.0.1: without failures
they end where lock-step tiers end, and a site of each region killed and restarted heals (from
its own region where a site of it is alive) and every site ends on one model."""

from __future__ import annotations

from pathlib import Path

import pytest

from geotrain.comm.topology import REGION, WORLD
from geotrain.elastic.view import Member, region_healers, whole_regions
from tests.helpers import read_summary, train_cli
from tests.test_elastic import records, told

# A alone in region us; B and C in region eu (A comes first by name: a source chosen over every
# site would often be A, so a site of eu that heals from A would show)
TIERS3 = (
    "topology:\n  sites: [{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}]\n"
    "  regions: [{name: us, sites: [A]}, {name: eu, sites: [B, C]}]\n"
)
BASE = ["sync.H=10", "sync.region_every=2", "train.eval_every=0"]


def test_a_site_heals_from_its_own_regions_source() -> None:
    """The healing rule: a region's sites heal from the region's source; a region with no valid
    site heals from the round's source."""
    region = {"A": "us", "B": "eu", "C": "eu", "D": "us"}
    members = [
        Member("A", "a", 4, "h-us"),
        Member("B", "b", 4, "h-eu"),
        Member("C", "c", 0, "h0", joining=True),
        Member("D", "d", 0, "h0", joining=True),
    ]
    healers, sources = region_healers(members, "A", ["A", "B", "C", "D"], region)
    assert healers == ["C", "D"] and sources == {"C": "B", "D": "A"}
    # a region whose only valid site is behind (it missed a commit) heals from the round's source
    members[1] = Member("B", "b", 3, "h-old")
    healers, sources = region_healers(members, "A", ["A", "B", "C", "D"], region)
    assert healers == ["B", "C", "D"] and sources == {"B": "A", "C": "A", "D": "A"}
    # sites that hold their region's model and the world's heal nobody
    members = [Member("A", "a", 4, "h-us"), Member("B", "b", 4, "h-eu"), Member("C", "c", 4, "h-eu")]
    assert region_healers(members, "A", ["A", "B", "C"], region) == ([], {})


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["replicate", "fsdp"])
def test_elastic_tiers_end_where_lock_step_tiers_end(tmp_path: Path, layout: str) -> None:
    """Without failures, elastic rounds in two tiers take the same steps as lock-step tiers: the
    same final loss, and the same bytes on the slow tier (frames add only their tags); region
    rounds sum over the region's sites only. Under FSDP (two workers a site) each rank carries
    its own shards in both tiers."""
    runs = {}
    topology = TIERS3 if layout == "replicate" else TIERS3.replace("workers: 1", "workers: 2")
    for elastic in ("true", "false"):
        out = tmp_path / elastic
        train_cli(out, [*BASE, "train.steps=40", f"elastic.enabled={elastic}", f"sync.within_site={layout}"], topology)
        runs[elastic] = read_summary(out)
    e, lock = runs["true"], runs["false"]
    assert e["final_eval_loss"] == pytest.approx(lock["final_eval_loss"], rel=1e-6)
    assert e["inter_region_bytes"] == pytest.approx(lock["inter_region_bytes"], rel=0.01)
    assert e["inter_site_bytes"] == pytest.approx(lock["inter_site_bytes"], rel=0.01)
    assert e["consistent"] and len(set(e["global_param_hash"].values())) == 1
    for site, region_sites in (("A", 1), ("B", 2)):
        recs = records(tmp_path / "true", site)
        assert [r["part"] for r in recs] == [REGION, REGION, WORLD] * 2
        assert [r["contributors"] for r in recs] == [region_sites, region_sites, 3] * 2


def _heals(out: Path, site: str) -> list[tuple[int, str]]:
    """(step, source) of each heal in ``site``'s restarted incarnations' logs."""
    found = []
    for log in sorted((out / "logs").glob("*.1.log")):
        for line in log.read_text().splitlines():
            if line.startswith(f"[{site}/0 ") and "healed from " in line:
                found.append((int(line.split("step ")[1].split("]")[0]), line.split("healed from ")[1].split(":")[0]))
    return found


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tiers_elastic_a_site_of_one_region_dies_and_comes_back(tmp_path: Path) -> None:
    """Issue 41's named test, int8 on the wire. C (region eu, with B) is SIGKILLed between a
    region round and the world round; its new incarnation heals from B, the live site of its
    region (A, of region us, holds another region model). Then A, alone in region us, is killed:
    no site of its region is alive, so it heals from a site of eu and its region restarts from
    the world model. Every site ends on one model."""
    out = tmp_path / "run"
    overrides = [*BASE, "elastic.enabled=true", "sync.codec=int8", "train.steps=160", 'fault.kill=["C@35", "A@55"]']
    train_cli(out, [*overrides, "fault.restart_after=0.5"], TIERS3)
    s = read_summary(out)
    assert s["survivors"] == ["A", "B", "C"] and s["consistent"], told(out)
    assert len(set(s["global_param_hash"].values())) == 1 and s["hashes_agree_within_sites"]
    assert [src for _, src in _heals(out, "C")] == ["B"], told(out)
    assert [src for _, src in _heals(out, "A")] in (["B"], ["C"]), told(out)
    a = records(out, "A")
    heal = next(r for r in a if "A" in r["healers"] and r["outcome"] == "committed")
    if heal["part"] == REGION:  # nothing of region us came into it: its model is the last world model
        # A was down for the world rounds it missed: read them from B, which lived throughout
        b = records(out, "B")
        world = [r for r in b if r["part"] == WORLD and r["outcome"] == "committed" and r["committed"] < heal["committed"]]
        assert heal["contributors"] == 0 and heal["hash"] == world[-1]["hash"], told(out)
    assert s["compression_ratio"] > 1.5  # int8 in both tiers' rounds


FOUR = (
    "topology:\n  sites: [{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}, {name: D, workers: 1}]\n"
    "  regions: [{name: eu, sites: [A, B, C]}, {name: us, sites: [D]}]\n"
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_secure_aggregation_masks_each_elastic_tier_over_the_sites_it_sums(tmp_path: Path) -> None:
    """Secure aggregation in elastic tiers: a region round's masks are drawn among the region's
    sites only (they cancel in its sum; D, alone in us, sums only its own update), a world
    round's among every site. The masked run ends where the plain one ends (fixed point), on one
    model, with the same bytes across regions."""
    runs = {}
    for name, extra in (("plain", []), ("masked", ["privacy.secure_aggregation=true"])):
        out = tmp_path / name
        train_cli(out, [*BASE, "train.steps=40", "elastic.enabled=true", *extra], FOUR)
        runs[name] = read_summary(out)
    plain, masked = runs["plain"], runs["masked"]
    assert masked["final_eval_loss"] == pytest.approx(plain["final_eval_loss"], rel=1e-4)
    assert masked["consistent"] and len(set(masked["global_param_hash"].values())) == 1
    assert masked["inter_region_bytes"] == pytest.approx(plain["inter_region_bytes"], rel=0.01)
    assert [r["contributors"] for r in records(tmp_path / "masked", "D")] == [1, 1, 4] * 2
    assert [r["contributors"] for r in records(tmp_path / "masked", "A")] == [3, 3, 4] * 2


PAIRS = (
    "topology:\n  sites: [{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}, {name: D, workers: 1}]\n"
    "  regions: [{name: eu, sites: [A, B]}, {name: us, sites: [C, D]}]\n"
)


def test_elastic_quorum_rounds_of_two_tiers_take_a_region_whole_and_a_world_round_every_region() -> None:
    """whole_regions: a region takes part in a quorum round whole or not at all (only its sites
    hold its model); where a region is not whole, only regions with a region claim (an even wire
    part) take part: one due for a world round (odd) or done (-1) waits for every region."""
    region = {"A": "eu", "B": "eu", "C": "us", "D": "us"}
    claims = {"A": 0, "B": 0, "C": 0, "D": 0}

    def members() -> list[Member]:
        return [Member(s, s.lower(), 3, "h", part=p) for s, p in claims.items()]

    assert whole_regions(members(), ["A", "B", "C"], region) == ["A", "B"]
    assert whole_regions(members(), ["A", "B", "C", "D"], region) == ["A", "B", "C", "D"]
    claims.update(A=1, B=-1)  # A claims a world round, B has run its steps: eu waits for a round of every region
    assert whole_regions(members(), ["A", "B", "D"], region) == []
    assert whole_regions(members(), ["A", "B", "C", "D"], region) == ["A", "B", "C", "D"]
    claims.update(A=0)  # A claims a region round: eu takes part whole, B (done) sits it out
    assert whole_regions(members(), ["A", "B", "D"], region) == ["A", "B"]
    # a region's source is then its member with the most committed rounds (all of it is there)
    ms = [Member("A", "a", 9, "h9"), Member("B", "b", 9, "h9"), Member("C", "c", 5, "h5"), Member("D", "d", 0, "", joining=True)]
    healers, sources = region_healers(ms, "A", ["A", "B", "C", "D"], region, whole=True)
    assert healers == ["D"] and sources == {"D": "C"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_elastic_quorum_rounds_in_two_tiers_run_each_region_on_its_own_and_end_on_one_model(tmp_path: Path) -> None:
    """Elastic quorum rounds (3 of 4) over two regions of two: a round holds whole regions (a site
    whose region mate is not in it waits for the next), world rounds hold every site, the round history is consistent,
    every site ends on one model and the eval loss falls; then with C killed and restarted."""
    base = [*BASE, "elastic.enabled=true", "sync.quorum={sites: 3}", "train.steps=120", "train.eval_every=40"]
    for name, extra in (("quiet", []), ("killed", ['fault.kill=["C@45"]', "fault.restart_after=0.5"])):
        out = tmp_path / name
        train_cli(out, [*base, *extra], PAIRS)
        s = read_summary(out)
        assert s["survivors"] == ["A", "B", "C", "D"] and s["consistent"], told(out)
        assert len(set(s["global_param_hash"].values())) == 1, told(out)
        a = [r for r in records(out, "A") if r["outcome"] == "committed"]
        whole = (["A", "B"], ["C", "D"], ["A", "B", "C", "D"])  # a region round holds whole regions
        assert all(r["admitted"] in whole for r in a if r["part"] == REGION), told(out)
        assert all(r["admitted"] == ["A", "B", "C", "D"] for r in a if r["part"] == WORLD), told(out)
        assert sum(r["part"] == WORLD for r in a) >= 2, told(out)
        curve = [p["eval_loss"] for p in s["runs"][0]["eval_curve"]]
        assert curve[-1] < curve[0], curve
    assert any("healed from D" in f.read_text() for f in (tmp_path / "killed" / "logs").glob("*.log")), told(out)
