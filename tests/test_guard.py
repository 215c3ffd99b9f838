"""Guarded updates: non-finite and outlier pseudo-gradients are left out of the average, the same
way on every rank; an injected NaN site cannot poison training (plain and secure aggregation)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from geotrain.config import SyncConfig
from tests.helpers import FOUR_SITES, read_summary, run_ranks, train_cli, uniform_topology

pytestmark = pytest.mark.timeout(240)


def _guard_rank(rank: int, scales: list[list[float]]):
    from geotrain.comm.session import rank_comm
    from geotrain.config import GuardConfig
    from geotrain.sync.guard import UpdateGuard

    topo = uniform_topology(3, 1)
    with rank_comm(topo, "off") as (groups, comm):
        guard = UpdateGuard(GuardConfig(norm_factor=10, warmup=3, window=5), comm)
        out = []
        for rnd, per_site in enumerate(scales):
            delta = torch.ones(100) * per_site[groups.me.site_index]
            out.append(guard.include(delta, 0, rnd))
        return out, guard.rejected, guard.events


def test_guard_excludes_nan_and_outliers_identically_on_every_rank() -> None:
    nan = float("nan")
    scales = [
        [1.0, 1.1, 0.9],
        [1.0, nan, 0.9],  # NaN: out at once, even before warm-up
        [1.2, 1.0, 50.0],  # 5 norms accepted by now (warm-up 3): 50x the median is out
        [1.0, 1.0, 1.0],
        [math.inf, 1.0, 9.0],  # 9 <= 10 x median: kept
    ]
    res = run_ranks(3, _guard_rank, scales, timeout=120)
    decisions, rejected, events = res[0]
    assert all(r[0] == decisions for r in res)  # every rank decides alike
    assert decisions == [
        [True, True, True],
        [True, False, True],
        [True, True, False],
        [True, True, True],
        [False, True, True],
    ]
    assert rejected == {"s0": 1, "s1": 1, "s2": 1}
    assert [e["site"] for e in events] == ["s1", "s2", "s0"] and "median" in events[1]["why"]


def _train(out: Path, *overrides: str) -> dict:
    train_cli(out, ["train.steps=18", "sync.H=3", *overrides], FOUR_SITES)
    return read_summary(out)


@pytest.mark.slow
@pytest.mark.parametrize("secure", [False, True], ids=["plain", "secagg"])
def test_a_nan_sending_site_is_excluded_and_the_run_finishes(tmp_path: Path, secure: bool) -> None:
    extra = ["privacy.secure_aggregation=true"] if secure else []
    s = _train(tmp_path / "run", 'fault.nan=["B@2"]', *extra)
    assert math.isfinite(s["final_eval_loss"]) and s["final_eval_loss"] < s["runs"][0]["eval_curve"][0]["eval_loss"]
    assert len(set(s["global_param_hash"].values())) == 1
    if secure:
        assert s["dropouts"] == 1  # withdrawn: the protocol removed its masks
    else:
        assert s["guard_rejections"] == {"A": 0, "B": 1, "C": 0, "D": 0}
        assert s["guard_events"][0]["round"] == 2 and "non-finite" in s["guard_events"][0]["why"]


def _excluded_sends_nothing(rank: int, forget: bool) -> float:
    from geotrain.comm.session import rank_comm
    from geotrain.config import SyncConfig
    from geotrain.sync import SiteReducer

    with rank_comm(uniform_topology(2, 1), "off") as (_groups, comm):
        reducer = SiteReducer(SyncConfig(algorithm="diloco", codec={"name": "topk", "fraction": 0.1}), comm, [torch.Size([1000])])
        reducer(torch.randn(1000, generator=torch.Generator().manual_seed(rank)))  # leaves a residual
        if forget:
            reducer.forget_residual()
        zeros = torch.zeros(1000)  # both sites left out of this round
        reducer(zeros)
        return float(zeros.abs().sum())


@pytest.mark.parametrize("forget", [True, False])
def test_an_excluded_site_sends_no_error_feedback(forget: bool) -> None:
    leaked = run_ranks(2, _excluded_sends_nothing, forget)
    if forget:
        assert leaked == [0.0, 0.0]
    else:  # without forgetting, the old residual would have been averaged in
        assert all(x > 0 for x in leaked)


# eager Streaming DiLoCo on 3 sites, one fragment, H = 2, plain SGD steps of given gradients:
# B's update of round 2 is NaN (left out), every update of round 4 is NaN (the round rolls back)
_EAGER_ROUNDS, _EAGER_H, _EAGER_NAN = 6, 2, {(1, 2), (0, 4), (1, 4), (2, 4)}


def _eager_grads(site: int, rnd: int) -> list[torch.Tensor]:
    """The gradients of ``site``'s inner steps in round ``rnd`` (1-based): NaN where the plan says."""
    g = torch.Generator().manual_seed(100 * site + rnd)
    grads = [torch.randn(5, 3, generator=g) * 0.1 for _ in range(_EAGER_H)]
    if (site, rnd) in _EAGER_NAN:
        grads[-1] = torch.full((5, 3), float("nan"))
    return grads


