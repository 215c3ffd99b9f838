"""``geotrain bench scale``'s FSDP parts (``sync.within_site=fsdp``), each in real processes
(Gloo on 127.0.0.1) built from the same parts as a training rank:

- ``memory``: a GPT of at least 50M parameters on 2 sites x 2 workers, DiLoCo, after two rounds
  (H=1, so the outer momentum exists): the bytes one rank holds in parameters, gradients, inner
  AdamW state and outer state (fp32 global copy + momentum), summed over the storages actually
  allocated (each counted once; FSDP's padded shard storage as allocated), replicated against
  FSDP;
- ``overhead``: geotrain's FSDP DiLoCo rank (1 site x 2 workers, H=10, its optimizer hooks and outer
  step included) against a plain FSDP2 loop (the same ``fully_shard`` layout, model, batches, AdamW and
  clipping), in alternating blocks of H steps; the median of the per-block relative step time;
- ``gpt2_small``: a GPT-2-small-shaped model (12 x 768, 12 heads, vocabulary 50,257, context 128;
  124M parameters), DiLoCo + FSDP on 2 sites x 2 workers, 20 steps on byte tokens of the default
  corpus: first and last loss, whether every rank ends on the bit-identical global model, seconds
  per step.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.nn as nn

TARGETS = {"memory_ratio": 0.55, "overhead_median": 0.05}
MEMORY_MODEL = {"n_layer": 8, "n_embd": 768, "n_head": 12, "block_size": 64}
OVERHEAD_MODEL = {"n_layer": 4, "n_embd": 256, "n_head": 4, "block_size": 64}
GPT2_SMALL = {"n_layer": 12, "n_embd": 768, "n_head": 12, "block_size": 128, "vocab": 50257}


def held_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shard's storage)."""
    from geotrain.sync.base import local_tensor

    seen: dict[int, int] = {}
    for t in tensors:
        s = local_tensor(t).untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.numel() > 1]


def _rank_parts(sites: int, workers: int, model_kw: dict[str, int], within: str, sync: list[str], vocab: int) -> Any:
    """A training rank's parts (config, collectives, model, optimizer, sync algorithm, data)."""
    from geotrain.comm.session import open_collectives
    from geotrain.comm.topology import Topology
    from geotrain.config import Config, load_config
    from geotrain.data import build_rank_data
    from geotrain.models import build_model
    from geotrain.round import build_round
    from geotrain.run.fsdp import shard_model
    from geotrain.run.optim import build_optimizer

    sets = [f"model.{k}={v}" for k, v in model_kw.items() if k != "vocab"]
    cfg = load_config(None, [*sets, "train.batch_size=4", f"sync.within_site={within}", *sync])
    whole = cfg.model_dump()
    whole["topology"]["sites"] = [{"name": f"s{i}", "workers": workers} for i in range(sites)]
    cfg = Config.model_validate(whole)
    comm = open_collectives(
        Topology.from_config(cfg.topology), backend="gloo", timeout_s=900, lanes=2, site_mesh=within == "fsdp"
    )
    g = comm.groups
    torch.manual_seed(0)
    model = build_model(cfg.model, vocab)
    if g.mesh is not None:
        shard_model(model, g.mesh, "fp32")
    opt, sched = build_optimizer(cfg.optim, model, 1000)
    sync_alg = build_round(cfg.sync, model, opt, comm, grad_clip=cfg.optim.grad_clip)
    data = build_rank_data(cfg.data, g.me.rank, [workers] * sites, cfg.model.block_size, 4, 1, 0)
    return cfg, comm, model, opt, sync_alg, data


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    opt.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    opt.step()
    return float(loss.detach())


def memory_rank(rank: int, within: str) -> dict[str, Any]:
    from geotrain.comm.session import close_collectives
    from geotrain.models import count_params

    H1 = ["sync.H=1"]
    _, comm, model, opt, sync, data = _rank_parts(2, 2, MEMORY_MODEL, within, H1, 256)
    try:
        for _ in range(2):
            x, y = data.train.next()
            _step(model, opt, x, y)
        params = [p for p in model.parameters()]
        grads = [p.grad for p in params if p.grad is not None]
        # the round engine's global model and its outer optimizers' state (one per fragment and tier)
        outer = list(sync.global_parameters()) + [t for o in sync.globals.steps.values() for t in _state_tensors(o)]
        parts = {
            "parameters": held_bytes(params),
            "gradients": held_bytes(grads),
            "inner_optimizer": held_bytes(_state_tensors(opt)),
            "outer_state": held_bytes(outer),
        }
        return {"params": count_params(model), **parts, "total": sum(parts.values())}
    finally:
        sync.close()
        close_collectives(comm, unlink_links=rank == 0)


