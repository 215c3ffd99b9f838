"""Training memory: weights, gradients, optimizer states, activations.

Bytes per parameter follow the precision choice (the paper: an FP8 master copy plus the FP4
compute copy = 1.5 B, FP4 gradients = 0.5 B, two FP8 Adam moments = 2 B; mixed-precision bf16 with
fp32 master and moments is 2 + 4 / 2 / 8).

Activations per layer (Korthikanti et al. 2023, "Reducing activation recomputation", section 4):
with tensor parallelism ``t`` and sequence parallelism, ``s b h (34 + 5 a s / h) / t`` bytes at
16-bit, scaled by ``activation_bytes / 2`` for other precisions; with full recomputation only the
layer input is kept, ``2 s b h / t`` bytes at 16-bit.
"""

from __future__ import annotations

from typing import Any


def memory(
    params: float,
    layers: int,
    hidden: int,
    heads: int,
    seq_len: int,
    micro_batch: int,
    weight_bytes: float,
    grad_bytes: float,
    optimizer_bytes: float,
    activation_bytes: float,
    recompute: bool,
    tensor_parallel: int = 1,
) -> dict[str, Any]:
    """Whole-model memory (``tensor_parallel`` only divides activations, as in the paper's Table 2)."""
    sbh = seq_len * micro_batch * hidden
    scale = activation_bytes / 2.0
    full = sbh * (34 + 5 * heads * seq_len / hidden) * scale / tensor_parallel
    kept = 2 * sbh * scale / tensor_parallel
    per_layer = kept if recompute else full
    out = {
        "params_bytes": params * weight_bytes,
        "grads_bytes": params * grad_bytes,
        "optimizer_bytes": params * optimizer_bytes,
        "activations_bytes": per_layer * layers,
        "activations_bytes_no_recompute": full * layers,
        "activations_bytes_recompute": kept * layers,
        "recompute": recompute,
    }
    out["total_bytes"] = out["params_bytes"] + out["grads_bytes"] + out["optimizer_bytes"] + out["activations_bytes"]
    return out


SHARDING = ("none", "optimizer", "full")


def gpu_memory(
    stage_params: float,
    layer_params: float,
    layers_per_stage: int,
    hidden: int,
    heads: int,
    seq_len: int,
    micro_batch: int,
    in_flight: int,
    tensor_parallel: int,
    data_parallel: int,
    weight_bytes: float,
    grad_bytes: float,
    optimizer_bytes: float,
    activation_bytes: float,
    recompute: bool,
    shard: str = "none",
) -> dict[str, float]:
    """One GPU's memory in a (TP ``t``, PP, DP ``d``) layout, for the layout search.

    - weights, gradients and optimizer state of its stage: ``stage_params / t`` parameters at their
      bytes each; ``shard`` divides by ``d`` (ZeRO, Rajbhandari et al. 2020): ``optimizer`` the
      optimizer state (stage 1), ``full`` all three (stage 3 / FSDP FULL_SHARD), which then also
      holds two layers' whole weights while they are gathered (the one in use and the one
      prefetched);
    - activations: 1F1B keeps ``in_flight = min(p, m)`` micro-batches on the first stage
      (Narayanan et al. 2021), each ``layers_per_stage`` layers of Korthikanti's per-layer bytes
      (module docstring); recomputation keeps only each layer's input and needs one layer's full
      activations while it recomputes.
    """
    if shard not in SHARDING:
        raise ValueError(f"shard must be one of {', '.join(SHARDING)} (got {shard!r})")
    t, d = tensor_parallel, data_parallel
    per_gpu = stage_params / t
    sbh = seq_len * micro_batch * hidden
    scale = activation_bytes / 2.0
    full_layer = sbh * (34 + 5 * heads * seq_len / hidden) * scale / t
    kept = 2 * sbh * scale / t if recompute else full_layer
    out = {
        "weights_bytes": per_gpu * weight_bytes / (d if shard == "full" else 1),
        "grads_bytes": per_gpu * grad_bytes / (d if shard == "full" else 1),
        "optimizer_bytes": per_gpu * optimizer_bytes / (d if shard != "none" else 1),
        "gathered_weights_bytes": 2 * layer_params / t * weight_bytes if shard == "full" and d > 1 else 0.0,
        "activations_bytes": in_flight * layers_per_stage * kept + (full_layer if recompute else 0.0),
    }
    out["total_bytes"] = sum(out.values())
    return out
