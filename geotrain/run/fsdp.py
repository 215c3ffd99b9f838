"""``sync.within_site=fsdp``: FSDP2 ``fully_shard`` on a site's device mesh (HSDP with geotrain's
own cross-site layer on top).

Each transformer block is one FSDP unit and the root (embeddings, final norm, tied head) another,
as torchtitan lays out its models: a block's parameters are all-gathered just before it runs and
freed after, its gradients reduce-scattered (averaged over the site) as backward leaves it. What
stays on a rank between steps is its dim-0 shard of every parameter and gradient, the inner
optimizer state of that shard, and (in :mod:`geotrain.sync`) the fp32 global copy and outer
state of the same shard. ``train.precision=bf16`` becomes FSDP's mixed-precision policy: bf16
parameters for compute, fp32 gradient reduction, fp32 shards kept. FSDP2's collectives are
counted in the rank's intra-site bytes (:mod:`geotrain.comm.fsdp_count`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from geotrain.comm.collectives import CommStats
from geotrain.comm.fsdp_count import count_fsdp


def block_list(model: nn.Module) -> nn.ModuleList:
    """The model's transformer blocks: its ``nn.ModuleList`` holding the most parameters (GPT's
    ``blocks``, GPT-2's ``transformer.h``, Llama's ``model.layers``).

    Raises:
        ValueError: the model has no module list to shard block by block.
    """
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError("sync.within_site=fsdp: the model has no list of blocks (nn.ModuleList) to shard")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    precision: str,
    *,
    reshard_root: bool = False,
    compile_blocks: bool = False,
    stats: CommStats | None = None,
) -> None:
    """Apply ``fully_shard`` to every block and then to the root, in place, on ``mesh``.

    Args:
        precision: 'bf16' computes in bf16 (FSDP's policy; reductions and kept shards fp32).
        compile_blocks: compile each block's forward before it is sharded (``train.compile``), as
            torchtitan does: FSDP's all-gather and reduce-scatter hooks stay outside the compiled
            code, and the parameters keep their names (the block is not wrapped).
        reshard_root: free the root's gathered parameters after forward too (for a model that only
            evaluates: nothing gathered outlives a forward, so shards written between forwards are
            always what the next one sees).
        stats: count FSDP2's all-gathers and reduce-scatters in its ``intra_bytes``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # here: replicated runs never pay its import

    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if precision == "bf16" else None,
        reduce_dtype=torch.float32 if precision == "bf16" else None,
    )
    for block in block_list(model):
        if compile_blocks:
            block.forward = torch.compile(block.forward)  # type: ignore[method-assign]
        fully_shard(block, mesh=mesh, mp_policy=policy)
        if stats is not None:
            count_fsdp(block, stats)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_root or None)
    if stats is not None:
        count_fsdp(model, stats)


def copy_on(model: nn.Module, device: str | torch.device) -> nn.Module:
    """A copy of ``model`` whose parameters are new, uninitialised tensors on ``device`` ('meta': the
    structure without memory), tied parameters still tied (``Module.to``/``to_empty`` untie them);
    buffers are copied."""
    memo: dict[int, object] = {
        id(p): nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad) for p in model.parameters()
    }
    return copy.deepcopy(model, memo)


def local_tree(obj: Any) -> Any:
    """``obj`` (nested dicts, lists, tuples) with every DTensor replaced by a copy of this rank's
    shard: what an elastic site sends a healer's same local rank (same layout: sites of one size)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.to_local().clone()
    if isinstance(obj, dict):
        return {k: local_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(local_tree(v) for v in obj)
    return obj


def sharded_like(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`local_tree` for a training state: the model's and the inner
    optimizer's tensors as DTensors placed like this rank's parameters (the sync state's shards
    are read as local tensors already)."""
    from torch.distributed.tensor import DTensor

    def like(t: Any, p: Any) -> Any:
        if not isinstance(p, DTensor) or not isinstance(t, torch.Tensor) or t.shape != p.to_local().shape:
            return t
        return DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)

    template = model.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    opt = state["optimizer"]
    per_param = {k: {n: like(v, params[int(k)]) for n, v in s.items()} for k, s in opt["state"].items()}
    return {
        **state,
        "model": {k: like(v, template.get(k)) for k, v in state["model"].items()},
        "optimizer": {**opt, "state": per_param},
    }


WHOLE = "__whole__"  # a DTensor of a heal between sites of different sizes, sent whole


def whole_tree(obj: Any) -> Any:
    """``obj`` with every DTensor gathered whole (every rank of the site calls it together, in the
    same order): what a site heals another of a different size from (its local rank i holds other
    shards than the healer's)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return {WHOLE: obj.full_tensor()}
    if isinstance(obj, dict):
        return {k: whole_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(whole_tree(v) for v in obj)
    return obj


def from_whole(obj: Any, mesh: DeviceMesh) -> Any:
    """The inverse of :func:`whole_tree` on the healer: each whole tensor cut into this rank's
    shard where FSDP cuts it (dim 0 over the site's mesh), as a DTensor, without communication."""
    from torch.distributed.tensor import Shard, distribute_tensor

    if isinstance(obj, dict) and set(obj) == {WHOLE}:
        return distribute_tensor(obj[WHOLE], mesh, [Shard(0)], src_data_rank=None)
    if isinstance(obj, dict):
        return {k: from_whole(v, mesh) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_whole(v, mesh) for v in obj)
    return obj
