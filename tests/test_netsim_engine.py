"""netsim: fat-tree arithmetic, the fabric's paths, max-min oracles, routing statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from geotrain.netsim.engine import max_min_rates, simulate
from geotrain.netsim.fabric import build_fabric
from geotrain.netsim.routing import ecmp, route, spray
from geotrain.netsim.sizing import size_fat_tree, split_ports, tier_ports
from geotrain.netsim.traffic import build_phases, derangement

C = 100e9  # bytes/s of every link in the hand-built oracles


def _rates(entries: list[tuple[int, int, float]], caps: list[float], n: int) -> np.ndarray:
    f, ln, w = (np.array(x) for x in zip(*entries, strict=True))
    return max_min_rates(f.astype(np.int64), ln.astype(np.int64), w.astype(float), np.array(caps, float), n)


# --------------------------------------------------------------------------- exact max-min oracles


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64])
def test_one_bottleneck_shared_by_n_flows_gives_each_c_over_n(n: int) -> None:
    # every flow crosses link 0 (capacity C) and a private link of capacity 10C
    entries = [(i, 0, 1.0) for i in range(n)] + [(i, 1 + i, 1.0) for i in range(n)]
    r = _rates(entries, [C] + [10 * C] * n, n)
    np.testing.assert_allclose(r, C / n, rtol=1e-12)


@pytest.mark.parametrize("hops", [2, 3, 5])
def test_parking_lot(hops: int) -> None:
    # one long flow over every link, one short flow per link: everyone gets C/2
    entries = [(0, link, 1.0) for link in range(hops)] + [(1 + link, link, 1.0) for link in range(hops)]
    np.testing.assert_allclose(_rates(entries, [C] * hops, hops + 1), C / 2, rtol=1e-12)


def test_unequal_bottlenecks_and_weighted_shares() -> None:
    # link A (cap 1) holds flows 0,1,2; link B (cap 2) holds flows 2,3: 1/3, 1/3, 1/3, then flow 3 gets 5/3
    r = _rates([(0, 0, 1.0), (1, 0, 1.0), (2, 0, 1.0), (2, 1, 1.0), (3, 1, 1.0)], [1.0, 2.0], 4)
    np.testing.assert_allclose(r, [1 / 3, 1 / 3, 1 / 3, 5 / 3], rtol=1e-12)
    # flow 0 split half/half over links 0 and 1 (cap 1 each), flow 1 on link 0: link 0 fills at 2/3 each
    r = _rates([(0, 0, 0.5), (0, 1, 0.5), (1, 0, 1.0)], [1.0, 1.0], 2)
    np.testing.assert_allclose(r, [2 / 3, 2 / 3], rtol=1e-12)


def test_event_driven_completion_frees_capacity() -> None:
    # two flows share one link; the short one finishes at 2*1/C, then the long one runs alone
    from geotrain.netsim.routing import FlowSet

    fs = FlowSet(
        size=np.array([1.0, 3.0]) * C,
        parent=np.arange(2),
        hops=np.array([1, 1]),
        ent_flow=np.array([0, 1]),
        ent_link=np.array([0, 0]),
        ent_weight=np.ones(2),
        num_parents=2,
    )
    res = simulate(fs, np.array([C]), hop_latency_s=1e-6, startup_s=1e-3)
    # short: 2 s; long: 2 s at C/2 (1C done) + 2C at C = 4 s; plus startup and a 2 us base RTT
    np.testing.assert_allclose(res.fct, [2.0 + 1e-3 + 2e-6, 4.0 + 1e-3 + 2e-6], rtol=1e-12)
    assert res.events == 2


# --------------------------------------------------------------------------- sizing arithmetic


@pytest.mark.parametrize("k", [4, 8, 16, 24, 48, 64])
def test_k_ary_three_tier_counts(k: int) -> None:
    s = size_fat_tree(k**3 // 4, k, 3)
    assert s.hosts_capacity == k**3 // 4
    assert s.switches == 5 * k * k // 4
    assert s.switch_links == 2 * k**3 // 4
    fab = build_fabric(k**3 // 4, tier_ports(k, 3), 800e9)
    assert fab.num_switches == 5 * k * k // 4
    assert fab.num_links == 2 * 3 * k**3 // 4  # host, edge-agg, agg-core cables, both directions


def test_two_tier_radix_256_and_paper_figures() -> None:
    assert size_fat_tree(32768, 256, 2).hosts_capacity == 32768  # paper: "32K GPUs ... full bisection"
    assert size_fat_tree(51200, 256, 2, ports=[[200, 50]]).hosts_capacity == 51200  # paper: "51K with 4:1"
    assert split_ports(256, 4) == (204, 51)
    assert size_fat_tree(2, 256, 2, oversubscription=[4]).hosts_capacity == 256 * 204
    big = size_fat_tree(800_000, 64, 4)
    assert big.switches_per_tier == [25_000, 25_000, 25_000, 12_500]  # paper's 75K = the lower three tiers
    assert big.switches == 87_500 and big.switch_links == 2_400_000
    assert big.optics_usd == pytest.approx(4.8e9)  # paper: "$5 billion"
    rail = size_fat_tree(800_000, 256, 3, rails=4)
    assert rail.switch_links == 1_600_000 and rail.chips == 4 * rail.switches  # links down by a third


def test_bad_sizing_input() -> None:
    for radix in (3, 2, 15):
        with pytest.raises(ValueError, match="radix"):
            split_ports(radix, 1)
    with pytest.raises(ValueError, match="oversubscription"):
        split_ports(16, 0.5)
    with pytest.raises(ValueError, match="do not fit"):
        size_fat_tree(1025, 16, 3)
    with pytest.raises(ValueError, match="tiers"):
        tier_ports(16, 5)


# --------------------------------------------------------------------------- fabric paths


@pytest.mark.parametrize(
    "hosts,radix,tiers,over",
    [(32, 8, 2, None), (100, 8, 3, None), (128, 8, 3, [3, 1]), (30, 4, 4, None), (150, 6, 4, None), (500, 12, 3, [2, 2])],
)
def test_every_path_is_a_walk_from_source_to_destination(hosts: int, radix: int, tiers: int, over: list[float] | None) -> None:
    fab = build_fabric(hosts, tier_ports(radix, tiers, over), 100e9)
    rng = np.random.default_rng(1)
    src = rng.integers(0, hosts, 400)
    dst = (src + rng.integers(1, hosts, 400)) % hosts
    lca = fab.lca_tier(src, dst)
    for c in np.unique(lca):
        idx = np.flatnonzero(lca == c)
        n_paths = fab.planes[c - 1]
        for plane in range(n_paths):
            links = fab.path_links(src[idx], dst[idx], int(c), np.full(idx.size, plane))
            assert np.all(fab.link_src[links[:, 0]] == src[idx]) and np.all(fab.link_dst[links[:, -1]] == dst[idx])
            assert np.all(fab.link_dst[links[:, :-1]] == fab.link_src[links[:, 1:]])  # consecutive links chain
        # all paths of a flow are distinct, and spraying uses exactly their union with the right shares
        one = idx[:3]
        paths = np.concatenate([fab.path_links(src[one], dst[one], int(c), np.full(one.size, p)) for p in range(n_paths)])
        assert len({tuple(p) for p in paths.tolist()}) == n_paths * one.size
        f, ln, w = fab.spray_entries(src[one], dst[one], int(c))
        for j in range(one.size):
            mine = ln[f == j]
            assert set(mine.tolist()) == set(paths[j :: one.size].ravel().tolist())
            assert w[f == j].sum() == pytest.approx(2 * c)  # one unit of rate per hop


def test_networkx_export_matches_arrays() -> None:
    pytest.importorskip("networkx")
    fab = build_fabric(16, tier_ports(4, 3), 100e9)
    g = fab.to_networkx()
    assert g.number_of_nodes() == 16 + 20 and g.number_of_edges() == fab.num_links


# --------------------------------------------------------------------------- routing on a fat tree


@pytest.mark.parametrize("radix,tiers", [(8, 2), (8, 3), (4, 4), (16, 3)])
def test_spraying_gives_every_flow_full_rate_for_any_permutation(radix: int, tiers: int) -> None:
    ports = tier_ports(radix, tiers)
    n = math.prod(d for d, _ in ports)
    fab = build_fabric(n, ports, 100e9)
    for seed in range(5):
        rng = np.random.default_rng(seed)
        src, dst = np.arange(n), derangement(n, rng)
        fs = spray(fab, src, dst, np.full(n, 1e9))
        res = simulate(fs, fab.link_cap)
        np.testing.assert_allclose(res.initial_rate, fab.link_cap[0], rtol=1e-9)
        assert res.makespan == pytest.approx(1e9 / fab.link_cap[0], rel=1e-9)


def test_ecmp_makespan_is_busiest_link_count_times_size_over_capacity() -> None:
    fab = build_fabric(1024, tier_ports(16, 3), 800e9)
    for seed in range(4):
        rng = np.random.default_rng(seed)
        fs = ecmp(fab, np.arange(1024), derangement(1024, rng), np.full(1024, 3e8), rng)
        busiest = fs.link_flows(fab.num_links).max()
        assert simulate(fs, fab.link_cap).makespan == pytest.approx(3e8 * busiest / fab.link_cap[0], rel=1e-9)


def test_m_flows_hashed_onto_m_links_use_one_minus_one_over_e_of_them() -> None:
    # leaf 0 of a two-tier tree with m down / m up ports sends one flow from each host to another leaf
    m, trials = 16, 400
    fab = build_fabric(2 * m * m // 2, tier_ports(2 * m, 2), 100e9)
    used = []
    for t in range(trials):
        rng = np.random.default_rng(t)
        fs = ecmp(fab, np.arange(m), np.arange(m) + m, np.ones(m), rng)
        uplinks = fs.ent_link[(fs.ent_link >= fab.up_offset[0]) & (fs.ent_link < fab.down_offset[0])]
        used.append(np.unique(uplinks).size / m)
    expected = 1 - (1 - 1 / m) ** m  # 0.644 for m = 16
    # standard error of the mean over 400 trials is ~0.005; the band is 4 of them
    assert abs(np.mean(used) - expected) < 0.02, (np.mean(used), expected)


def test_ecmp_throughput_on_random_permutations_is_forty_to_fifty_percent() -> None:
    # Hedera (NSDI 2010) reports ~45% of the optimal bisection bandwidth for ECMP on random traffic
    fab = build_fabric(1024, tier_ports(16, 3), 800e9)
    fractions = []
    for seed in range(8):
        rng = np.random.default_rng(seed)
        fs = ecmp(fab, np.arange(1024), derangement(1024, rng), np.ones(1024), rng)
        fractions.append(max_min_rates(fs.ent_flow, fs.ent_link, fs.ent_weight, fab.link_cap, 1024).mean() / fab.link_cap[0])
    assert 0.40 <= np.mean(fractions) <= 0.50, fractions
    assert np.std(fractions) < 0.02  # per-trial spread is small at 1,024 flows


def test_subflows_and_adaptive_sit_between_ecmp_and_spray() -> None:
    fab = build_fabric(1024, tier_ports(16, 3), 800e9)
    rng = np.random.default_rng(3)
    src, dst, size = np.arange(1024), derangement(1024, rng), np.full(1024, 3e8)
    spans = {
        r: simulate(route(fab, r, src, dst, size, np.random.default_rng(3), 8), fab.link_cap).makespan
        for r in ("ecmp", "ecmp_subflows", "adaptive", "spray")
    }
    assert spans["spray"] < spans["adaptive"] < spans["ecmp"]
    assert spans["spray"] < spans["ecmp_subflows"] < spans["ecmp"]


# --------------------------------------------------------------------------- traffic patterns


def test_traffic_patterns_shapes_and_bytes() -> None:
    rng = np.random.default_rng(0)
    (ring,) = build_phases("ring", 8, 800.0, rng)
    assert ring.repeat == 14 and np.all(ring.dst == (ring.src + 1) % 8) and np.all(ring.size == 100.0)
    hier = build_phases("hierarchical", 16, 1600.0, rng, group=4)
    assert [p.name for p in hier] == ["reduce-scatter in group", "all-reduce across groups", "all-gather in group"]
    assert [p.repeat for p in hier] == [3, 6, 3] and hier[1].size[0] == 1600.0 / 16
    assert np.all(hier[1].dst % 4 == hier[1].src % 4) and np.all(hier[0].dst // 4 == hier[0].src // 4)
    assert len(build_phases("hierarchical", 16, 1600.0, rng, group=4, in_group_on_fabric=False)) == 1
    (a2a,) = build_phases("all_to_all", 12, 1200.0, rng, group=4)
    pairs = set(zip(a2a.src.tolist(), a2a.dst.tolist(), strict=True))
    assert len(pairs) == 12 * 3 and all(s // 4 == d // 4 and s != d for s, d in pairs)
    (perm,) = build_phases("permutation", 50, 1.0, rng)
    assert sorted(perm.dst.tolist()) == list(range(50)) and not np.any(perm.dst == perm.src)


@pytest.mark.parametrize("routing", ["ecmp", "ecmp_subflows", "adaptive", "spray"])
def test_incremental_refill_equals_recomputing_from_scratch(routing: str) -> None:
    # unequal sizes make every completion a separate event: the hardest case for the refill shortcut
    from geotrain.netsim.engine import MaxMin

    fab = build_fabric(128, tier_ports(8, 3, [3, 1]), 100e9)
    for seed in range(3):
        rng = np.random.default_rng(seed)
        fs = route(fab, routing, np.arange(128), derangement(128, rng), rng.uniform(1e8, 3e8, 128), rng, 4)
        res = simulate(fs, fab.link_cap)
        n, remaining, done, alive = fs.num_flows, fs.size.copy(), np.zeros(fs.num_flows), np.ones(fs.num_flows, bool)
        mm, t, none = MaxMin(fs.ent_flow, fs.ent_link, fs.ent_weight, fab.link_cap, n), 0.0, np.zeros(n, bool)
        while alive.any():
            rate = mm.fill(np.zeros(n), none, alive)
            idx = np.flatnonzero(alive)
            left = remaining[idx] / rate[idx]
            dt = float(left.min())
            t += dt
            fin = left <= dt * (1 + 1e-9)
            remaining[idx] -= rate[idx] * dt
            done[idx[fin]] = t
            alive[idx[fin]] = False
        np.testing.assert_allclose(res.fct, done, rtol=1e-9)
