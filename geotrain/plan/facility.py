"""Facility: what a budget buys (founding paper, section 2).

``racks = floor(budget * compute_share / rack_price)``; GPUs, power, peak FLOP/s and HBM scale
with racks. Peak FLOP/s per precision is given dense; ``sparsity`` doubles it (NVIDIA quotes
structured-sparsity peaks: GB200 NVL72 FP4 1,440 PFLOP/s sparse = 720 dense). Total power adds the
non-compute overhead (cooling, networking, losses; the paper: "up to 40%").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

SECONDS_PER_MONTH = 30 * 86400  # the paper's 6-month budget (519e27 FLOPs) uses 30-day months


@dataclass(frozen=True)
class Rack:
    """A rack type. Defaults: NVIDIA GB200 NVL72 as the paper describes it."""

    name: str = "GB200 NVL72"
    gpus: int = 72
    price_usd: float = 3e6
    power_watts: float = 125e3  # 2.9 GW / 23.2K racks; the paper's "close to 1MW" wording disagrees
    dense_flops: tuple[tuple[str, float], ...] = (("fp4", 720e15), ("fp8", 360e15), ("bf16", 180e15))
    hbm_bytes: float = 13.5e12
    scale_up_bytes_per_s: float = 1.8e12  # NVLink per GPU (14.4 Tbit/s)
    nic_bps: float = 800e9  # scale-out NIC per GPU

    def peak_flops(self, precision: str, sparsity: bool) -> float:
        table = dict(self.dense_flops)
        if precision not in table:
            raise ValueError(f"precision must be one of {', '.join(table)} (got {precision!r})")
        return table[precision] * (2 if sparsity else 1)


def facility(
    budget_usd: float, compute_share: float, rack: Rack, precision: str, sparsity: bool, non_compute_overhead: float
) -> dict[str, Any]:
    """Racks, GPUs, power, peak FLOP/s and HBM bought by ``budget_usd * compute_share``."""
    if budget_usd <= 0 or not 0 < compute_share <= 1:
        raise ValueError("budget must be > 0 and compute_share in (0, 1]")
    racks = math.floor(budget_usd * compute_share / rack.price_usd + 1e-9)
    if racks < 1:
        raise ValueError(f"the compute budget buys no rack (one costs ${rack.price_usd:,.0f})")
    power = racks * rack.power_watts
    return {
        "rack": asdict(rack),
        "compute_usd": budget_usd * compute_share,
        "racks": racks,
        "gpus": racks * rack.gpus,
        "power_watts": power,
        "total_power_watts": power * (1 + non_compute_overhead),
        "precision": precision,
        "sparsity": sparsity,
        "peak_flops": racks * rack.peak_flops(precision, sparsity),
        "gpu_peak_flops": rack.peak_flops(precision, sparsity) / rack.gpus,
        "hbm_bytes": racks * rack.hbm_bytes,
    }


def compute_budget(peak_flops: float, utilization: float, months: float) -> float:
    """FLOPs over ``months`` of 30 days at ``utilization`` of peak (paper 3.1: 6 months, 100% -> 519e27)."""
    return peak_flops * utilization * months * SECONDS_PER_MONTH
