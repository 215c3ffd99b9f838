"""Shared helpers for multi-process tests: real Gloo process groups on 127.0.0.1."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from geotrain.config import TopologyConfig
from geotrain.launch import free_port
from geotrain.topology import Topology

REPO = Path(__file__).resolve().parent.parent


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], queue: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",
        LOCAL_WORLD_SIZE=str(world),
    )
    import torch

    torch.set_num_threads(1)
    try:
        queue.put((rank, fn(rank, *args), None))
    except Exception:  # report to the parent instead of hanging it
        queue.put((rank, None, traceback.format_exc()))
        sys.exit(1)


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 120) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``world`` spawned processes; return results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, value, err = queue.get(timeout=timeout)
            if err:
                raise AssertionError(f"rank {rank} failed:\n{err}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world)]


def uniform_topology(sites: int, workers: int) -> Topology:
    """``sites`` sites named s0, s1, ... with ``workers`` ranks each."""
    cfg = TopologyConfig.model_validate({"sites": [{"name": f"s{i}", "workers": workers} for i in range(sites)]})
    return Topology.from_config(cfg)
