"""geotrain place: the choice on small pools against brute force in the test, the objective and its
constraints, the config it writes (and a short run of it that sends bytes only where the plan says),
and every bad pool refused in one line naming the field."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from geotrain.config import ConfigError, load_config
from geotrain.plan.exchange import SHAPES, sum_seconds
from geotrain.plan.place import Placer
from geotrain.plan.place_report import run_place
from geotrain.plan.pool import Pool, load_pool
from tests.helpers import read_summary

ROOT = Path(__file__).resolve().parents[1]
P, TPS = 1_000_000, 1000


def _pool(**job: Any) -> Pool:
    return Pool.model_validate(
        {
            "sites": [
                {"name": "A", "accelerators": 2, "cost_per_hour": 3.0},
                {"name": "B", "accelerators": 1, "speed": 0.5, "cost_per_hour": 1.0},
                {"name": "C", "accelerators": 2, "cost_per_hour": 2.0},
                {"name": "D", "accelerators": 1, "speed": 0.8, "cost_per_hour": 1.0},
            ],
            "links": {
                "default": {"bandwidth_bps": 1e9, "latency_s": 0.02},
                "pairs": [
                    {"sites": ["A", "B"], "bandwidth_bps": 1e7, "latency_s": 0.05},
                    {"sites": ["B", "D"], "bandwidth_bps": 1e10, "latency_s": 0.001},
                ],
            },
            "job": {"tokens": 1e9, "step_s": 0.2, "H": [5, 20, 100], "codecs": ["none", "int8"], "tiers": False, **job},
        }
    )


def _brute(pool: Pool) -> list[tuple[float, float, tuple[int, ...]]]:
    """(hours, cost, workers) of every placement: every order of every shape, every H and codec,
    both paces, computed here from the model's formulas."""
    bw, lat = pool.matrix()
    job, out = pool.job, []
    intra = pool.links.intra
    for workers in itertools.product(*[range(0, s.accelerators + 1) for s in pool.sites]):
        sites = [i for i, w in enumerate(workers) if w]
        if not sites or any(w not in {0, 1, 2} for w in workers):
            continue
        step = {
            i: job.step_s / pool.sites[i].speed
            + (
                0
                if workers[i] == 1
                else 2 * (workers[i] - 1) / workers[i] * 4 * P * 8 / intra.bandwidth_bps + 2 * (workers[i] - 1) * intra.latency_s
            )
            for i in sites
        }
        t32 = min(sum_seconds(sh, list(o), 4 * P, bw, lat) for sh in SHAPES for o in itertools.permutations(sites))
        sync = {"none": t32, "int8": sum_seconds("ring", sites, P, bw, lat, codec=True)}
        for pace in ("lockstep", "adaptive"):
            clock = min(step.values()) if pace == "adaptive" else max(step.values())
            choice = None
            for c in ("none", "int8"):  # the rule: least compression, then smallest H, reaching 90%
                for H in job.H:
                    if choice is None and H * clock / (H * clock + sync[c]) >= job.utilization:
                        choice = (c, H)
            c, H = choice or ("int8", job.H[-1])
            round_s = H * clock + sync[c]
            tokens = sum(workers[i] * TPS * H * (clock / step[i] if pace == "adaptive" else 1) for i in sites)
            hours = job.tokens / tokens * round_s / 3600
            out.append((hours, hours * sum(workers[i] * pool.sites[i].cost_per_hour for i in sites), workers))
    return out


def test_the_choice_is_the_brute_force_optimum() -> None:
    pool = _pool()
    best = Placer(pool, P, TPS).search()[0]
    brute = _brute(pool)
    assert best.hours == pytest.approx(min(h for h, _, _ in brute), rel=1e-9)
    # within a deadline, the cheapest
    pool = _pool(objective="cost", deadline_h=best.hours * 2)
    cheap = Placer(pool, P, TPS).search()[0]
    ok = [(c, h) for h, c, _ in _brute(pool) if h <= best.hours * 2]
    assert cheap.cost == pytest.approx(min(ok)[0], rel=1e-9)
    assert cheap.hours <= best.hours * 2
    assert cheap.cost < best.cost


def test_a_budget_and_data_that_may_not_leave() -> None:
    data = _pool().model_dump()
    data["sites"][1].update(corpus="/tmp/b.txt", data_may_leave=False)
    pool = Pool.model_validate(data)
    for p in Placer(pool, P, TPS).search():
        assert p.workers[1] >= 1, "a site whose data may not leave takes part in every placement"
    free = Placer(_pool(), P, TPS).search()[0]
    budget = Placer(_pool(budget=free.cost * 0.8), P, TPS).search()[0]
    assert budget.cost <= free.cost * 0.8


