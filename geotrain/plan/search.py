"""Layout search: every (TP, PP, DP, micro-batches, recomputation) that fits one GPU, ranked by
step time (Calculon, Isaacs et al. SC'23, and Megatron's model, Narayanan et al. 2021, search such
spaces; this one is a closed form per layout, so the whole space is enumerated).

A layout: ``t``-way tensor parallelism inside one scale-up domain (a rack of ``G`` GPUs), ``p``
pipeline stages of ``ceil(L/p)`` layers, ``d`` data-parallel replicas, ``m`` micro-batches of
``b`` sequences per replica and step, recomputation on or off. The global batch is fixed
(``parallel.global_batch_tokens``), so ``d = ceil(B / (b m))`` and every layout does the same work
per step. A rack holds ``floor(G/t)`` TP groups; as in the founding paper, those of one rack hold
the same stage of ``k = min(d, floor(G/t))`` replicas, so the gradient reduction starts on NVLink.

Step time of a layout (1F1B, non-interleaved):

- per micro-batch and stage: forward ``F = l (c + r)``, backward ``B = l (2c + r)`` (+ ``F`` with
  recomputation), where ``c`` is a layer's forward compute on ``t`` GPUs and ``r`` its TP
  all-reduces (plan/step.py, paper eq. 1; not overlapped);
- pipeline: ``(m + p - 1)(F + B + 2 q)``, ``q`` the stage-to-stage send (activations forward,
  their gradients backward) over the NIC; the bubble is the share ``(p-1)/(m+p-1)``;
- data parallel, hierarchical (reduce-scatter in the rack, ring across ``ceil(d/k)`` racks,
  all-gather in the rack), overlapped with the last micro-batch's backward pass layer by layer
  (only the excess over each layer's backward is exposed, and the last layer's reduction);
  ``shard_optimizer: optimizer`` all-gathers updated weights instead of gradients, ``full``
  reduce-scatters gradients only and all-gathers each layer's weights in every micro-batch's
  forward and backward pass (exposed where a gather outlasts the layer's compute).

Per-GPU memory: :func:`geotrain.plan.memory.gpu_memory`. A layout is kept if it fits
``HBM x (1 - memory_headroom)``. Ranked by seconds per token of the global batch (the step time
divided by the tokens it trains, which differ only by the rounding of ``d``).

Left out (docs/PLAN.md): interleaved and zero-bubble schedules, sequence/context and expert
parallelism, TP over the scale-out network, the optimizer step's own time, the output logits'
memory, uneven stage costs (the embedding is counted in the stage's memory, not its time), and
contention between the DP and PP traffic on the NICs.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from geotrain.plan.memory import gpu_memory
from geotrain.plan.step import allreduce_seconds


@dataclass(frozen=True)
class Machine:
    racks: int
    gpus_per_rack: int
    gpu_hbm_bytes: float
    gpu_flops: float  # peak FLOP/s of one GPU at the scenario's precision
    mfu: float
    scale_up_bytes_per_s: float
    nic_bytes_per_s: float


@dataclass(frozen=True)
class Work:
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    layer_params: float
    layer_forward_flops: float  # one sequence
    micro_batch: int
    global_batch_tokens: float
    weight_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    wire_bytes: float

    @property
    def batch_sequences(self) -> int:
        return max(1, math.ceil(self.global_batch_tokens / self.seq_len))


@dataclass(frozen=True)
class Space:
    """What the search may vary; a fixed degree is a one-element tuple."""

    tensor_parallel: tuple[int, ...]
    pipeline_parallel: tuple[int, ...] | None  # None: every distinct layers-per-stage
    recompute: tuple[bool, ...] = (False, True)
    shard: str = "none"
    headroom: float = 0.1


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """1F1B pipeline bubble: ``(p - 1) / (m + p - 1)`` of the pipeline time (Narayanan et al. 2021)."""
    return (stages - 1) / (micro_batches + stages - 1)


def _hier(size: float, k: int, racks: int, m: Machine) -> tuple[float, float]:
    """(in-rack, across-racks) seconds of a hierarchical all-reduce of ``size`` bytes per GPU; a
    reduce-scatter or an all-gather is half of each."""
    return allreduce_seconds(size, k, m.scale_up_bytes_per_s), allreduce_seconds(size / k, racks, m.nic_bytes_per_s)


def evaluate(w: Work, m: Machine, t: int, p: int, micro: int, recompute: bool, shard: str) -> dict[str, Any]:
    """Memory and step time of one layout (module docstring). ``d`` follows from the batch."""
    G = m.gpus_per_rack
    lps = math.ceil(w.layers / p)
    d = math.ceil(w.batch_sequences / (w.micro_batch * micro))
    k = max(1, min(d, G // t))
    racks_dp = math.ceil(d / k)
    stage_params = lps * w.layer_params + w.vocab * w.hidden  # the embedding (or the tied head) on an end stage
    mem = gpu_memory(
        stage_params,
        w.layer_params,
        lps,
        w.hidden,
        w.heads,
        w.seq_len,
        w.micro_batch,
        min(p, micro),
        t,
        d,
        w.weight_bytes,
        w.grad_bytes,
        w.optimizer_bytes,
        w.activation_bytes,
        recompute,
        shard,
    )
    b = w.micro_batch
    compute = w.layer_forward_flops * b / (t * m.gpu_flops * m.mfu)
    act = w.seq_len * b * w.hidden * w.wire_bytes / t  # per GPU, per TP all-reduce or stage send
    tp = 2 * allreduce_seconds(2 * act, t, m.scale_up_bytes_per_s)  # plan/step.py: two per layer and pass
    fwd = lps * (compute + tp)
    bwd = lps * (2 * compute + tp) + (fwd if recompute else 0.0)
    send = (act / m.nic_bytes_per_s + (t - 1) / t * act * t / m.scale_up_bytes_per_s) if p > 1 else 0.0
    pipeline = (micro + p - 1) * (fwd + bwd + 2 * send)
    grads = stage_params / t * w.grad_bytes
    weights = stage_params / t * w.weight_bytes
    g_in, g_out = _hier(grads, k, racks_dp, m)
    w_in, w_out = _hier(weights, k, racks_dp, m)
    if d == 1:
        reduce = 0.0
    elif shard == "none":
        reduce = g_in + g_out
    elif shard == "optimizer":
        reduce = (g_in + g_out) / 2 + (w_in + w_out) / 2
    else:
        reduce = (g_in + g_out) / 2
    per_layer_reduce, per_layer_bwd = reduce / lps, bwd / lps
    dp_exposed = per_layer_reduce + max(0.0, per_layer_reduce - per_layer_bwd) * (lps - 1) if reduce else 0.0
    gather_exposed = 0.0
    if shard == "full" and d > 1:
        gather = (w_in + w_out) / 2 / lps  # one layer's weights, gathered before each use
        hidden_by = compute  # the previous layer's forward (its backward is longer)
        gather_exposed = gather + 2 * micro * lps * max(0.0, gather - hidden_by)
    step = pipeline + dp_exposed + gather_exposed
    tokens = d * micro * b * w.seq_len
    ideal = 3 * w.layers * w.layer_forward_flops * d * micro * b / (t * p * d * m.gpu_flops)
    return {
        "tensor_parallel": t,
        "pipeline_parallel": p,
        "data_parallel": d,
        "layers_per_stage": lps,
        "micro_batches": micro,
        "micro_batch_size": b,
        "recompute": recompute,
        "shard_optimizer": shard,
        "gpus_used": t * p * d,
        "racks_used": math.ceil(p * d / (G // t)),  # racks whose TP-group slots it fills
        "dp_copies_per_rack": k,
        "dp_racks": racks_dp,
        "memory": mem,
        "memory_per_gpu_bytes": mem["total_bytes"],
        "gpu_hbm_bytes": m.gpu_hbm_bytes,
        "layer_forward_seconds": compute,
        "tp_seconds_per_layer_forward": tp,
        "stage_forward_seconds": fwd,
        "stage_backward_seconds": bwd,
        "pp_send_bytes": act if p > 1 else 0.0,
        "pp_send_seconds": send,
        "pipeline_seconds": pipeline,
        "bubble_fraction": bubble_fraction(p, micro),
        "bubble_seconds": pipeline * bubble_fraction(p, micro),
        "dp_grads_per_gpu_bytes": grads,
        "dp_reduce_seconds": reduce,
        "dp_exposed_seconds": dp_exposed,
        "fsdp_gather_exposed_seconds": gather_exposed,
        "step_seconds": step,
        "tokens_per_step": tokens,
        "seconds_per_token": step / tokens,
        "model_flops_utilization": ideal / step if step else 0.0,  # of the peak, on the GPUs it uses
    }


def _stages(layers: int, fixed: tuple[int, ...] | None) -> list[int]:
    """Pipeline depths with distinct layers per stage (``p = ceil(L / l)`` for every ``l``)."""
    if fixed is not None:
        return list(fixed)
    return sorted({math.ceil(layers / lps) for lps in range(1, layers + 1)})


def _micro_batches(m_min: int, most: int) -> list[int]:
    """The fewest micro-batches that fit the batch on the GPUs, and a few more (more micro-batches
    shrink the bubble but leave replicas idle, so the best is at or near the fewest)."""
    cand = {m_min, m_min + 1, m_min + 2, 2 * m_min, 4 * m_min, 8 * m_min}
    return sorted(c for c in cand if c <= most)


def search(w: Work, m: Machine, space: Space, top: int = 5) -> dict[str, Any]:
    """Enumerate ``space``, keep what fits, rank by seconds per token. Returns the best ``top``,
    the number evaluated, and the rejected count per reason."""
    G = m.gpus_per_rack
    budget = m.gpu_hbm_bytes * (1 - space.headroom)
    rejected: Counter[str] = Counter()
    kept: list[dict[str, Any]] = []
    closest: dict[str, Any] | None = None  # the rejected layout nearest to fitting, to explain a failure
    evaluated = 0
    most = max(1, w.batch_sequences // w.micro_batch)
    for t in space.tensor_parallel:
        stages = _stages(w.layers, space.pipeline_parallel)
        if w.heads % t:
            rejected["TP does not divide the attention heads"] += len(stages) * len(space.recompute)
            continue
        for p in stages:
            d_max = (m.racks * (G // t)) // p
            if d_max < 1:
                rejected["fewer GPUs than one replica needs"] += len(space.recompute)
                continue
            m_min = math.ceil(w.batch_sequences / (w.micro_batch * d_max))
            for recompute in space.recompute:
                for micro in _micro_batches(m_min, most):
                    evaluated += 1
                    lay = evaluate(w, m, t, p, micro, recompute, space.shard)
                    if lay["memory_per_gpu_bytes"] > budget:
                        rejected["exceeds per-GPU HBM (with headroom)"] += 1
                        if closest is None or lay["memory_per_gpu_bytes"] < closest["memory_per_gpu_bytes"]:
                            closest = lay
                        continue
                    kept.append(lay)
    kept.sort(key=lambda r: (r["seconds_per_token"], r["gpus_used"]))
    return {
        "best": kept[:top],
        "fitting": len(kept),
        "evaluated": evaluated,
        "rejected": dict(rejected),
        "memory_budget_bytes": budget,
        "closest_rejected": closest,
    }
