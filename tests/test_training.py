"""End-to-end training through the real launcher (one OS process per rank, Gloo on 127.0.0.1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from geotrain.config import load_config
from geotrain.launch.local import launch_local
from tests.helpers import PLAIN_SGD, TINY

pytestmark = pytest.mark.slow  # every test here trains end to end through the launcher


def _run(tmp: Path, name: str, overrides: list[str]) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg = load_config(None, TINY + overrides)
    summary = launch_local(cfg, tmp / name, console_print=None)
    return summary, torch.load(tmp / name / "final_model.pt")


@pytest.mark.timeout(240)
def test_diloco_h1_plain_sgd_equals_ddp(tmp_path: Path) -> None:
    steps = ["train.steps=6"]
    ddp, ddp_w = _run(tmp_path, "ddp", steps + PLAIN_SGD + ["sync.algorithm=ddp"])
    dil, dil_w = _run(
        tmp_path,
        "dil",
        steps
        + PLAIN_SGD
        + ["sync.algorithm=diloco", "sync.H=1", "sync.outer_lr=1.0", "sync.outer_momentum=0.0", "sync.nesterov=false"],
    )
    assert ddp_w.keys() == dil_w.keys()
    for k in ddp_w:
        torch.testing.assert_close(dil_w[k], ddp_w[k], rtol=1e-5, atol=1e-6, msg=k)
    # the model actually moved (so the comparison means something)
    init = torch.load(tmp_path / "ddp" / "final_model.pt")
    assert ddp["final_eval_loss"] < ddp["eval_curve"][0]["eval_loss"]
    for s in (ddp, dil):
        assert len(set(s["global_param_hash"].values())) == 1 and s["hashes_agree_within_sites"]
    assert init is not None


@pytest.mark.timeout(240)
def test_diloco_bytes_are_ddp_over_h_and_summary_schema(tmp_path: Path) -> None:
    H = 5
    ddp, _ = _run(tmp_path, "ddp", ["train.steps=10", "sync.algorithm=ddp"])
    dil, _ = _run(tmp_path, "dil", ["train.steps=10", "sync.algorithm=diloco", f"sync.H={H}"])
    assert dil["rounds"] == 2 and ddp["rounds"] == 10
    ratio = dil["inter_site_bytes"] / (ddp["inter_site_bytes"] / H)
    assert abs(ratio - 1) <= 0.02, ratio
    # every site holds a bit-identical global model
    assert set(dil["global_param_hash"]) == {"A", "B"}
    assert len(set(dil["global_param_hash"].values())) == 1
    required = {
        "algorithm",
        "sites",
        "workers_per_site",
        "steps",
        "tokens",
        "final_eval_loss",
        "inter_site_bytes",
        "intra_site_bytes",
        "wall_seconds",
        "compute_seconds",
        "comm_wait_seconds",
        "global_param_hash",
    }
    for s in (ddp, dil):
        assert required <= s.keys()
        assert s["tokens"] == 10 * 4 * 4 * 16
        assert s["intra_site_bytes"] > 0 and s["compute_seconds"] > 0
    # per-step JSONL and TensorBoard events exist
    lines = (tmp_path / "dil" / "metrics" / "rank3.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["eval_loss"] == pytest.approx(dil["final_eval_loss"])
    assert list((tmp_path / "dil" / "tb").glob("events.out.tfevents.*"))


@pytest.mark.timeout(240)
def test_final_partial_round_and_non_iid(tmp_path: Path) -> None:
    s, _ = _run(tmp_path, "p", ["train.steps=7", "sync.H=3", "data.non_iid=true", "sync.weight_by_tokens=true"])
    assert s["rounds"] == 3  # 3 + 3 + a final round of 1
    assert len(set(s["global_param_hash"].values())) == 1


@pytest.mark.timeout(240)
def test_hugging_face_model_trains_across_sites(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    s, weights = _run(
        tmp_path,
        "hf",
        ["model.kind=hf", "topology.sites=[{name: eu, workers: 1}, {name: us, workers: 1}]", "train.steps=4", "sync.H=2"],
    )
    assert s["sites"] == ["eu", "us"] and s["rounds"] == 2
    assert len(set(s["global_param_hash"].values())) == 1
    assert any(k.startswith("inner.") for k in weights)


@pytest.mark.timeout(300)
def test_streaming_one_fragment_no_delay_is_diloco_and_fragments_cut_the_peak(tmp_path: Path) -> None:
    common = ["train.steps=9", "sync.H=4", "model.n_layer=2"]
    dil, dil_w = _run(tmp_path, "dil", [*common, "sync.algorithm=diloco"])
    one, one_w = _run(tmp_path, "one", [*common, "sync.algorithm=streaming", "sync.fragments=1", "sync.tau=0", "sync.alpha=0"])
    assert one["global_param_hash"] == dil["global_param_hash"]  # bit-identical: same algorithm
    for k in dil_w:
        assert torch.equal(one_w[k], dil_w[k]), k
    two, _ = _run(tmp_path, "two", [*common, "sync.algorithm=streaming", "sync.fragments=2", "sync.tau=1"])
    assert two["fragments"] == 2 and two["rounds"] == 2 * 3  # each fragment: 2 syncs + the final one
    assert len(set(two["global_param_hash"].values())) == 1 and two["hashes_agree_within_sites"]
    # each sync point carries one fragment: the peak per step falls to about half
    assert two["peak_inter_site_bytes_per_step"] <= 0.7 * dil["peak_inter_site_bytes_per_step"]
    assert two["final_sync_inter_site_bytes"] > 0 and dil["final_sync_inter_site_bytes"] > 0  # 9 steps, H=4: catch-up
    assert two["final_eval_loss"] < two["eval_curve"][0]["eval_loss"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "codec,algorithm,low,high", [("int8", "diloco", 3.3, 4.0), ("fp4", "streaming", 6.5, 7.2), ("powersgd", "ddp", 2.0, 200.0)]
)
def test_codec_end_to_end(tmp_path: Path, codec: str, algorithm: str, low: float, high: float) -> None:
    s, _ = _run(
        tmp_path, codec, ["train.steps=8", "sync.H=4", "sync.tau=1", f"sync.algorithm={algorithm}", f"sync.codec={codec}"]
    )
    assert s["codec"] == codec
    assert low <= s["compression_ratio"] <= high, s["compression_ratio"]
    assert len(set(s["global_param_hash"].values())) == 1 and s["hashes_agree_within_sites"]
    assert s["final_eval_loss"] < s["eval_curve"][0]["eval_loss"]


def _metrics(run: Path, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_streaming_slots_of_a_time_limit_are_the_lock_step_schedule(tmp_path: Path) -> None:
    """Under train.max_seconds Streaming DiLoCo ends each fragment's sync with a control exchange
    of every site's steps and elapsed time (the slots of the pace clock). When the limit does not
    bite, the run is lock-step Streaming DiLoCo bit for bit, over sites of 2 and 1 workers, token
    weighted, and ending inside a slot (9 steps, slots of 2): every fragment's counts, its sync
    order and the last syncs agree."""
    sites = "topology.sites=[{name: A, workers: 2}, {name: B, workers: 1}]"
    common = [sites, "train.steps=9", "sync.H=4", "model.n_layer=2", "sync.algorithm=streaming", "sync.fragments=2"]
    common += ["sync.tau=1", "run.baseline=none", "topology.links.emulate=off"]
    plain, plain_w = _run(tmp_path, "plain", common)
    timed, timed_w = _run(tmp_path, "timed", [*common, "train.max_seconds=100000"])
    assert timed["rounds"] == plain["rounds"] == 6 and len(timed["pace"]) == 4  # 4 slots, then both fragments
    assert all(p["steps"] == [2, 2] for p in timed["pace"])
    for k in plain_w:
        assert torch.equal(timed_w[k], plain_w[k]), k
    assert timed["inter_site_bytes"] > plain["inter_site_bytes"]  # (the control exchanges: a few bytes a slot)


@pytest.mark.timeout(300)
def test_streaming_exchange_runs_in_the_background_on_a_slow_link(tmp_path: Path) -> None:
    # 2 layers of n_embd 32: a fragment is ~10 KB per direction; at 1 Mbit/s + 50 ms it needs
    # ~0.2 s to arrive, several steps of this tiny model, so it is still in flight after its sync step
    slow = ["topology.links.inter.bandwidth_bps=1e6", "topology.links.inter.latency_s=0.05", "model.n_layer=2"]
    s, _ = _run(
        tmp_path, "bg", [*slow, "train.steps=16", "sync.H=8", "sync.fragments=2", "sync.tau=6", "sync.algorithm=streaming"]
    )
    rows = [r for r in _metrics(tmp_path / "bg") if "step_seconds" in r][:16]
    in_flight = [r["step"] for r in rows if r["in_flight_bytes"] > 0]
    assert in_flight, "no step saw an exchange in flight"
    assert all(r["wait_seconds"] >= 0 for r in rows)
    assert s["link_emulation"] == "inprocess" and 0 < s["utilization"] <= 1
    assert len(set(s["global_param_hash"].values())) == 1 and s["hashes_agree_within_sites"]
    # the same run with the exchange merged at once waits for the link at every sync instead
    z, _ = _run(
        tmp_path, "tau0", [*slow, "train.steps=16", "sync.H=8", "sync.fragments=2", "sync.tau=0", "sync.algorithm=streaming"]
    )
    assert z["wan_wait_seconds"] > s["wan_wait_seconds"]


@pytest.mark.timeout(300)
def test_eager_streaming_ends_on_one_model_and_learns(tmp_path: Path) -> None:
    s, _ = _run(
        tmp_path,
        "eager",
        ["train.steps=12", "sync.H=4", "sync.fragments=2", "sync.eager=true", "sync.algorithm=streaming", "model.n_layer=2"],
    )
    assert len(set(s["global_param_hash"].values())) == 1 and s["hashes_agree_within_sites"]
    assert s["final_eval_loss"] < s["eval_curve"][0]["eval_loss"]
    assert s["final_sync_inter_site_bytes"] > 0  # the closing average of the sites' models


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "extra",
    [
        ["sync.algorithm=ddp"],
        ["sync.algorithm=diloco", "sync.codec=sparseloco", "sync.codec.fraction=0.02"],
        ["sync.algorithm=streaming", "sync.tau=1"],
    ],
    ids=["ddp", "diloco+sparseloco", "streaming"],
)
def test_muon_inner_optimizer_end_to_end(tmp_path: Path, extra: list[str]) -> None:
    s, _ = _run(tmp_path, "muon", ["train.steps=8", "sync.H=4", "optim.name=muon", *extra])
    assert len(set(s["global_param_hash"].values())) == 1 and s["hashes_agree_within_sites"]
    assert s["final_eval_loss"] < s["eval_curve"][0]["eval_loss"]
    if "sync.codec=sparseloco" in extra:
        assert s["codec"] == "sparseloco" and s["compression_ratio"] > 50, s["compression_ratio"]
