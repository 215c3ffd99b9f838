"""Differential privacy (accountant, DP-SGD, site-level noise), private aggregation over Gloo,
site-private data, and end-to-end private training runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from geotrain.config import DataConfig, ModelConfig
from geotrain.data import build_rank_data
from geotrain.models import build_model
from geotrain.privacy.audit import AuditChain, verify_logs
from geotrain.privacy.dp import Accountant, ExampleDP, calibrate_noise
from geotrain.privacy.ghost import GhostClipping
from tests.helpers import FOUR_SITES, read_summary, run_ranks, train_cli, uniform_topology

pytestmark = pytest.mark.timeout(240)


def test_calibrated_noise_spends_the_budget_and_max_steps_respects_it() -> None:
    sigma = calibrate_noise(4.0, 1e-5, 0.01, 500, "rdp")
    acc = Accountant("rdp", 1e-5, 4.0)
    assert acc.max_steps(sigma, 0.01, 10_000) >= 500
    for _ in range(500):
        acc.step(sigma, 0.01)
    assert 3.5 < acc.epsilon() <= 4.0
    assert not acc.fits(sigma, 0.01, 200)  # far past the calibrated length
    assert Accountant("prv", 1e-5, None).fits(0.0, 1.0)  # no budget: anything goes


def test_dp_sgd_clips_each_example_and_adds_noise() -> None:
    cfg = ModelConfig(n_layer=1, n_embd=32, n_head=2, block_size=16)
    x = torch.randint(0, 256, (6, 16), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 256, (6, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    plain = build_model(cfg)
    plain(x, y).backward()
    ref = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
    torch.manual_seed(0)
    model = build_model(cfg)
    # a huge clip bound and no noise: DP-SGD's gradient is the ordinary mean gradient
    dp = ExampleDP(model, clip_norm=1e9, noise_multiplier=0.0, workers_per_site=1)
    model(x, y).backward()
    got = dp.privatize()
    assert torch.allclose(got, ref, atol=1e-6, rtol=1e-4)
    # a tiny bound: every example contributes at most clip_norm, so the mean is at most that
    dp.clip_norm = 1e-3
    model.zero_grad()
    model(x, y).backward()
    assert float(dp.privatize().norm()) <= 1e-3 * 1.0001
    # noise: std sigma*C/batch per coordinate
    dp.clip_norm, dp.noise_multiplier = 1e-3, 50.0
    model.zero_grad()
    model(x, y).backward()
    noisy = dp.privatize()
    assert float(noisy.std()) == pytest.approx(50.0 * 1e-3 / 6, rel=0.05)


@pytest.mark.parametrize("clip", [1e-3, 0.05, 1e9])
def test_ghost_norms_clip_each_example_like_per_example_gradients(clip: float) -> None:
    """GhostClipping (DP-SGD of a sharded model) never forms per-example gradients: its two passes
    must leave Σ_i clip(g_i)/b, what Opacus's per-example gradients give, for every layer kind of
    the GPT (Linear with biases, LayerNorm, learned positions, the head tied to the embedding);
    a clip above every norm gives the plain mean gradient."""
    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=2, block_size=16)
    x = torch.randint(0, 256, (5, 16), generator=torch.Generator().manual_seed(0))
    x[:, 8:] = x[:, :8]  # repeated tokens: the embedding's rows add up within an example
    y = torch.randint(0, 256, (5, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    ref = build_model(cfg)
    dp = ExampleDP(ref, clip_norm=clip, noise_multiplier=0.0, workers_per_site=1)
    dp.module(x, y).backward()
    expect = dp.privatize()
    torch.manual_seed(0)
    model = build_model(cfg)
    ghost = GhostClipping(model, clip_norm=clip, noise_multiplier=0.0, workers_per_site=1)
    loss = ghost.backward(lambda: model(x, y))
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-7)
    assert loss.item() == pytest.approx(ref(x, y).item(), rel=1e-6)
    assert (ghost._factor < 1).all() if clip < 1 else (ghost._factor == 1).all()
    # each rank's noise on its shards: σC/(G·b) per coordinate of the site's averaged gradient
    ghost.noise_multiplier, ghost.workers = 50.0, 2
    shard = torch.zeros(200_000)
    ghost.noise_shards([shard])
    assert float(shard.std()) == pytest.approx(50.0 * clip / (2 * 5), rel=0.02)


def test_ghost_norms_refuse_a_layer_they_cannot_norm_in_one_line() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Conv1d(8, 8, 1))
    with pytest.raises(ValueError, match=r"^privacy.dp.unit: .* not Conv1d; use sync.within_site=replicate$"):
        GhostClipping(model, 1.0, 1.0, 1)


def test_site_private_corpus_is_the_only_training_data(tmp_path: Path) -> None:
    private = tmp_path / "hospital.txt"
    private.write_bytes(b"\x01\x02\x03" * 20_000)
    d = build_rank_data(DataConfig(), 1, [2, 2], 16, 4, 2, 0, site_corpus=str(private))
    for _ in range(5):
        x, _ = d.train.next()
        assert set(x.unique().tolist()) <= {1, 2, 3}
    shared = build_rank_data(DataConfig(), 1, [2, 2], 16, 4, 2, 0)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(d.eval, shared.eval, strict=True))  # same public eval set


def _private_average_rank(rank: int, secure: bool, noise: float | None):
    from geotrain.comm.session import rank_comm
    from geotrain.config import PrivacyConfig
    from geotrain.privacy.aggregation import PrivateAggregation

    topo = uniform_topology(3, 1)  # secure aggregation needs 3 sites
    dp = {"unit": "site", "noise_multiplier": noise, "clip_norm": 50.0} if noise is not None else {}
    cfg = PrivacyConfig.model_validate({"secure_aggregation": secure, "dp": dp})
    with rank_comm(topo, "off") as (groups, comm):
        agg = PrivateAggregation(cfg, comm, seed=3, rounds_planned=2, audit=None)
        x = torch.randn(5001, generator=torch.Generator().manual_seed(groups.me.site_index))
        n = agg.average(x, round_id=0)
        return n, x.tolist(), agg.accountant.epsilon() if agg.accountant else None


@pytest.mark.parametrize("secure", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_private_average_equals_mean_and_is_identical_on_every_rank(secure: bool) -> None:
    res = run_ranks(3, _private_average_rank, secure, None, timeout=120)
    want = sum(torch.randn(5001, generator=torch.Generator().manual_seed(s)) for s in range(3)) / 3
    for n, got, eps in res:
        assert n == 3 and eps is None
        assert torch.allclose(torch.tensor(got), want, atol=1e-5)
    assert all(r[1] == res[0][1] for r in res)  # bit-identical on every rank


@pytest.mark.slow
def test_pair_masks_cancel_in_the_ring_and_hide_each_update() -> None:
    """Secure aggregation inside an elastic round: three sites mask their parts with a seed per
    pair; each masked part alone looks nothing like the update, the ring sum of all three is the
    fixed-point sum, and a sum that misses one site is garbage (a site that drops out fails the
    round's vote, so that sum is never used)."""
    from geotrain.privacy.masking import PairMasks, error_bound

    masks = PairMasks(bound=8.0, sites=3)
    names = ["A", "B", "C"]
    pair = {(a, b): bytes([i]) * 32 for i, (a, b) in enumerate([("A", "B"), ("A", "C"), ("B", "C")])}
    gen = torch.Generator().manual_seed(0)
    xs = {s: torch.randn(1000, generator=gen) for s in names}
    enc = {}
    for s in names:
        keys = {t: pair[tuple(sorted((s, t)))] for t in names if t != s}
        enc[s] = masks.encode(xs[s], 40, s, keys, b"round-1|0")
    assert enc["A"].dtype == torch.int32
    alone = masks.decode(enc["A"])
    span = (1 << 31) / (1 << masks.frac_bits)  # the ring, in decoded units: about 16 here
    assert (alone - xs["A"]).abs().mean() > span / 4  # uniform in the ring, not the update (|x| is about 0.8)
    acc = enc["A"].clone()
    for s in ("B", "C"):
        masks.add_(acc, enc[s])
    total = xs["A"] + xs["B"] + xs["C"]
    assert (masks.decode(acc) - total).abs().max() <= error_bound(3, masks.frac_bits) + 1e-6  # (+ the fp32 sums)
    two = enc["A"].clone()
    masks.add_(two, enc["B"])
    assert (masks.decode(two) - (xs["A"] + xs["B"])).abs().mean() > span / 4


def test_round_noise_clips_the_whole_update_and_noises_each_part_once() -> None:
    """Site-level DP in elastic rounds: the site's whole update is clipped to the bound, each
    carried part gets noise of z · clip / √(min sites) once, and each round sent is one step."""
    from geotrain.elastic.commit import site_dp
    from geotrain.privacy.dp import Accountant, RoundNoise

    noise = RoundNoise(clip=1.0, noise_multiplier=0.5, min_sites=4, accountant=Accountant("rdp", 1e-5, None))
    assert noise.std == pytest.approx(0.25)
    delta = torch.full((40_000,), 0.01)  # norm 2: clipped by half
    apply = site_dp(noise, delta, True, False, None)
    parts = [apply(p.clone()) for p in delta.split(20_000)]  # two carriers, each its own part
    got = torch.cat(parts)
    assert (got - 0.005).mean().abs() < 0.01 and (got - 0.005).std() == pytest.approx(0.25, rel=0.02)
    assert noise.accountant.steps == 1
    idle = site_dp(noise, delta, False, False, None)  # a site that sends nothing spends nothing
    assert torch.equal(idle(delta.clone()), delta) and noise.accountant.steps == 1
    noise.at_least(5)
    assert noise.accountant.steps == 5


def test_site_level_noise_is_calibrated_and_accounted() -> None:
    res = run_ranks(3, _private_average_rank, True, 0.4, timeout=120)
    mean = sum(torch.randn(5001, generator=torch.Generator().manual_seed(s)) for s in range(3)) / 3
    n, got, eps = res[0]
    err = torch.tensor(got) - mean
    # the sum carries N(0, (sigma*C)^2) per coordinate; the average over 3 sites a third of it
    assert float(err.std()) == pytest.approx(0.4 * 50.0 / 3, rel=0.06)
    assert eps is not None and eps > 0
    assert all(r[1] == got for r in res)


def _train(out: Path, *overrides: str, topology: str | None = None) -> tuple[subprocess.CompletedProcess[str], dict]:
    proc = train_cli(out, list(overrides), topology)
    return proc, read_summary(out)


@pytest.mark.slow
def test_four_sites_secure_aggregation_with_site_dp_dropout_and_rollback(tmp_path: Path) -> None:
    _, s = _train(
        tmp_path,
        "train.steps=24",
        "sync.H=4",
        "privacy.secure_aggregation=true",
        "privacy.dp.unit=site",
        "privacy.dp.noise_multiplier=0.0001",  # small: the tiny model must still learn through the noise
        "privacy.dp.clip_norm=2.0",
        'privacy.inject=["B@1:drop", "C@2:malformed", "A@3:drop", "D@3:drop"]',
        topology=FOUR_SITES,
    )
    assert s["secagg"] is True and s["threshold"] == 3 and s["dp_unit"] == "site"
    assert s["noise_multiplier"] == 0.0001 and s["clip_norm"] == 2.0 and s["delta"] == 1e-5
    assert s["epsilon"] > 0 and s["rounds"] == 6
    assert s["dropouts"] == 2 and s["rounds_rolled_back"] == 1  # round 3 lost 2 of 4 sites (< t = 3)
    assert len(set(s["global_param_hash"].values())) == 1
    assert s["final_eval_loss"] < s["runs"][0]["eval_curve"][0]["eval_loss"]
    audit = _rounds(tmp_path / "audit.jsonl")
    assert [a["status"] for a in audit] == ["committed"] * 3 + ["rolled_back"] + ["committed"] * 2
    assert audit[1]["dropped"] == ["B"] and audit[1]["masks_recovered"] == ["B"]
    assert audit[2]["malformed"] == ["C"]
    assert all(a["noise_multiplier"] == 0.0001 and a["clip_norm"] == 2.0 for a in audit)
    assert audit[-1]["epsilon"] == pytest.approx(s["epsilon"])
    assert (tmp_path / "audit-B.jsonl").exists()  # every organisation keeps its own record
    _tamper_with_the_audit_logs(tmp_path)


def _rounds(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "round"]


def _findings(run: Path, keys: dict[str, str] | None = None) -> list[tuple[str, int, str]]:
    _, findings = verify_logs(sorted(run.glob("audit*.jsonl")), keys)
    return [(f.file, f.line, f.problem) for f in findings]


def _tamper_with_the_audit_logs(run: Path) -> None:
    """Every way of rewriting a site's signed audit log is found, by file and line number."""
    assert _findings(run) == []
    proc = subprocess.run([sys.executable, "-m", "geotrain", "audit", "verify", str(run)], capture_output=True, text=True)
    assert proc.returncode == 0 and "4 chain(s) intact and in agreement" in proc.stdout, proc.stdout + proc.stderr
    lines = (run / "audit-C.jsonl").read_text().splitlines()  # genesis, 6 rounds, end
    assert len(lines) == 8 and json.loads(lines[0])["kind"] == "genesis" and json.loads(lines[-1])["kind"] == "end"
    assert not (run / "keys").exists()  # the signing keys are not in the folder they protect
    pub = {p.stem: p.read_text().strip() for p in Path(os.environ["GEOTRAIN_KEYS_DIR"]).glob("*.pub")}
    assert {"A", "B", "C", "D"} <= set(pub)

    def tampered(new: list[str], name: str = "audit-C.jsonl") -> Path:
        d = run / "tampered"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        for f in run.glob("audit*.jsonl"):
            shutil.copy(f, d / f.name)
        (d / name).write_text("\n".join(new) + "\n")
        return d

    f = "audit-C.jsonl"
    assert _findings(tampered(lines[:3] + lines[4:])) == [(f, 4, "removed")]
    assert _findings(tampered(lines[:2] + [lines[3], lines[2]] + lines[4:])) == [(f, 4, "reordered")]
    rec = json.loads(lines[5])  # round 4
    assert rec["status"] == "committed"
    altered = json.dumps({**rec, "status": "rolled_back"}, sort_keys=True)
    assert _findings(tampered(lines[:5] + [altered] + lines[6:])) == [(f, 6, "altered")]
    assert _findings(tampered(lines[:-1])) == [(f, 7, "truncated")]
    assert ("audit-C.jsonl", 6, "forged") in _findings(tampered(lines[:5] + [lines[2]] + lines[5:]))  # replayed line
    # a line signed by someone else's key, inserted
    other = AuditChain(run / "other.jsonl", Ed25519PrivateKey.generate(), "C")
    other.append({**rec, "status": "rolled_back"})
    inserted = (run / "other.jsonl").read_text().splitlines()[1]
    assert _findings(tampered(lines[:4] + [inserted] + lines[4:])) == [(f, 5, "forged")]
    # the whole log rewritten under a new key, one round's outcome changed: the other sites'
    # logs disagree; with the keys pinned the new key itself is refused
    rewritten = AuditChain(run / "rewritten.jsonl", Ed25519PrivateKey.generate(), "C")
    for line in lines[1:-1]:
        r = {k: v for k, v in json.loads(line).items() if k not in ("seq", "prev", "sig")}
        rewritten.append({**r, "status": "rolled_back"} if r["round"] == 4 else r)
    rewritten.close({})
    d = tampered((run / "rewritten.jsonl").read_text().splitlines())
    assert _findings(d) == [(f, 6, "disagreement")]  # round 4 is line 6 (seq 5)
    assert (f, 1, "forged") in _findings(d, pub)
    proc = subprocess.run([sys.executable, "-m", "geotrain", "audit", "verify", str(d)], capture_output=True, text=True)
    assert proc.returncode == 1 and "audit-C.jsonl:6: disagreement: round 4" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.slow
def test_epsilon_budget_stops_training_cleanly(tmp_path: Path) -> None:
    proc, s = _train(
        tmp_path,
        "train.steps=40",
        "sync.H=4",
        "privacy.dp.unit=example",
        "privacy.dp.epsilon=1.55",
        "privacy.dp.noise_multiplier=0.5",
        "privacy.dp.clip_norm=1.0",
    )
    stop = s["privacy_stopped_at_step"]
    assert stop is not None and 0 < stop < 40 and s["steps"] == stop
    assert s["epsilon"] <= 1.55
    assert "privacy budget" in proc.stdout
    assert len(set(s["global_param_hash"].values())) == 1  # every site ends on the same model
    steps = [json.loads(line) for line in (tmp_path / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert all("epsilon" in r for r in steps) and steps[-1]["epsilon"] == pytest.approx(s["epsilon"])


@pytest.mark.slow
def test_streaming_with_secure_aggregation_rolls_back_a_failed_fragment(tmp_path: Path) -> None:
    _, s = _train(
        tmp_path,
        "train.steps=16",
        "sync.algorithm=streaming",
        "sync.H=4",
        "sync.fragments=2",
        "sync.tau=1",
        "privacy.secure_aggregation=true",
        'privacy.inject=["A@1:drop"]',  # 3 sites, t = 3: one withdrawal fails that fragment's round
        "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}]",
    )
    assert s["secagg"] and s["rounds_rolled_back"] == 1 and s["dropouts"] == 0
    assert len(set(s["global_param_hash"].values())) == 1
    audit = _rounds(tmp_path / "audit.jsonl")
    assert [a["status"] for a in audit].count("rolled_back") == 1 and audit[1]["status"] == "rolled_back"


def test_too_small_site_corpus_is_a_config_error(tmp_path: Path) -> None:
    tiny = tmp_path / "tiny.txt"
    tiny.write_bytes(b"x" * 10)
    topo = f"topology:\n  sites: [{{name: A, workers: 1, corpus: {tiny}}}, {{name: B, workers: 1}}]\n"
    (tmp_path / "t.yaml").write_text(topo)
    proc = subprocess.run(
        [sys.executable, "-m", "geotrain", "train", "--config", str(tmp_path / "t.yaml"), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "topology.sites[0].corpus" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_private_run_that_fails_closes_its_audit_log_and_flushes_its_metrics(tmp_path: Path) -> None:
    """Rank 0 fails at step 6: its checkpoint folder cannot be made (a file stands in the way);
    the other sites then fail on the lost peer. Every site's audit log still ends with its closing
    line, saying the run failed and why, and verifies; rank 0's metrics hold step 6, in the JSONL
    and in TensorBoard (whose writer buffers: closed on the failure path, or lost)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    out = tmp_path / "run"
    proc = train_cli(
        out,
        [
            "train.steps=40",
            "sync.H=2",
            "privacy.secure_aggregation=true",
            "checkpoint.every=6",
            f"checkpoint.dir={blocker / 'ckpt'}",
            "topology.links.emulate=off",
        ],
        FOUR_SITES,
        expect_rc=1,
    )
    assert "NotADirectoryError" in proc.stderr + "".join(p.read_text() for p in (out / "logs").glob("*.log"))
    ends = {}
    for f in sorted(out.glob("audit*.jsonl")):
        last = json.loads(f.read_text().splitlines()[-1])
        assert last["kind"] == "end", f
        ends[f.name] = last
    assert len(ends) == 4  # one per organisation
    assert all(e["outcome"] == "failed" and e["error"] for e in ends.values()), ends
    assert "NotADirectoryError" in ends["audit.jsonl"]["error"]  # site A's leader is the one that failed first
    assert all(e["aggregations"] == 3 for e in ends.values())  # rounds at steps 2, 4 and 6, agreed by all
    _, findings = verify_logs(sorted(out.glob("audit*.jsonl")))
    assert findings == []
    verified = subprocess.run([sys.executable, "-m", "geotrain", "audit", "verify", str(out)], capture_output=True, text=True)
    assert verified.returncode == 0 and "run failed (" in verified.stdout, verified.stdout
    steps = [json.loads(line)["step"] for line in (out / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7))
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 7))


@pytest.mark.slow
def test_a_resumed_private_run_carries_its_audit_chain_and_another_runs_log_is_caught(tmp_path: Path) -> None:
    """Resuming used to delete the audit logs and start new chains. Now each site's chain goes on
    (a resume line, then the rounds after the checkpoint as attempt 1), every chain starts with the
    run's one nonce, and a site's log swapped for one of an earlier run (same key: keys are kept
    across runs in OUT/keys) is caught, though it verifies on its own."""
    topology = "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}]"
    run = tmp_path / "run"
    common = ["sync.H=2", "privacy.secure_aggregation=true", topology]
    train_cli(run, ["train.steps=6", "checkpoint.every=4", *common])
    earlier_b = (run / "audit-B.jsonl").read_text()  # this run's B log, before the resume
    proc = train_cli(run, ["train.steps=6", "checkpoint.resume=auto", *common])
    assert "audit log carried on (attempt 1, after step 4)" in proc.stdout
    for f in ("audit.jsonl", "audit-B.jsonl"):
        recs = [json.loads(x) for x in (run / f).read_text().splitlines()]
        kinds = [r["kind"] for r in recs]
        assert kinds[0] == "genesis" and kinds.count("genesis") == 1 and kinds.count("resume") == 1, kinds
        assert kinds[-1] == "end" and kinds.count("end") == 2  # the first run's end, then the resumed run's
        rounds = [(r["round"], r["attempt"]) for r in recs if r["kind"] == "round"]
        assert rounds == [(0, 0), (1, 0), (2, 0), (2, 1)], rounds  # round 2 (steps 5-6) done again after step 4
    _, findings = verify_logs(sorted(run.glob("audit*.jsonl")))
    assert findings == []
    assert (run / "audit.jsonl").read_text().splitlines()[0].count('"nonce"') == 1
    train_cli(run, ["train.steps=4", *common])  # a new run in the same place (not resumed): new chains, a new nonce
    (run / "audit-B.jsonl").write_text(earlier_b)  # B's log swapped for the earlier run's
    _, findings = verify_logs(sorted(run.glob("audit*.jsonl")))
    assert any(f.problem == "disagreement" and "another run" in f.detail for f in findings), findings
