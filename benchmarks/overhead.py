"""Overhead of geotrain on 1 site x 1 worker against a plain PyTorch loop, same model and data.

Both run in fresh subprocesses with the same thread count, alternating (geotrain, plain, geotrain,
plain, ...) so machine noise hits both alike; the statistic is the median over repetitions of
loop seconds per step (everything inside the loop: data, forward, backward, hooks, optimizer,
scheduler, metrics). Prints a table and writes JSON.

    python benchmarks/overhead.py [--steps 200] [--reps 3] [--json overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = ["model.n_layer=4", "model.n_embd=128", "model.n_head=4", "model.block_size=64", "train.batch_size=8"]
SINGLE = [
    "topology.sites=[{name: A, workers: 1}]",
    "run.baseline=none",
    "sync.algorithm=ddp",
    "train.eval_batches=1",
    "train.eval_every=1000000",
    "train.log_every=1000000",
    "train.save_final=false",
]


def _cfg(steps: int) -> list[str]:
    return [*MODEL, *SINGLE, f"train.steps={steps}", "train.threads=2"]


def plain_loop(steps: int) -> float:
    """A straightforward PyTorch training loop; returns seconds per step."""
    import torch

    from geotrain.config import load_config
    from geotrain.data import build_rank_data
    from geotrain.models import GPT
    from geotrain.run.optim import build_optimizer

    cfg = load_config(None, _cfg(steps))
    torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    data = build_rank_data(cfg.data, 0, [1], cfg.model.block_size, cfg.train.batch_size, 1, cfg.train.seed)
    opt, sched = build_optimizer(
        cfg.optim, model, cfg.train.steps
    )  # same optimizer and schedule; not part of the framework overhead
    model.train()
    start = time.perf_counter()
    for _ in range(steps):
        x, y = data.train.next()
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        sched.step()
        loss.item()
    return (time.perf_counter() - start) / steps


def geotrain_loop(steps: int) -> float:
    """geotrain's real worker (process group, hooks, metrics) on 1x1; returns seconds per step."""
    from geotrain.comm.procs import free_port
    from geotrain.config import load_config
    from geotrain.run.worker import train

    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    env["MASTER_PORT"] = str(free_port())
    os.environ.update(env)
    with tempfile.TemporaryDirectory() as out:
        summary = train(load_config(None, _cfg(steps)), Path(out))
    assert summary is not None
    # loop time: wall clock from the first step to the end, less the evaluations in it (the one before the
    # first step is not in wall_seconds)
    return (summary["wall_seconds"] - (summary["eval_seconds"] - summary["eval_seconds_before"])) / steps


def _child(kind: str, steps: int) -> float:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", kind, "--steps", str(steps)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    return float(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default="overhead.json")
    ap.add_argument("--child", choices=["plain", "geotrain"])
    a = ap.parse_args()
    if a.child:
        print(plain_loop(a.steps) if a.child == "plain" else geotrain_loop(a.steps))
        return
    times: dict[str, list[float]] = {"geotrain": [], "plain": []}
    for _ in range(a.reps):
        for kind in ("geotrain", "plain"):
            times[kind].append(_child(kind, a.steps))
    g, p = statistics.median(times["geotrain"]), statistics.median(times["plain"])
    gmin, pmin = min(times["geotrain"]), min(times["plain"])
    result = {
        "steps": a.steps,
        "reps": a.reps,
        "geotrain_seconds_per_step": times["geotrain"],
        "plain_seconds_per_step": times["plain"],
        "geotrain_median": g,
        "plain_median": p,
        "overhead": g / p - 1,
        "overhead_of_best": gmin / pmin - 1,
        "target": 0.05,
    }
    print(f"{'loop':<10}{'median ms/step':>16}{'all reps (ms)':>30}")
    for kind, med in (("plain", p), ("geotrain", g)):
        print(f"{kind:<10}{med * 1000:>16.2f}{', '.join(f'{t * 1000:.1f}' for t in times[kind]):>30}")
    print(
        f"overhead: median {100 * result['overhead']:+.2f}%, best-of-{a.reps} {100 * result['overhead_of_best']:+.2f}% (target <= +5%)"
    )
    Path(a.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
