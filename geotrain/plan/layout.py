"""3D-parallel layout (founding paper, section 4 and Table 3).

One pipeline stage per layer; tensor parallelism inside the scale-up domain (the NVL72 rack); a
rack holds ``k`` copies of the **same** layer from ``k`` different replicas, so the data-parallel
gradient reduction starts inside the rack over NVLink. Memory per layer (for TP degree ``t``) is
``(weights + gradients + optimizer) / L + activations / (L t)``. Search: for ``k`` from the most
layers per rack down, ``t = floor(gpus_per_rack / k)`` (at most ``max_tp``); the first ``k`` whose
``k`` layers fit in the rack's HBM wins (the paper picked ``(k, t)`` "empirically" the same way:
100T -> 7 layers x 10-way TP, 50T -> 13 x 5). Replicas ``= floor(racks * k / L)``; each layer is
all-reduced over ``replicas / k`` racks in the scale-out network.
"""

from __future__ import annotations

from typing import Any


def layout(
    layers: int,
    static_bytes: float,
    activation_bytes: float,
    racks: int,
    gpus_per_rack: int,
    rack_hbm_bytes: float,
    max_tp: int,
    fixed_tp: int | None = None,
) -> dict[str, Any]:
    """Best (layers per rack, TP) that fits, or ``{"fits": False, ...}`` with the reason. With
    ``fixed_tp`` the TP degree is that one and ``k`` runs from ``floor(gpus_per_rack / fixed_tp)`` down."""
    if max_tp < 1 or max_tp > gpus_per_rack:
        raise ValueError(f"tensor_parallel_max must be between 1 and the scale-up domain ({gpus_per_rack}), got {max_tp}")
    if fixed_tp is not None:
        max_tp = fixed_tp
    for k in range(gpus_per_rack if fixed_tp is None else gpus_per_rack // fixed_tp, 0, -1):
        tp = min(gpus_per_rack // k, max_tp)
        per_layer = static_bytes / layers + activation_bytes / (layers * tp)
        if k * per_layer <= rack_hbm_bytes:
            replicas = racks * k // layers
            return {
                "fits": replicas >= 1,
                "layers_per_rack": k,
                "tensor_parallel": tp,
                "pipeline_parallel": layers,
                "data_parallel": replicas,
                "gpus_per_layer": tp,
                "gpus_used_per_rack": k * tp,
                "memory_per_layer_bytes": per_layer,
                "memory_per_gpu_bytes": per_layer / tp,
                "gpu_hbm_bytes": rack_hbm_bytes / gpus_per_rack,
                "racks_per_replica": layers / k,
                "dp_peers_scale_out": replicas / k,
                "reason": "" if replicas >= 1 else f"one replica needs {layers / k:.0f} racks, only {racks} available",
            }
    tp = min(gpus_per_rack, max_tp)
    per_layer = static_bytes / layers + activation_bytes / (layers * tp)
    return {
        "fits": False,
        "reason": f"one layer needs {per_layer / 1e12:.2f} TB even with {tp}-way TP; a rack has {rack_hbm_bytes / 1e12:.2f} TB",
        "memory_per_layer_bytes": per_layer,
    }