def _eager_rank(rank: int) -> list[float]:
    from geotrain.comm.session import rank_comm
    from geotrain.config import GuardConfig, SyncConfig
    from geotrain.round import build_round
    from geotrain.sync import UpdateGuard

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 5, bias=False)
    with rank_comm(uniform_topology(3, 1), "off") as (_groups, comm):
        inner = torch.optim.SGD(model.parameters(), lr=1.0)
        cfg = SyncConfig(algorithm="streaming", eager=True, H=_EAGER_H, fragments=1)
        with build_round(cfg, model, inner, comm, grad_clip=0.0, guard=UpdateGuard(GuardConfig(), comm)) as sync:
            for rnd in range(1, _EAGER_ROUNDS + 1):
                for grad in _eager_grads(rank, rnd):
                    model.weight.grad = grad.clone()
                    inner.step()
            sync.finish()
            assert sync.rounds_rolled_back == 1, sync.rollback_reasons
            assert sync.guard is not None and sync.guard.rejected == {"s0": 1, "s1": 2, "s2": 1}
        return model.weight.detach().reshape(-1).tolist()


def _eager_by_hand() -> torch.Tensor:
    """The eager variant's definition, from the accepted updates only: each site steps its own
    copy of the global model with its fresh Δ/M (if the guard keeps it) plus the last round's
    guarded average minus what it applied at once; at the end, the sites' models are averaged."""
    torch.manual_seed(0)
    start = torch.nn.Linear(3, 5, bias=False).weight.detach().clone()
    sites, cfg = 3, SyncConfig(algorithm="streaming")
    deltas = {(s, r): sum(_eager_grads(s, r)) for s in range(sites) for r in range(1, _EAGER_ROUNDS + 1)}
    averages = {}
    for r in range(1, _EAGER_ROUNDS + 1):
        kept = [deltas[s, r] for s in range(sites) if bool(torch.isfinite(deltas[s, r]).all())]
        averages[r] = sum(kept) / len(kept) if kept else torch.zeros(5, 3)  # none kept: rolled back
    models = []
    for s in range(sites):
        g = start.clone().requires_grad_(True)
        outer = torch.optim.SGD([g], lr=cfg.outer_sgd[0], momentum=cfg.outer_sgd[1], nesterov=True)
        applied = {
            r: deltas[s, r] / sites if torch.isfinite(deltas[s, r]).all() else torch.zeros(5, 3)
            for r in range(1, _EAGER_ROUNDS + 1)
        }
        for r in range(1, _EAGER_ROUNDS + 2):  # the last step is finish(): what the last round owes
            step = applied.get(r, torch.zeros(5, 3)) + (averages[r - 1] - applied[r - 1] if r > 1 else 0)
            g.grad = step.clone()
            outer.step()
        models.append(g.detach())
    return sum(models) / sites


def test_eager_streaming_leaves_a_rejected_update_out_and_rolls_back_a_round_with_none_kept() -> None:
    got = run_ranks(3, _eager_rank)
    assert got[0] == got[1] == got[2]  # one global model
    expected = _eager_by_hand().reshape(-1)
    assert torch.allclose(torch.tensor(got[0]), expected, rtol=1e-5, atol=1e-6), (got[0], expected)
