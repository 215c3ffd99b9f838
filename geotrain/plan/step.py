"""Step time and communication (founding paper section 4.1, equations 1 and 2; α-β model).

All-reduce of ``S`` bytes over ``n`` peers at link bandwidth ``B`` (bytes/s) and latency α:
``t = 2 (n-1)/n * S / B + 2 (n-1) α`` (ring; Patarasuk and Yuan 2009, Thakur et al. 2005); a
reduce-scatter or all-gather is half of it.

- layer forward time ``= layer_flops / (TP * gpu_peak * mfu)``; backward = 2x forward;
- tensor-parallel all-reduce (paper eq. 1): one all-reduce moves the attention and MLP outputs,
  ``MLP + ATTN = 2 s b h bytes / TP`` per GPU, in ``2 (MLP + ATTN)(n-1)/(B n)``; two per forward
  pass. (Megatron's all-reduce carries the full ``s b h`` activation; the paper divides by TP as
  with sequence parallelism, and we follow it.)
- pipeline point-to-point: each of the TP GPUs sends ``s b h bytes / TP`` to the next stage's rack
  over its NIC, then an all-gather over NVLink rebuilds the full activations;
- data-parallel, hierarchical: reduce-scatter among the ``k`` copies of a layer in the rack over
  NVLink, ring all-reduce of each ``1/(k TP)`` shard across the ``R = replicas / k`` racks on every
  GPU's NIC in parallel, all-gather in the rack. (The paper instead adds a full in-rack all-reduce,
  21 ms, plus the all-gather, 10 ms: an all-reduce followed by an all-gather counts the in-rack
  phase twice. Both are reported.)
- exposure: a layer's gradient reduction overlaps the backward pass of the layers after it, so
  only the last layer's reduction (and any excess over one layer's backward time) is exposed;
- cross-datacenter: with ``n_dc`` datacenters, each rack all-reduces its layer shard with its
  peers; the bandwidth that fits it in ``budget_s`` after ``rtt`` round trips is
  ``2 (n-1)/n * grads_per_layer * 8 / (budget_s - 2(n-1) rtt/2)`` bit/s per layer in flight.
"""

from __future__ import annotations

from typing import Any


def allreduce_seconds(size_bytes: float, peers: int, bandwidth_bytes: float, latency_s: float = 0.0) -> float:
    """Ring all-reduce time (α-β bound)."""
    if peers <= 1:
        return 0.0
    return 2 * (peers - 1) / peers * size_bytes / bandwidth_bytes + 2 * (peers - 1) * latency_s


def step_times(
    arch: dict[str, Any],
    lay: dict[str, Any],
    gpu_peak_flops: float,
    mfu: float,
    activation_bytes: float,
    grad_bytes: float,
    micro_batch: int,
    scale_up_bytes_per_s: float,
    nic_bytes_per_s: float,
    gpus_per_rack: int,
    datacenters: int,
    wan_rtt_s: float,
    wan_budget_s: float | None,
) -> dict[str, Any]:
    tp, k = lay["tensor_parallel"], lay["layers_per_rack"]
    fwd = arch["layer_forward_flops"] * micro_batch / (tp * gpu_peak_flops * mfu)
    act = arch["seq_len"] * micro_batch * arch["hidden"] * activation_bytes / tp  # per GPU, per all-reduce
    # eq. 1: one TP all-reduce moves MLP + ATTN = 2 * act bytes per GPU: 2 (MLP + ATTN)(n-1) / (B n)
    tp_one = allreduce_seconds(2 * act, tp, scale_up_bytes_per_s)
    p2p = act / nic_bytes_per_s
    p2p_gather = (tp - 1) / tp * act * tp / scale_up_bytes_per_s
    grads = arch["params_per_layer"] * grad_bytes
    racks_dp = max(1, round(lay["dp_peers_scale_out"]))
    rs = allreduce_seconds(grads / tp, k, scale_up_bytes_per_s) / 2
    ext = allreduce_seconds(grads / (tp * k), racks_dp, nic_bytes_per_s)
    ag = rs
    paper_internal = 2 * grads / tp * (k - 1) / (scale_up_bytes_per_s * k)  # eq. 2, in-rack all-reduce
    paper_external = 2 * grads * (racks_dp - 1) / (racks_dp * gpus_per_rack * nic_bytes_per_s)  # text under eq. 2
    dp_total = rs + ext + ag
    bwd = 2 * fwd
    exposed = dp_total + max(0.0, dp_total - bwd) * (arch["layers"] - 1)
    out = {
        "layer_forward_seconds": fwd,
        "layer_backward_seconds": bwd,
        "tp_allreduce_bytes": 2 * act,
        "tp_allreduce_seconds": tp_one,
        "tp_seconds_per_layer_forward": 2 * tp_one,
        "pp_p2p_bytes": act,
        "pp_p2p_seconds": p2p,
        "pp_allgather_seconds": p2p_gather,
        "dp_grads_per_layer_bytes": grads,
        "dp_reduce_scatter_in_rack_seconds": rs,
        "dp_allreduce_scale_out_seconds": ext,
        "dp_allgather_in_rack_seconds": ag,
        "dp_total_seconds": dp_total,
        "dp_paper_internal_allreduce_seconds": paper_internal,
        "dp_paper_external_allreduce_seconds": paper_external,
        "dp_exposed_seconds": exposed,
        "dp_hidden": dp_total <= bwd,
    }
    if datacenters > 1:
        budget = wan_budget_s if wan_budget_s is not None else bwd
        usable = budget - (datacenters - 1) * wan_rtt_s
        vol = 2 * (datacenters - 1) / datacenters * grads
        out["wan_budget_seconds"] = budget
        out["wan_required_bps"] = vol * 8 / usable if usable > 0 else float("inf")
    return out
