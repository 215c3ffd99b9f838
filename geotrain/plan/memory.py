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
