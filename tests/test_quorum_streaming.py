"""Streaming DiLoCo in asynchronous quorum rounds (sync.algorithm=streaming with sync.quorum):
each fragment's sync a delivery to the syncer, merged with a version of its own. Equal to
lock-step Streaming DiLoCo when the quorum is every site; a slow site's fragments are late and
never wait; a killed site comes back; every site ends on one model (real processes, Gloo on
127.0.0.1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from geotrain.config import load_config
from geotrain.launch.local import launch_local
from tests.helpers import TINY

STREAM = ["model.n_layer=2", "sync.algorithm=streaming", "sync.fragments=2", "sync.tau=1"]


def _run(tmp: Path, name: str, overrides: list[str]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    summary = launch_local(load_config(None, TINY + STREAM + overrides), tmp / name, console_print=None)
    return summary, torch.load(tmp / name / "final_model.pt")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_quorum_of_every_site_is_lock_step_streaming_diloco(tmp_path: Path) -> None:
    """Sites of 2 and 1 workers, token-weighted, Nesterov per fragment, τ = 1, α = 0.5, 14 steps
    of H = 4 (fragment 1 syncs at steps 2, 6, 10, 14; fragment 0 at 4, 8, 12 and in the final
    round): bit for bit the lock-step run (two sites: each merge one addition), every merge of one
    fragment holding both sites' updates from the same version."""
    common = ["topology.sites=[{name: A, workers: 2}, {name: B, workers: 1}]", "train.steps=14", "sync.H=4"]
    common += ["topology.links.emulate=off"]
    lock, lock_w = _run(tmp_path, "lock", common)
    asy, asy_w = _run(tmp_path, "async", [*common, "sync.quorum={sites: 2, grace_s: .inf}"])
    assert all(torch.equal(lock_w[k], asy_w[k]) for k in lock_w)
    assert asy["final_eval_loss"] == lock["final_eval_loss"]
    merges = asy["pace"]
    assert [(m["fragment"], m["kind"]) for m in merges] == [(1, "quorum"), (0, "quorum")] * 3 + [(1, "quorum"), (0, "final")]
    assert all(m["sites"] == [0, 1] and m["staleness"] == [0, 0] for m in merges)
    assert [m["steps"] for m in merges] == [[2, 2]] + [[4, 4]] * 6 + [[2, 2]]
    assert len(set(asy["global_param_hash"].values())) == 1 and asy["fragments"] == 2


@pytest.mark.slow
@pytest.mark.timing
@pytest.mark.timeout(300)
def test_a_slow_sites_fragments_are_late_and_a_killed_site_comes_back(tmp_path: Path) -> None:
    """Three sites, C at a quarter speed, quorums of one, int8 both ways, 8 s on an emulated
    100 Mbit/s, 10 ms link. C's fragment updates are late (stale) and C never waits; B is
    SIGKILLed at step 40 and started again: it rejoins with every fragment's version and goes on
    from its last fragment-0 sync. Every site ends on one model, and each fragment's merges count
    their own versions."""
    overrides = [
        "topology.sites=[{name: A, workers: 1}, {name: B, workers: 2}, {name: C, workers: 1, compute_speed: 0.25}]",
        "sync.H=16",
        "sync.quorum={sites: 1, grace_s: 0}",
        "sync.codec=int8",
        "train.steps=100000",
        "train.max_seconds=8",
        "optim.schedule=constant",
        "fault.kill=[B@40]",
        "fault.restart_after=1",
        "topology.links.emulate=inprocess",
        "topology.links.inter.bandwidth_bps=1e8",
        "topology.links.inter.latency_s=0.01",
    ]
    s, _ = _run(tmp_path, "kill", overrides)
    assert s["lost_sites"] == [] and [p["site"] for p in s["per_site"]] == ["A", "B", "C"]
    assert len(set(s["global_param_hash"].values())) == 1 and s["hashes_agree_within_sites"]
    merges = s["pace"]
    events = [(m["kind"], m["sites"]) for m in merges if m["kind"] in ("lost", "rejoined")]
    assert events == [("lost", [1]), ("rejoined", [1])]
    back = next(i for i, m in enumerate(merges) if m["kind"] == "rejoined")
    for f in (0, 1):  # each fragment: its own versions, one per merge; B's updates in both after its return
        fm = [m for m in merges if m.get("fragment") == f and m["kind"] in ("quorum", "final")]
        assert [m["version"] for m in fm] == list(range(1, len(fm) + 1))
        assert any(1 in m["sites"] for m in merges[back:] if m.get("fragment") == f)
    late = [st for m in merges if m["kind"] == "quorum" and 2 in m["sites"] for st in m["staleness"]]
    assert late and max(late) >= 1  # C is late
    steps = {p["site"]: p["steps"] for p in s["per_site"]}
    assert steps["A"] > 2 * steps["C"]  # and nobody waited for it
    assert s["compression_ratio"] > 2.5  # int8 both ways (the final answers are fp32)
    assert s["final_eval_loss"] < s["eval_curve"][0]["eval_loss"]


def test_an_update_for_no_such_fragment_or_of_the_wrong_size_is_left_out() -> None:
    """The syncer checks what a site sends before it merges it: an update naming a fragment that
    does not exist decodes as an empty update of fragment 0, and an update whose length is not its
    fragment's is left out of the merge (logged), so a bad message costs its site's round only."""
    from geotrain.comm.mailbox import Message
    from geotrain.config import LivenessConfig, SyncConfig
    from geotrain.round.merge import Update
    from geotrain.round.outer import averaging
    from geotrain.round.syncer import UPDATE, QuorumSyncer

    cfg = SyncConfig(algorithm="streaming", quorum={"sites": 1})
    assert cfg.quorum is not None
    theta = [torch.zeros(3), torch.zeros(2)]
    live = LivenessConfig()
    syncer = QuorumSyncer(cfg.quorum, live, True, [1, 1], theta, averaging, cfg, object(), [0, 1], fragments=[[0], [1]])  # type: ignore[arg-type]

    def sent(fragment: float, n: int) -> Message:
        fields = [UPDATE, 0.0, 4.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, fragment]
        return Message(1, 0.0, fields, torch.ones(n).view(torch.uint8))

    assert syncer._decode(sent(1, 2)).delta.numel() == 2 and syncer._decode(sent(1, 2)).fragment == 1
    ghost = syncer._decode(sent(7, 2))
    assert ghost.fragment == 0 and ghost.delta.numel() == 0

    class Quiet:  # the mailbox of a syncer whose only site is its own (site 0, in memory)
        def listen(self, *_: object) -> None: ...

        def poll(self) -> set[int]:
            return set()

    syncer.mailbox = Quiet()  # type: ignore[assignment]
    syncer.sites, syncer.held = [0], {}
    syncer.start()
    try:  # fragment 0 holds 3 values: 5 do not fit; site 0 is still answered, the model unchanged
        syncer.inbox.put(Update(0, 0, 4, 1, torch.ones(5), fragment=0))
        fields, answer = syncer.outbox.get(timeout=10)
    finally:
        syncer.close()
    assert syncer.error is None and torch.equal(answer, torch.zeros(3))
    assert [m["kind"] for m in syncer.log] == ["rejected"] and "an update of 5 values" in syncer.log[0]["why"]
