"""Shared helpers for multi-process tests: real Gloo process groups on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

from geotrain.config import TopologyConfig
from geotrain.procs import run_ranks
from geotrain.topology import Topology

__all__ = ["REPO", "run_ranks", "uniform_topology"]

REPO = Path(__file__).resolve().parent.parent


def uniform_topology(sites: int, workers: int) -> Topology:
    """``sites`` sites named s0, s1, ... with ``workers`` ranks each."""
    cfg = TopologyConfig.model_validate({"sites": [{"name": f"s{i}", "workers": workers} for i in range(sites)]})
    return Topology.from_config(cfg)
