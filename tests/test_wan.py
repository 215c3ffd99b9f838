"""Link emulation: shared reservations across processes, pacing and latency of real sends, and
the chunked, laned collectives with emulation on (against torch.distributed.all_reduce)."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from geotrain.comm.emulate.inprocess import SharedLinks
from geotrain.config import load_config
from geotrain.errors import ConfigError
from tests.helpers import run_ranks, sum_mismatch, uniform_topology


def test_reservations_queue_per_directed_link(tmp_path: Path) -> None:
    links = SharedLinks(tmp_path / "links", 3)
    assert links.reserve(0, 1, 1.0, earliest=100.0) == 101.0
    assert links.reserve(0, 1, 0.5, earliest=100.0) == 101.5  # queued behind the first
    assert links.reserve(1, 0, 1.0, earliest=100.0) == 101.0  # the other direction is free
    assert links.reserve(0, 2, 2.0, earliest=100.0) == 102.0  # another link
    assert links.reserve(0, 1, 1.0, earliest=200.0) == 201.0  # an idle link starts when asked
    links.close(unlink=True)
    assert not (tmp_path / "links").exists()


def _reserve_many(path: str, n: int) -> None:
    links = SharedLinks(Path(path), 2)
    for _ in range(n):
        links.reserve(0, 1, 1.0, earliest=0.0)
    links.close()


def test_a_planted_link_state_file_is_refused(tmp_path: Path) -> None:
    """The link-state file has a predictable name in a folder everyone may write: a symlink, a
    hard link, a file of another user or one open to others is refused, never used."""
    import os

    from geotrain.errors import LaunchError

    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    cases = {}
    cases["symlink"] = tmp_path / "a"
    cases["symlink"].symlink_to(target)
    cases["hard link"] = tmp_path / "b"
    os.link(target, cases["hard link"])
    cases["mode"] = tmp_path / "c"
    cases["mode"].write_bytes(b"")
    cases["mode"].chmod(0o666)
    if os.geteuid() == 0:  # only root can give a file away
        cases["owner"] = tmp_path / "d"
        cases["owner"].write_bytes(b"")
        cases["owner"].chmod(0o600)
        os.chown(cases["owner"], 4242, 4242)
    expected = {"symlink": "symlink", "hard link": "hard link", "mode": "open to other users", "owner": "owned by uid 4242"}
    for case, path in cases.items():
        with pytest.raises(LaunchError, match=expected[case]):
            SharedLinks(path, 2)
    assert target.read_bytes() == b""  # nothing written through the links
    links = SharedLinks(tmp_path / "fresh", 2)  # made here: 0600, ours
    assert (tmp_path / "fresh").stat().st_mode & 0o777 == 0o600
    again = SharedLinks(tmp_path / "fresh", 2)  # every rank of the run opens it
    again.close()
    links.close(unlink=True)


def test_reservations_are_atomic_across_processes(tmp_path: Path) -> None:
    path = str(tmp_path / "links")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_reserve_many, args=(path, 200)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    links = SharedLinks(Path(path), 2)
    # 600 one-second reservations from three processes: none lost, none overlapping
    assert links.reserve(0, 1, 0.0, earliest=0.0) == 600.0
    links.close(unlink=True)


def _timed_across(rank: int, sites: int, workers: int, nbytes: int, bw: float, lat: float, lanes: int) -> float:
    from geotrain.bench.common import link_topology
    from geotrain.comm.session import rank_comm

    with rank_comm(link_topology(sites, workers, bw, lat), "inprocess", lanes) as (_, comm):
        x = torch.ones(nbytes // 4)
        dist.barrier()
        t0 = time.perf_counter()
        comm.all_reduce_across_sites(x)
        elapsed = time.perf_counter() - t0
        assert torch.all(x == sites)
        return elapsed


@pytest.mark.timeout(120)
def test_pacing_and_latency_of_real_sends() -> None:
    # 2 sites x 1 rank, 8 Mbit/s = 1 MB/s, 40 ms: 400 KB over a 2-site ring is one 200 KB send
    # per direction in reduce-scatter and one in all-gather: 2 x (0.2 s + 0.04 s)
    times = run_ranks(2, _timed_across, 2, 1, 400_000, 8e6, 0.04, 1)
    # a lower bound only: data cannot arrive before size / bandwidth + latency, however idle or
    # loaded the machine; how close the emulation comes to it is `geotrain bench link`'s target
    # (link.json). The ceiling only catches a send that waits out a timeout.
    assert min(times) >= 0.44 and max(times) < 30, times


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ranks_of_a_site_share_the_link() -> None:
    # 2 sites x 2 ranks: each rank carries half the tensor, but both halves cross the same A->B
    # link: 400 KB per direction at 1 MB/s is at least 0.4 s + one latency whatever the order
    # (without sharing, two 100 KB steps per rank would take 2 x (0.1 + 0.04) = 0.28 s)
    times = run_ranks(4, _timed_across, 2, 2, 400_000, 8e6, 0.04, 1)
    assert min(times) >= 0.42 and max(times) < 30, times  # as above: the bound that shows sharing is the lower one


def _laned_rank(rank: int, sites: int, workers: int) -> list:
    from geotrain.comm.session import rank_comm

    topo = uniform_topology(sites, workers)
    errors = []
    with rank_comm(topo, "inprocess", lanes=3, chunk_bytes=4096) as (_, comm):
        for how in ("hierarchical", "flat", "across"):
            for n in (1, 7, 1000, 4099, 20011):
                for dtype in (torch.float32, torch.float64):
                    seed = 7919 * n + (topo.site_of(rank) if how == "across" else rank)
                    if bad := sum_mismatch(comm, how, n, dtype, seed):
                        errors.append(bad)
    return errors


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sites,workers", [(2, 2), pytest.param(3, 2, marks=pytest.mark.slow)])
def test_chunked_laned_collectives_match_all_reduce(sites: int, workers: int) -> None:
    for r, errors in enumerate(run_ranks(sites * workers, _laned_rank, sites, workers)):
        assert errors == [], f"rank {r}: {errors}"


@pytest.mark.parametrize(
    "override,field",
    [
        ("topology.links.inter.bandwidth_bps=0", "topology.links.inter.bandwidth_bps"),
        ("topology.links.inter.bandwidth_bps=-5", "topology.links.inter.bandwidth_bps"),
        ("topology.links.inter.latency_s=11", "topology.links.inter.latency_s"),
        ("topology.links.emulate=netem", "topology.links.emulate"),
        ("sync.lanes=0", "sync.lanes"),
        ("sync.chunk_bytes=10", "sync.chunk_bytes"),
    ],
)
def test_bad_link_settings_name_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(field + ":"), str(e.value)


def test_link_between_unknown_site_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("topology:\n  links:\n    between:\n      - {sites: [A, C], bandwidth_bps: 1.0e+8, latency_s: 0.04}\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value) == "topology.links.between[0].sites: unknown site 'C' (sites: A, B)"
    f.write_text("topology:\n  links:\n    between:\n      - {sites: [A, B], bandwidth_bps: 0, latency_s: 0.04}\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value).startswith("topology.links.between[0].bandwidth_bps:")


def test_pair_link_overrides_inter() -> None:
    from geotrain.comm.topology import Topology

    cfg = load_config(
        None,
        [
            "topology.sites.1.name=B",
            "topology.links.inter.latency_s=0.01",
        ],
    )
    data = cfg.model_dump()
    data["topology"]["sites"].append({"name": "C", "workers": 2})
    data["topology"]["links"]["between"] = [{"sites": ["C", "A"], "bandwidth_bps": 1e7, "latency_s": 0.15}]
    from geotrain.config import Config

    topo = Topology.from_config(Config.model_validate(data).topology)
    assert topo.link(0, 2).latency_s == topo.link(2, 0).latency_s == 0.15
    assert topo.link(0, 1).latency_s == 0.01
