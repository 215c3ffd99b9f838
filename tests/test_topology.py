"""Rank arithmetic of the topology."""

from geotrain.comm.topology import Topology
from geotrain.config import TopologyConfig


def test_rank_layout_site_major() -> None:
    topo = Topology.from_config(
        TopologyConfig.model_validate(
            {
                "sites": [{"name": "eu", "workers": 3}, {"name": "us", "workers": 3}],
                "regions": [{"name": "europe", "sites": ["eu"]}, {"name": "america", "sites": ["us"]}],
            }
        )
    )
    assert topo.world_size == 6 and topo.num_sites == 2
    assert topo.site_ranks(1) == [3, 4, 5]
    assert topo.inter_ranks(2) == [2, 5]
    info = topo.info(4)
    assert (info.site, info.local_rank, info.tag) == ("us", 1, "us/1")
    assert topo.region_names == ("europe", "america") and topo.region_of == (0, 1) and topo.tiered
    # every rank is in exactly one intra group and one inter group
    assert sorted(r for s in range(2) for r in topo.site_ranks(s)) == list(range(6))
    assert sorted(r for i in range(3) for r in topo.inter_ranks(i)) == list(range(6))