def test_the_ring_avoids_the_slow_pair_and_the_naive_one_does_not() -> None:
    pool = _pool(codecs=["none"])
    placer = Placer(pool, P, TPS)
    full = placer.evaluate((1, 1, 1, 1), "lockstep", False)
    assert full is not None
    ring = list(full.order)
    if full.shape == "ring":
        pairs = {frozenset(p) for p in zip(ring, [*ring[1:], ring[0]], strict=True)}
        assert frozenset((0, 1)) not in pairs
    naive = placer.naive(full)
    assert naive.order == (0, 1, 2, 3) and naive.shape == "ring"
    assert naive.sync_s > 10 * full.sync_s


def test_place_writes_a_config_that_runs_and_sends_only_where_planned(tmp_path: Path) -> None:
    pool_file = tmp_path / "pool.yaml"
    pool = {
        "sites": [{"name": n, "accelerators": 1} for n in "ABCD"],
        "links": {"default": {"bandwidth_bps": 1e9, "latency_s": 0.002}, "pairs": [{"sites": ["A", "B"], "bandwidth_bps": 1e6, "latency_s": 0.002}]},
        "job": {
            "tokens": 5120,
            "step_s": 0.01,
            "H": [5],
            "codecs": ["none"],
            "tiers": False,
            "set": ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "train.batch_size=2", "model.block_size=32",
                    "guard.enabled=false", "run.baseline=none", "train.save_final=false"],
        },
    }  # fmt: skip
    pool_file.write_text(yaml.safe_dump(pool))
    out = tmp_path / "placed.yaml"
    r = subprocess.run(
        [sys.executable, "-m", "geotrain", "place", str(pool_file), "-o", str(out), "--json", str(tmp_path / "p.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    placed = json.loads((tmp_path / "p.json").read_text())
    cfg = load_config(out)
    assert cfg.topology.exchange.order == placed["chosen"]["order"]
    assert cfg.train.steps == 20 and cfg.sync.H == 5
    run = subprocess.run(
        [sys.executable, "-m", "geotrain", "train", "--config", str(out), "-o", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    s = read_summary(tmp_path / "run")
    planned = placed["chosen"]["link_bytes_per_round"]
    assert set(s["link_bytes"]) == set(planned), "bytes crossed only the links the placement uses"
    assert "A->B" not in s["link_bytes"] and "B->A" not in s["link_bytes"]
    exchanges = s["rounds"]  # (the last, partial round included)
    for link, per_round in planned.items():  # + the rounds' small control sums over the same links
        assert per_round * exchanges <= s["link_bytes"][link] <= per_round * exchanges * 1.05, link


BAD = [
    ({"sites": []}, "sites: "),
    ({"sites": [{"name": "A", "accelerators": 1}, {"name": "A", "accelerators": 2}]}, "sites: site names must be unique"),
    ({"sites": [{"name": "A b", "accelerators": 1}]}, "sites[0].name"),
    ({"sites": [{"name": "A", "accelerators": -1}]}, "sites[0].accelerators"),
    ({"sites": [{"name": "A", "accelerators": 0}]}, "sites: no site lends an accelerator"),
    ({"sites": [{"name": "A", "accelerators": 1, "speed": 0}]}, "sites[0].speed"),
    ({"sites": [{"name": "A", "accelerators": 1, "data_may_leave": False}]}, "data_may_leave"),
    ({"links": {"default": {"bandwidth_bps": 0, "latency_s": 0.01}}}, "links.default.bandwidth_bps"),
    (
        {
            "links": {
                "default": {"bandwidth_bps": 1e9, "latency_s": 0.01},
                "pairs": [{"sites": ["A", "Z"], "bandwidth_bps": 1e9, "latency_s": 0}],
            }
        },
        "links.pairs[0].sites: unknown site 'Z'",
    ),
    (
        {
            "links": {
                "default": {"bandwidth_bps": 1e9, "latency_s": 0.01},
                "pairs": [{"sites": ["A", "A"], "bandwidth_bps": 1e9, "latency_s": 0}],
            }
        },
        "links.pairs[0].sites",
    ),
    ({"job": {"tokens": 0, "step_s": 1}}, "job.tokens"),
    ({"job": {"tokens": 1e6}}, "job.step_s"),
    ({"job": {"tokens": 1e6, "step_s": 1, "objective": "cost"}}, "job.deadline_h"),
    ({"job": {"tokens": 1e6, "step_s": 1, "codecs": ["topk"]}}, "job.codecs"),
    ({"job": {"tokens": 1e6, "step_s": 1, "H": [0]}}, "job.H"),
    ({"job": {"tokens": 1e6, "step_s": 1, "set": ["sync.algorithm=nope"]}}, "job.config: sync.algorithm"),
    ({"extra": 1}, "extra"),
]


@pytest.mark.parametrize("change,message", BAD)
def test_a_bad_pool_is_refused_in_one_line(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    good = {
        "sites": [{"name": "A", "accelerators": 1}, {"name": "B", "accelerators": 1}],
        "links": {"default": {"bandwidth_bps": 1e9, "latency_s": 0.01}},
        "job": {"tokens": 1e6, "step_s": 1.0, "params": 1000, "tokens_per_step": 10},
    }
    f = tmp_path / "pool.yaml"
    f.write_text(yaml.safe_dump({**good, **change}))
    if "job.config" not in message:
        with pytest.raises(ConfigError, match=None):
            load_pool(f)
    r = subprocess.run(
        [sys.executable, "-m", "geotrain", "place", str(f), "-o", str(tmp_path / "x.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stdout
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert message in r.stderr, r.stderr
    assert not (tmp_path / "x.yaml").exists()


def test_the_shipped_pools_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each shipped pool places, and the config it writes passes the launcher's checks (its data
    exists: a pool once named a corpus the repository did not have)."""
    from geotrain.launch.preflight import preflight

    monkeypatch.chdir(ROOT)
    for f in sorted((ROOT / "scenarios" / "place").glob("*.yaml")):
        pool = load_pool(f)
        base = load_config(None, pool.job.set)
        out, cfg, _ = run_place(pool, pool.job.params or 437_000, pool.job.tokens_per_step or 256, base)
        key = "cost" if pool.job.objective == "cost" else "hours"  # (the naive placement may be late: then it costs less)
        assert math.isfinite(out["chosen"]["hours"]), f.name
        if out["naive"]["hours"] <= (pool.job.deadline_h or math.inf):
            assert out["chosen"][key] <= out["naive"][key] * (1 + 1e-9), f.name
        assert cfg.topology.exchange.order == out["chosen"]["order"]
        preflight(cfg)


def test_an_elastic_base_config_gets_a_ring_in_the_order_that_avoids_the_slow_pair() -> None:
    """Elastic rounds take a ring only (a fixed hub or root would fail every round it is lost in)."""
    pool = load_pool(ROOT / "scenarios" / "place" / "slow-pair.yaml")
    plain, _, _ = run_place(pool, 437_000, 256, load_config(None, pool.job.set))
    assert plain["chosen"]["shape"] == "hub"  # at 5 ms and 1.75 MB, two hops beat the ring's six
    out, cfg, _ = run_place(pool, 437_000, 256, load_config(None, [*pool.job.set, "elastic.enabled=true"]))
    order = out["chosen"]["order"]
    assert out["chosen"]["shape"] == "ring" and cfg.elastic.enabled
    assert {frozenset(p) for p in zip(order, [*order[1:], order[0]], strict=True)}.isdisjoint({frozenset("AB")})


def _place_cli(tmp_path: Path, pool: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "geotrain", "place", str(pool), "-o", str(tmp_path / "x.yaml"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_a_deadline_no_placement_meets_exits_1_and_writes_nothing(tmp_path: Path) -> None:
    pool = ROOT / "scenarios" / "place" / "unequal.yaml"
    r = _place_cli(tmp_path, pool, "--set", "job.deadline_h=0.001")
    assert r.returncode == 1 and "no placement meets job.deadline_h 0.001 h" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.yaml").exists()
    r = _place_cli(tmp_path, pool, "--set", "job.deadline_h=0.001", "--best-effort")
    assert r.returncode == 0 and (tmp_path / "x.yaml").exists(), r.stderr


def test_a_base_config_takes_the_best_placement_it_runs(tmp_path: Path) -> None:
    """Secure aggregation needs three sites: the pool is checked with its own sites, and the
    placements of two sites that would be faster are left out, not the whole pool refused."""
    pool = load_pool(ROOT / "scenarios" / "place" / "regions.yaml")
    sites = json.dumps([{"name": s.name, "workers": 1} for s in pool.sites])
    base = load_config(None, [f"topology.sites={sites}", *pool.job.set, "privacy.secure_aggregation=true"])
    out, cfg, _ = run_place(pool, 437_000, 256, base)
    assert out["skipped"]["count"] > 0 and "secure_aggregation" in out["skipped"]["why"][0]
    assert len(cfg.topology.sites) >= 3 and cfg.privacy.secure_aggregation
    r = _place_cli(
        tmp_path, ROOT / "scenarios" / "place" / "regions.yaml", "--set", 'job.set=["privacy.secure_aggregation=true"]'
    )
    assert r.returncode == 0 and "left out" in r.stdout, r.stdout + r.stderr
    assert load_config(tmp_path / "x.yaml").privacy.secure_aggregation
