"""Asynchronous quorum rounds in elastic mode (``sync.quorum`` with ``elastic.enabled``,
geotrain/round/membership.py): no syncer; a round holds the sites that asked in time, and a slow site's
late update counts in its next round, discounted. The healing and end rules as pure functions,
the progress stores over real sockets, and real runs on 127.0.0.1: a slow site never holds the
others up and every site ends on one model, with a site killed and restarted too."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from geotrain.comm.authstore import AuthStoreServer
from geotrain.config import load_config
from geotrain.elastic.auth import RunKeys
from geotrain.elastic.progress import Progress
from geotrain.elastic.roundstore import Stores
from geotrain.elastic.view import Member, RoundView, late_by, nothing_to_do
from geotrain.errors import ElasticTimeout
from tests.helpers import read_summary, train_cli
from tests.test_elastic import records, told

THREE = "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}]"
# C runs at a tenth of A's and B's speed: A and B hold several rounds while C runs one
SLOW = "topology:\n  sites: [{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1, compute_speed: 0.1}]\n"
BASE = ["elastic.enabled=true", "sync.quorum={sites: 2}", "sync.H=10", "train.eval_every=0", "run.baseline=none"]


def test_a_late_site_is_one_that_missed_committed_rounds_alive() -> None:
    """late_by: a healer behind its source by s committed rounds is late by s (its update still
    counts); a restarted site, a site on the source's model and one on another model of the same
    round count are not late."""
    members = [
        Member("A", "a", 7, "h7"),
        Member("B", "b", 7, "h7"),
        Member("C", "c", 4, "h4"),
        Member("D", "d", 0, "h0", joining=True),
    ]
    view = RoundView(members=members, admitted=["A", "B", "C", "D"], source="A", healers=["C", "D"])
    assert [late_by(view, s) for s in "ABCD"] == [0, 0, 3, 0]
    members[1] = Member("B", "b", 7, "split")
    view.healers = ["B", "C", "D"]
    assert late_by(view, "B") == 0


def test_a_round_of_finished_sites_on_one_model_is_not_held() -> None:
    done = [Member("A", "a", 5, "h", done=True), Member("B", "b", 5, "h", done=True)]
    assert nothing_to_do(done)
    assert not nothing_to_do([*done, Member("C", "c", 3, "g")])  # C still trains
    assert not nothing_to_do([done[0], Member("B", "b", 4, "g", done=True)])  # B has a model to heal
    assert not nothing_to_do([done[0], Member("B", "b", 0, "", joining=True, done=True)])
    assert not nothing_to_do([])


@pytest.mark.timeout(60)
def test_progress_is_read_from_each_sites_own_store_and_a_dead_store_is_a_gone_site() -> None:
    """Each site writes its progress into its own store; a finished site reads the others': it
    may leave once every site whose store answers has run its steps on its model. A store that
    does not answer is a site that died; no change for wait_timeout_s is an ElasticTimeout."""
    keys = RunKeys(b"s" * 32)
    servers = {s: AuthStoreServer("127.0.0.1", keys.store) for s in "ABC"}
    stores = {s: Stores(keys.store, 2.0) for s in "ABC"}
    prog = {s: Progress(keys, stores[s], s, ["A", "B", "C"], servers[s].address, 3.0, lambda _: None) for s in "ABC"}
    try:
        entries = [Member(s, servers[s].address, 0, "") for s in "ABC"]
        for p in prog.values():
            p.saw(entries)
        prog["A"].publish(True, 9, "h")
        prog["B"].publish(True, 9, "h")
        prog["C"].publish(False, 6, "g")
        assert prog["B"].read("A") == {"done": True, "committed": 9, "hash": "h"}
        assert not prog["A"].all_done(9, "h")  # C still trains
        prog["C"].publish(True, 8, "g")
        assert not prog["A"].all_done(9, "h")  # C has run its steps but holds an older model
        prog["C"].publish(True, 9, "h")
        assert prog["A"].all_done(9, "h")
        servers["C"].close()  # C dies with its store: A no longer waits for it
        prog["B"].publish(True, 10, "i")
        assert not prog["A"].all_done(9, "h")  # (B moved on: A heals first)
        assert prog["A"].read("C") is None
        assert prog["A"].all_done(10, "i")
        prog["B"].publish(False, 10, "i")
        prog["A"].all_done(10, "i")
        with pytest.raises(ElasticTimeout, match="no other site progressed"):
            for _ in range(100):  # B's progress stays as it is for more than 3 s
                prog["A"].all_done(10, "i")
                time.sleep(0.05)
    finally:
        for s in "AB":
            servers[s].close()
        for st in stores.values():
            st.close()


def test_elastic_quorum_rounds_load_and_a_quorum_below_a_majority_is_refused() -> None:
    cfg = load_config(None, [THREE, *BASE])
    assert cfg.elastic_rounds.min_sites == 2 and cfg.lighthouse_join_s == 0.0
    with pytest.raises(ValueError, match=r"^sync.quorum.sites: elastic rounds need more than half of the sites \(2 of 3\)"):
        load_config(None, [THREE, *BASE, "sync.quorum={sites: 1}"])
    load_config(None, [THREE, *BASE, "sync.algorithm=streaming"])  # (Streaming's fragments in quorum rounds too)
    with pytest.raises(ValueError, match="^sync.eager: the eager variant leaves each site on its own global model"):
        load_config(None, [THREE, *BASE, "sync.algorithm=streaming", "sync.eager=true"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_quorum_of_every_site_is_lock_step_elastic_rounds_bit_for_bit(tmp_path: Path) -> None:
    """With quorum.sites = every site each round holds all of them on time, so the sum is divided
    by the same world weight and the delayed momentum is one plain outer step: the run ends on
    the lock-step elastic run's model, bit for bit (a divisor or momentum of the site's own world,
    one site, would not)."""
    runs = {}
    for name, extra in (("lockstep", []), ("quorum", ["sync.quorum={sites: 3}"])):
        train_cli(tmp_path / name, [THREE, "elastic.enabled=true", "sync.H=10", "train.eval_every=0", "train.steps=30", *extra])
        runs[name] = read_summary(tmp_path / name)
    assert runs["quorum"]["global_param_hash"] == runs["lockstep"]["global_param_hash"]
    assert runs["quorum"]["final_eval_loss"] == runs["lockstep"]["final_eval_loss"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_slow_site_never_holds_the_others_up_and_its_late_updates_count(tmp_path: Path) -> None:
    """Issue 41's pair, int8 on the wire: C runs at a tenth of the speed of A and B. A and B hold
    rounds of two without waiting for C; C's updates, computed from older global models, count in
    its next rounds with their staleness discount (C heals only the global model in them); every
    site ends on one model."""
    out = tmp_path / "run"
    train_cli(out, [*BASE, "sync.codec=int8", "train.steps=60"], SLOW)
    s = read_summary(out)
    assert s["survivors"] == ["A", "B", "C"] and s["consistent"], told(out)
    assert len(set(s["global_param_hash"].values())) == 1, told(out)
    a, c = records(out, "A"), records(out, "C")
    assert sum(r["outcome"] == "committed" and "C" not in r["admitted"] for r in a) >= 3, told(out)
    late = [r for r in c if r["outcome"] == "committed" and r.get("late")]
    assert late, told(out)
    # C's update counted, discounted: the round's weight is below its contributors' count (on time: 1 each)
    assert all(r["weight"] < r["contributors"] for r in late), told(out)
    logs = (out / "logs").glob("*.log")
    assert any("this site's update was late" in f.read_text() for f in logs)
    assert s["compression_ratio"] > 1.2  # int8 updates; the heals that bring C the global model cross whole, in fp32


SLOW_FSDP = SLOW.replace("workers: 1", "workers: 2")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["replicate", "fsdp"])
def test_elastic_quorum_rounds_a_site_killed_and_restarted_heals_and_all_end_on_one_model(tmp_path: Path, layout: str) -> None:
    """B is SIGKILLed mid-run: A and the slow C go on in rounds of two; B's new incarnation heals
    the whole state from a live site, and every site ends on one model. Under FSDP (two workers
    a site, SparseLoCo across sites) each rank heals its own shards, a late site's global shards
    included."""
    out = tmp_path / "run"
    extra = ["sync.within_site=fsdp", "sync.codec=sparseloco"] if layout == "fsdp" else []
    train_cli(
        out,
        [*BASE, *extra, "train.steps=60", 'fault.kill=["B@25"]', "fault.restart_after=0.5"],
        SLOW_FSDP if layout == "fsdp" else SLOW,
    )
    s = read_summary(out)
    assert s["survivors"] == ["A", "B", "C"] and s["consistent"], told(out)
    assert len(set(s["global_param_hash"].values())) == 1, told(out)
    assert s["hashes_agree_within_sites"]
    assert any("healed from" in f.read_text() for f in (out / "logs").glob("*.1.log")), told(out)
