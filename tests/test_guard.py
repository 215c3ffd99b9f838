"""Guarded updates: non-finite and outlier pseudo-gradients are left out of the average, the same
way on every rank; an injected NaN site cannot poison training (plain and secure aggregation)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

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
        reducer = SiteReducer(SyncConfig(algorithm="diloco", codec="topk", topk_fraction=0.1), comm, [torch.Size([1000])])
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