def overhead_rank(rank: int, blocks: int) -> dict[str, Any]:
    """geotrain's FSDP DiLoCo and a plain FSDP2 loop, alternating blocks of H steps on the same batches."""
    from geotrain.comm.session import close_collectives
    from geotrain.run.fsdp import shard_model

    H = 10
    cfg, comm, model, opt, sync, data = _rank_parts(1, 2, OVERHEAD_MODEL, "fsdp", [f"sync.H={H}"], 256)
    try:
        torch.manual_seed(0)
        from geotrain.models import build_model

        plain = build_model(cfg.model, 256)
        assert comm.groups.mesh is not None
        shard_model(plain, comm.groups.mesh, "fp32")
        from geotrain.run.optim import decay_groups

        plain_opt = torch.optim.AdamW(
            decay_groups(list(plain.parameters()), cfg.optim.weight_decay), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas)
        )
        batches = [data.train.next() for _ in range(H)]

        def plain_step(x: torch.Tensor, y: torch.Tensor) -> None:
            plain_opt.zero_grad(set_to_none=True)
            plain(x, y).backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.optim.grad_clip)
            plain_opt.step()

        def block(fn: Any) -> float:
            torch.distributed.barrier(group=comm.groups.intra)
            t = time.perf_counter()
            for x, y in batches:
                fn(x, y)
            return time.perf_counter() - t

        block(lambda x, y: _step(model, opt, x, y))  # warm-up of both
        block(plain_step)
        ours, theirs = [], []
        for i in range(blocks):  # alternate which goes first
            if i % 2:
                theirs.append(block(plain_step))
                ours.append(block(lambda x, y: _step(model, opt, x, y)))
            else:
                ours.append(block(lambda x, y: _step(model, opt, x, y)))
                theirs.append(block(plain_step))
        return {"geotrain_block_seconds": ours, "plain_block_seconds": theirs, "steps_per_block": H, "rounds": sync.rounds}
    finally:
        sync.close()
        close_collectives(comm, unlink_links=rank == 0)


def gpt2_rank(rank: int, steps: int) -> dict[str, Any]:
    from geotrain.comm.session import close_collectives
    from geotrain.models import count_params

    _, comm, model, opt, sync, data = _rank_parts(2, 2, GPT2_SMALL, "fsdp", ["sync.H=10"], GPT2_SMALL["vocab"])
    try:
        losses, t = [], time.perf_counter()
        for _ in range(steps):
            x, y = data.train.next()
            losses.append(_step(model, opt, x, y))
        seconds = time.perf_counter() - t
        sync.finish()
        return {
            "params": count_params(model),
            "losses": losses,
            "seconds_per_step": seconds / steps,
            "hash": sync.global_hash(),
            "rounds": sync.rounds,
        }
    finally:
        sync.close()
        close_collectives(comm, unlink_links=rank == 0)


def bench_memory(timeout: float = 1200) -> dict[str, Any]:
    from geotrain.comm.procs import run_ranks

    per = {w: run_ranks(4, memory_rank, w, timeout=timeout) for w in ("replicate", "fsdp")}
    rep, fs = per["replicate"][0], per["fsdp"][0]
    return {
        "model": MEMORY_MODEL,
        "params": rep["params"],
        "layout": "2 sites x 2 workers, DiLoCo, AdamW; rank 0",
        "replicate": rep,
        "fsdp": fs,
        "fsdp_per_rank_totals": [r["total"] for r in per["fsdp"]],
        "replicate_bytes_per_rank": rep["total"],
        "fsdp_bytes_per_rank": max(r["total"] for r in per["fsdp"]),
        "ratio": max(r["total"] for r in per["fsdp"]) / rep["total"],
    }


def bench_overhead(blocks: int = 9, timeout: float = 1200) -> dict[str, Any]:
    from geotrain.comm.procs import run_ranks

    r = run_ranks(2, overhead_rank, blocks, timeout=timeout)[0]
    rel = [a / b - 1 for a, b in zip(r["geotrain_block_seconds"], r["plain_block_seconds"], strict=True)]
    return {"model": OVERHEAD_MODEL, "layout": "1 site x 2 workers", **r, "relative": rel, "median": statistics.median(rel)}


def bench_gpt2_small(steps: int = 20, timeout: float = 3000) -> dict[str, Any]:
    from geotrain.comm.procs import run_ranks

    ranks = run_ranks(4, gpt2_rank, steps, timeout=timeout)
    r0 = ranks[0]
    return {
        "model": GPT2_SMALL,
        "params": r0["params"],
        "layout": "2 sites x 2 workers, DiLoCo H=10 + FSDP, byte tokens, batch 4 x 128 per rank",
        "steps": steps,
        "first_loss": r0["losses"][0],
        "last_loss": r0["losses"][-1],
        "losses": r0["losses"],
        "hashes_agree": len({r["hash"] for r in ranks}) == 1,
        "seconds_per_step": max(r["seconds_per_step"] for r in ranks),
        "rounds": r0["rounds"],
    }
