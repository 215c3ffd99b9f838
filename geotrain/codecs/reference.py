"""Straightforward torch-ops versions of the quantising codecs: the yardstick for the kernels.

Same formats and the same arithmetic as :mod:`geotrain.codecs` (the tests check the codes agree),
written the way one would with tensor ops: every step is a full pass with a temporary. The
benchmark measures the fused kernels against these. Also here: PyTorch's own PowerSGD
(``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``) run on given tensors, to check
:mod:`geotrain.codecs.powersgd` against it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

FP4_MIDPOINTS = torch.tensor([2.0**-7] + [0.75 * 2.0 ** (k - 7) for k in range(2, 8)], dtype=torch.float32)


def int8_encode(x: torch.Tensor, sigma_range: float = 6.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8, table fp32[256])."""
    mean = x.double().mean()
    std = (x.double().pow(2).mean() - mean * mean).clamp_min(0).sqrt()
    half = float(sigma_range * std)
    if half <= 1e-30 * max(1.0, abs(float(mean))):  # constant tensor, as in the fast codec
        half = max(abs(float(mean)), 1e-30)
    lo = float(mean) - half
    lo32 = torch.tensor(lo, dtype=torch.float32)
    inv32 = torch.tensor(256.0 / (2 * half), dtype=torch.float32)
    t = ((x - lo32) * inv32).clamp(0, 255)
    codes = t.floor().to(torch.uint8)
    idx = codes.long()
    sums = torch.bincount(idx, weights=x.double(), minlength=256)
    counts = torch.bincount(idx, minlength=256)
    centres = lo + (torch.arange(256, dtype=torch.float64) + 0.5) * (2 * half / 256)
    table = torch.where(counts > 0, sums / counts.clamp_min(1), centres).float()
    return codes, table


def int8_decode(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[codes.long()]


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    pad = (-x.numel()) % block
    return F.pad(x, (0, pad)).view(-1, block)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    flat = codes.reshape(-1)
    if flat.numel() % 2:
        flat = F.pad(flat, (0, 1))
    return flat[0::2] | (flat[1::2] << 4)


def _unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)[:n]


def block4_encode(x: torch.Tensor, block: int = 64, fp4: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes uint8, scales fp32 per block) for int4 or fp4 (E3M0)."""
    n = x.numel()
    b = _blocks(x, block)
    scale = b.abs().amax(dim=1, keepdim=True)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    if fp4:  # e = how many midpoints (scaled to the block) |x| reaches
        e = (b.abs().unsqueeze(-1) >= safe.unsqueeze(-1) * FP4_MIDPOINTS).sum(-1)
        codes = e | ((b < 0) & (e > 0)).long() << 3
    else:
        codes = torch.floor(b * (7.0 / safe) + 0.5).long() + 8
    codes = torch.where(scale > 0, codes, torch.full_like(codes, 0 if fp4 else 8))
    packed = _pack(codes.reshape(-1)[:n].to(torch.uint8))
    return packed[: (n + 1) // 2], scale.reshape(-1).float()


def block4_decode(packed: torch.Tensor, scales: torch.Tensor, n: int, block: int = 64, fp4: bool = False) -> torch.Tensor:
    codes = _unpack(packed, n).long()
    s = scales.repeat_interleave(block)[:n]
    if fp4:
        e = codes & 7
        mag = torch.where(e > 0, s * torch.pow(2.0, (e - 7).float()), torch.zeros_like(s))
        return torch.where(codes & 8 > 0, -mag, mag)
    return (codes - 8).float() * (s / 7.0)


class _Linear(torch.nn.Module):
    """loss = Σ ⟨p_i, t_i⟩, so the gradient of p_i is exactly t_i."""

    def __init__(self, like: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros_like(t)) for t in like])

    def forward(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.stack([(p * t).sum() for p, t in zip(self.params, tensors, strict=True)]).sum()


def torch_powersgd(tensors: Sequence[torch.Tensor], rank: int, rounds: int = 1, seed: int = 0) -> list[torch.Tensor]:
    """PyTorch's PowerSGD hook applied ``rounds`` times (warm start, no error feedback) to ``tensors``.

    Call on every rank of an initialised process group, each with the same ``tensors``. The hook
    only runs inside DistributedDataParallel (which skips it on a single process), so this wraps
    a module whose gradients are exactly ``tensors`` and reads the gradients back after each
    backward: the hook averages over ranks, so what comes back is its rank-``rank`` approximation.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(_Linear(tensors), bucket_cap_mb=1 << 14)  # one bucket
    state = psgd.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=2,
        min_compression_rate=2,
        use_error_feedback=False,
        warm_start=True,
        random_seed=seed,
    )
    ddp.register_comm_hook(state, psgd.powerSGD_hook)
    out: list[torch.Tensor] = []
    for _ in range(2 + rounds):  # iterations below start_powerSGD_iter (2) are sent uncompressed
        ddp.zero_grad()
        ddp(tensors).backward()  # the forward must go through DDP to arm its reducer
        out = [p.grad.detach().clone() for p in ddp.module.params]  # type: ignore[union-attr]
    return out
