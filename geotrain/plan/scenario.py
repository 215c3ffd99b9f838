"""The ``geotrain plan`` scenario file (pydantic, strict, unknown keys refused; docs/PLAN.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from geotrain.config import Section, load_yaml_model


class RackConfig(Section):
    name: str = "GB200 NVL72"
    gpus: int = Field(default=72, ge=1, le=100_000, description="GPUs per rack (= scale-up domain).")
    price_usd: float = Field(default=3e6, gt=0)
    power_watts: float = Field(default=125e3, gt=0)
    dense_pflops: dict[str, float] = Field(
        default_factory=lambda: {"fp4": 720.0, "fp8": 360.0, "bf16": 180.0},
        description="Dense peak PFLOP/s per rack by precision.",
    )
    hbm_tb: float = Field(default=13.5, gt=0)
    scale_up_gbytes_per_s: float = Field(default=1800.0, gt=0, description="NVLink bandwidth per GPU (GB/s).")
    nic_gbps: float = Field(default=800.0, gt=0, description="Scale-out NIC per GPU (Gbit/s).")


class FacilityConfig(Section):
    budget_usd: float = Field(gt=0, description="Total budget.")
    compute_share: float = Field(default=0.7, gt=0, le=1, description="Share spent on compute racks (paper: 70%).")
    rack: RackConfig = Field(default_factory=RackConfig)
    racks: int | None = Field(default=None, ge=1, description="Give the rack count instead of deriving it from the budget.")
    precision: str = Field(default="fp4", description="Precision of the peak FLOP/s used for compute.")
    sparsity: bool = Field(default=True, description="Use the structured-sparsity peak (2x dense).")
    non_compute_overhead: float = Field(default=0.4, ge=0, le=5, description="Extra power for cooling, network, losses.")

    @model_validator(mode="after")
    def _precision(self) -> FacilityConfig:
        if self.precision not in self.rack.dense_pflops:
            raise ValueError(f"precision: must be one of {', '.join(self.rack.dense_pflops)} (got {self.precision!r})")
        return self


class BudgetConfig(Section):
    months: float = Field(default=6.0, gt=0, le=120, description="Training duration (30-day months).")
    utilization: float = Field(default=1.0, gt=0, le=1, description="Assumed share of peak achieved (paper: 100%).")
    law: Literal["hoffmann1", "hoffmann2", "hoffmann3", "epoch", "tokens_per_param"] = "hoffmann2"
    tokens_per_param: float = Field(default=20.0, gt=0, description="For law=tokens_per_param.")


class ModelArch(Section):
    name: str = "model"
    layers: int = Field(ge=1)
    hidden: int = Field(ge=1)
    heads: int = Field(ge=1)
    vocab: int = Field(default=256000, ge=1)
    seq_len: int = Field(default=32000, ge=1)
    micro_batch: int = Field(default=1, ge=1)


class PrecisionConfig(Section):
    weight_bytes: float = Field(default=1.5, gt=0, description="Bytes per parameter for weights (paper: FP8 master + FP4 copy).")
    grad_bytes: float = Field(default=0.5, gt=0, description="Bytes per gradient (paper: FP4).")
    optimizer_bytes: float = Field(
        default=2.0, ge=0, description="Bytes of optimizer state per parameter (paper: two FP8 moments)."
    )
    activation_bytes: float = Field(default=1.0, gt=0, description="Bytes per activation value in memory (FP8).")
    wire_bytes: float = Field(default=0.5, gt=0, description="Bytes per activation value sent (FP4).")
    recompute: bool = Field(default=False, description="Full activation recomputation.")


class ParallelConfig(Section):
    tensor_parallel_max: int = Field(default=72, ge=1, description="Largest TP degree (at most the scale-up domain).")
    tensor_parallel: int | None = Field(default=None, ge=1, description="Fix the TP degree (default: the policy chooses).")
    pipeline_parallel: int | None = Field(
        default=None, ge=1, description="Fix the number of pipeline stages (default: the policy chooses)."
    )
    policy: Literal["search", "paper"] | None = Field(
        default=None,
        description="Layout rule: 'search' (every layout that fits one GPU, ranked by step time) or 'paper' (the founding "
        "paper's rack-packing rule). Default: paper for scenarios with paper figures, else search.",
    )
    search: bool | None = Field(default=None, description="Shorthand: true = policy search, false = policy paper.")
    shard_optimizer: Literal["none", "optimizer", "full"] = Field(
        default="none",
        description="ZeRO sharding across data parallelism: optimizer state (stage 1), or weights, gradients and "
        "optimizer state (full: stage 3 / FSDP).",
    )
    memory_headroom: float = Field(
        default=0.1, ge=0, lt=1, description="Share of each GPU's HBM the search leaves free (allocator, buffers)."
    )
    global_batch_tokens: float = Field(
        default=16e6, gt=0, description="Tokens per optimizer step, fixed across layouts (Llama 3 405B: 16M)."
    )
    top: int = Field(default=5, ge=1, le=100, description="Layouts the search prints.")
    mfu: float = Field(default=1.0, gt=0, le=1, description="Model FLOPs utilisation for step times (paper: 100%).")


class NetworkConfig(Section):
    radix: int = Field(default=256, ge=4)
    tiers: Literal[2, 3, 4] = 3
    oversubscription: list[float] | None = None
    ports: list[list[int]] | None = None
    rails: int = Field(default=4, ge=1)


class SitesConfig(Section):
    count: int = Field(default=2, ge=1, le=64, description="Datacenters the GPUs are split over.")
    link_gbps: float = Field(default=100_000.0, gt=0, description="Inter-site bandwidth per site (Gbit/s).")
    rtt_ms: float = Field(
        default=40.0, ge=0, le=2000, description="Round-trip time between sites (paper: ~40 ms coast to coast)."
    )
    wan_budget_ms: float | None = Field(
        default=None, gt=0, description="Time a layer's cross-site all-reduce may take (default: one layer's backward pass)."
    )


class StrategyConfig(Section):
    params: float | None = Field(
        default=None, gt=0, description="Model size for the strategy section (default: the scenario model)."
    )
    layers: int | None = Field(default=None, ge=1)
    step_seconds: float | None = Field(default=None, gt=0, description="Step time (default: from the step section).")
    H: int = Field(default=100, ge=1, description="Inner steps per outer round (Streaming DiLoCo Table 4: 100).")
    tau: int = Field(default=2, ge=0, description="Inner steps a fragment's all-reduce overlaps.")
    target: float = Field(default=0.95, gt=0, lt=1, description="Utilisation the recommendation must reach.")
    bits: dict[str, float] = Field(default_factory=lambda: {"dp": 16.0, "diloco": 16.0, "streaming": 16.0, "streaming_fp4": 4.0})
    compare_streaming_table4: bool = Field(default=False, description="Also print Streaming DiLoCo's Table 4 beside ours.")


class PaperPlan(Section):
    """Published figures for this scenario (any subset), printed beside ours."""

    figures: dict[str, float] = Field(default_factory=dict, description="Dotted JSON path -> the paper's value.")
    notes: list[str] = Field(default_factory=list, description="Where the paper is inconsistent, and why ours differs.")
    source: str = ""


class PlanScenario(Section):
    name: str = "plan"
    facility: FacilityConfig
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    model: ModelArch
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    sites: SitesConfig = Field(default_factory=SitesConfig)
    strategies: StrategyConfig = Field(default_factory=StrategyConfig)
    paper: PaperPlan | None = None

    @model_validator(mode="after")
    def _tp(self) -> PlanScenario:
        par, gpus = self.parallel, self.facility.rack.gpus
        if par.tensor_parallel_max > gpus:
            raise ValueError(
                f"parallel.tensor_parallel_max: {par.tensor_parallel_max} exceeds the scale-up domain (facility.rack.gpus = {gpus})"
            )
        if par.tensor_parallel is not None and par.tensor_parallel > gpus:
            raise ValueError(
                f"parallel.tensor_parallel: {par.tensor_parallel} exceeds the scale-up domain (facility.rack.gpus = {gpus})"
            )
        if par.tensor_parallel is not None and par.tensor_parallel > par.tensor_parallel_max:
            raise ValueError(
                f"parallel.tensor_parallel: {par.tensor_parallel} exceeds parallel.tensor_parallel_max ({par.tensor_parallel_max})"
            )
        if par.pipeline_parallel is not None and par.pipeline_parallel > self.model.layers:
            raise ValueError(
                f"parallel.pipeline_parallel: {par.pipeline_parallel} stages exceed model.layers ({self.model.layers})"
            )
        if par.search is not None and par.policy is not None and par.search != (par.policy == "search"):
            raise ValueError(f"parallel.search: {par.search} contradicts parallel.policy: {par.policy}")
        if self.layout_policy == "paper" and par.pipeline_parallel not in (None, self.model.layers):
            raise ValueError(
                f"parallel.pipeline_parallel: the paper policy puts one layer per stage ({self.model.layers}); "
                "use parallel.policy: search for other depths"
            )
        return self

    @property
    def layout_policy(self) -> str:
        """``parallel.policy``, else ``parallel.search``, else paper when the scenario has paper figures."""
        par = self.parallel
        if par.policy is not None:
            return par.policy
        if par.search is not None:
            return "search" if par.search else "paper"
        return "paper" if self.paper is not None and self.paper.figures else "search"


def load_plan(path: str | Path | None, overrides: list[str] | None = None) -> PlanScenario:
    return load_yaml_model(PlanScenario, path, overrides, option="SCENARIO")
