"""The sum across sites follows topology.exchange: a ring in any order, a tree, a hub. Every
rank ends with the sum, bit-identical within a run, and each directed link carries exactly the
bytes geotrain.plan.exchange predicts (what geotrain place plans with)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from geotrain.comm.procs import run_ranks
from geotrain.comm.topology import Topology
from geotrain.config import Config, ConfigError, TopologyConfig, load_config
from geotrain.plan.exchange import best_order, clusters, coded_link_bytes, link_bytes, sum_seconds, tree_edges
from tests.helpers import read_summary, train_cli

CASES = [  # (sites, workers, shape, order)
    (4, 1, "ring", ["s2", "s0", "s3", "s1"]),
    (4, 1, "tree", ["s1", "s3", "s0", "s2"]),
    (4, 1, "hub", ["s3", "s0", "s1", "s2"]),
    (3, 2, "ring", ["s1", "s2", "s0"]),
    (5, 1, "tree", []),
    (3, 2, "hub", ["s2", "s1", "s0"]),
]


def _topology(sites: int, workers: int, shape: str, order: list[str]) -> Topology:
    cfg = TopologyConfig.model_validate(
        {
            "sites": [{"name": f"s{i}", "workers": workers} for i in range(sites)],
            "exchange": {"order": order, "shape": shape},
            "links": {"emulate": "off"},
        }
    )
    return Topology.from_config(cfg)


def _rank(rank: int, sites: int, workers: int, shape: str, order: list[str], n: int) -> dict:
    from geotrain.comm.collectives import Collectives
    from geotrain.comm.groups import ProcessGroups

    topo = _topology(sites, workers, shape, order)
    groups = ProcessGroups.build(topo, "gloo", timeout_s=60)
    try:
        comm = Collectives(groups)
        site = topo.site_of(rank)
        x = torch.randn(n, generator=torch.Generator().manual_seed(site), dtype=torch.float64).float()
        comm.all_reduce_across_sites(x)
        y = torch.randn(n, generator=torch.Generator().manual_seed(100 + rank)).float()
        truth = sum(torch.randn(n, generator=torch.Generator().manual_seed(100 + r)).float() for r in range(topo.world_size))
        comm.all_reduce_hierarchical(y)
        return {"x": x.tolist(), "y_err": float((y - truth).abs().max()), "links": dict(comm.stats.link_bytes), "site": site}
    finally:
        groups.destroy()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sites,workers,shape,order", CASES)
def test_every_shape_sums_and_each_link_carries_the_predicted_bytes(
    sites: int, workers: int, shape: str, order: list[str]
) -> None:
    n = 1001  # below a lane chunk: one sum per collective
    res = run_ranks(sites * workers, _rank, sites, workers, shape, order, n)
    truth = sum(torch.randn(n, generator=torch.Generator().manual_seed(s), dtype=torch.float64).float() for s in range(sites))
    for r in res:
        assert r["x"] == res[0]["x"], "every rank ends bit-identical"
        assert r["y_err"] < 1e-4
    assert max(abs(a - b) for a, b in zip(res[0]["x"], truth.tolist(), strict=True)) < 1e-4
    measured: dict[tuple[int, int], int] = {}
    for r in res:
        for dst, nbytes in r["links"].items():
            measured[(r["site"], dst)] = measured.get((r["site"], dst), 0) + nbytes
    topo = _topology(sites, workers, shape, order)
    # two sums: the vector across sites (no in-site step), then the hierarchical one (same shards across)
    expected = link_bytes(shape, list(topo.order) or list(range(sites)), n, carriers=workers)
    assert measured == {k: 2 * v for k, v in expected.items() if v}


def test_plan_bytes_per_shape() -> None:
    # ring over 3 sites, 9 values, one carrier: each link 2 * (9 - 3) values
    assert link_bytes("ring", [0, 1, 2], 9) == {(0, 1): 48, (1, 2): 48, (2, 0): 48}
    assert link_bytes("hub", [2, 0, 1], 10) == {(2, 0): 40, (0, 2): 40, (2, 1): 40, (1, 2): 40}
    assert tree_edges([5, 6, 7, 8]) == [(5, 6), (5, 7), (6, 8)]
    # gather codec: its whole payload to every other site
    assert coded_link_bytes([0, 1], 100, lambda v: v // 10 + 20, gather=True) == {(0, 1): 30, (1, 0): 30}


def test_the_order_avoids_a_slow_pair_and_the_shape_follows_latency() -> None:
    n = 4
    bw = [[10e9] * n for _ in range(n)]
    lat = [[0.001] * n for _ in range(n)]
    bw[0][1] = bw[1][0] = 10e6  # one slow pair
    order, t = best_order("ring", range(n), 100e6, bw, lat)
    pairs = {frozenset(p) for p in zip(order, [*order[1:], order[0]], strict=True)}
    assert frozenset((0, 1)) not in pairs
    assert t < sum_seconds("ring", [0, 1, 2, 3], 100e6, bw, lat) / 100
    # small payload, long latency: the hub's two hops beat the ring's 2(n-1)
    lat = [[0.1] * n for _ in range(n)]
    bw = [[10e9] * n for _ in range(n)]
    assert sum_seconds("hub", [0, 1, 2, 3], 1e3, bw, lat) < sum_seconds("tree", [0, 1, 2, 3], 1e3, bw, lat)
    assert sum_seconds("tree", [0, 1, 2, 3], 1e3, bw, lat) < sum_seconds("ring", [0, 1, 2, 3], 1e3, bw, lat)
    # big payload: the ring's (n-1)/n beats sending the whole vector
    lat = [[0.001] * n for _ in range(n)]
    assert sum_seconds("ring", [0, 1, 2, 3], 1e9, bw, lat) < sum_seconds("hub", [0, 1, 2, 3], 1e9, bw, lat)


def test_latency_clusters() -> None:
    lat = [[0, 0.002, 0.08, 0.08], [0.002, 0, 0.08, 0.08], [0.08, 0.08, 0, 0.003], [0.08, 0.08, 0.003, 0]]
    assert clusters(range(4), lat) == [[0, 1], [2, 3]]
    flat = [[0.05] * 4 for _ in range(4)]
    assert clusters(range(4), flat) == [[0, 1, 2, 3]]


def test_exchange_config_refusals() -> None:
    base = {"topology": {"sites": [{"name": "A", "workers": 1}, {"name": "B", "workers": 1}, {"name": "C", "workers": 1}]}}
    ok = Config.model_validate(
        {**base, "topology": {**base["topology"], "exchange": {"order": ["C", "A", "B"], "shape": "tree"}}}
    )
    assert Topology.from_config(ok.topology).ring_names == ["C", "A", "B"]
    for exchange, fields, match in [
        ({"order": ["A", "B"]}, {}, "exchange.order: must name every site once"),
        ({"order": ["A", "B", "B"]}, {}, "exchange.order"),
        ({"shape": "star"}, {}, "shape"),
        ({"shape": "hub"}, {"elastic": {"enabled": True}}, "elastic.enabled: not with topology.exchange.shape=hub"),
        ({"shape": "tree"}, {"sync": {"codec": "int8"}}, "sync.codec: not with topology.exchange.shape=tree"),
        ({"region_shape": "hub"}, {"sync": {"allreduce": "flat"}}, "sync.allreduce"),
        ({"shape": "tree"}, {"privacy": {"secure_aggregation": True}}, "privacy.secure_aggregation: not with"),
    ]:
        data = {**base, **fields, "topology": {**base["topology"], "exchange": exchange}}
        with pytest.raises(ConfigError, match=match):
            load_config(None, [f"{k}={json.dumps(v)}" for k, v in data.items()])


REGIONS = [
    "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}, {name: D, workers: 1}]",
    "topology.regions=[{name: eu, sites: [A, B]}, {name: us, sites: [C, D]}]",
    "topology.links.emulate=off",
    "sync.algorithm=diloco",
    "sync.H=5",
    "sync.region_every=2",
    "train.steps=20",
    "guard.enabled=false",
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "extra,links",
    [
        # two tiers: regions sum through a tree (two sites: one edge), the world through hub D
        (["topology.exchange={order: [D, B, A, C], shape: hub, region_shape: tree}"],
         {"A->B", "B->A", "C->D", "D->C", "D->A", "A->D", "D->B", "B->D"}),
        # site-level DP's noised sums (no secure aggregation) through a tree over the order
        (["topology.exchange={order: [C, A, B, D], shape: tree}", "sync.region_every=0", "topology.regions=[]",
          "privacy.dp.unit=site", "privacy.dp.noise_multiplier=0.1"],
         {"C->A", "A->C", "C->B", "B->C", "A->D", "D->A"}),
    ],
)  # fmt: skip
def test_runs_follow_the_exchange_in_two_tiers_and_with_site_dp(tmp_path: Path, extra: list[str], links: set[str]) -> None:
    out = tmp_path / "run"
    train_cli(out, [*REGIONS, *extra])
    s = read_summary(out)
    assert len(set(s["global_param_hash"].values())) == 1 and s["hashes_agree_within_sites"]
    assert set(s["link_bytes"]) == links, s["link_bytes"]
