"""The ``geotrain netsim`` scenario file: pydantic, strict, unknown keys refused (like run configs).

Reference with every key: docs/NETSIM.md. Invalid values raise
:class:`geotrain.config.ConfigError` naming the field, e.g. ``fabric.radix: must be an even
number >= 4 (got 15)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from geotrain.config import Section, load_yaml_model
from geotrain.netsim.sizing import hosts_capacity, tier_ports

Ratio = Annotated[float, Field(ge=1, le=1024)]


class CostConfig(Section):
    transceiver_usd: float = Field(default=1000.0, ge=0, description="Price of one optical transceiver (paper: 1K USD).")
    transceivers_per_link: int = Field(
        default=2, ge=0, le=8, description="Transceivers per switch-to-switch cable (one per end)."
    )
    host_links_optical: bool = Field(default=False, description="Count optics on host-to-leaf links too.")
    switch_usd: float = Field(default=0.0, ge=0, description="Price of one switch box (0 = not costed).")


class TreeConfig(Section):
    """A fat tree: hosts, tiers, radix, port speed, per-tier port split, rails, cost."""

    hosts: int = Field(ge=2, le=100_000_000, description="Hosts (GPUs / NICs) to connect.")
    tiers: Literal[2, 3, 4] = Field(default=3, description="Switch tiers (2, 3 or 4).")
    radix: int = Field(description="Front-panel ports per switch at port_gbps (even, >= 4).")
    port_gbps: float = Field(default=800.0, gt=0, le=100_000, description="Host and switch port speed in Gbit/s.")
    oversubscription: list[Ratio] | None = Field(
        default=None, description="down:up ratio per tier below the top (>= 1; default full bisection)."
    )
    ports: list[list[int]] | None = Field(
        default=None, description="Explicit [down, up] ports per tier below the top, e.g. [[200, 50], [168, 88]]."
    )
    rails: int = Field(default=1, ge=1, le=16, description="Rails (planes); each port carries rails x port_gbps/rails.")
    cost: CostConfig = Field(default_factory=CostConfig, description="Optics and switch prices.")

    @field_validator("radix")
    @classmethod
    def _radix(cls, v: int) -> int:
        if v < 4 or v % 2:
            raise ValueError("must be an even number >= 4")
        return v

    @model_validator(mode="after")
    def _fits(self) -> TreeConfig:
        if self.oversubscription is not None and self.ports is not None:
            raise ValueError("give either oversubscription or ports, not both")
        try:
            tp = tier_ports(self.radix, self.tiers, self.oversubscription, self.ports)
        except ValueError as exc:
            field = "ports" if self.ports is not None else "oversubscription"
            raise ValueError(f"{field}: {exc}") from None
        cap = hosts_capacity(tp)
        if self.hosts > cap:
            raise ValueError(f"hosts: {self.hosts} hosts exceed what {self.tiers} tiers of radix {self.radix} can hold ({cap:,})")
        return self

    def tier_ports(self) -> list[tuple[int, int]]:
        return tier_ports(self.radix, self.tiers, self.oversubscription, self.ports)


class PaperFigures(Section):
    """Figures a source publishes for a sizing case, printed beside ours."""

    hosts: float | None = None
    switches: float | None = None
    chips: float | None = None
    switch_links: float | None = None
    optics_usd: float | None = None
    source: str = ""


class SizingCase(TreeConfig):
    name: str = Field(min_length=1, description="Label in the report.")
    paper: PaperFigures | None = Field(default=None, description="Published figures to compare with.")
    note: str = Field(default="", description="Why ours and the paper's differ, if they do.")


class ModelMessage(Section):
    """Message derived from a model: the activations one GPU passes to the next pipeline stage."""

    hidden: int = Field(ge=1, description="Hidden size.")
    seq_len: int = Field(ge=1, description="Sequence length in tokens.")
    micro_batch: int = Field(default=1, ge=1, description="Sequences per micro-batch.")
    bytes_per_value: float = Field(default=2.0, gt=0, description="Bytes per activation value (fp4 = 0.5).")
    tensor_parallel: int = Field(default=1, ge=1, description="Tensor-parallel degree: each GPU sends 1/TP of it.")

    @property
    def message_bytes(self) -> float:
        """``seq_len * micro_batch * hidden * bytes_per_value / tensor_parallel`` (paper section 4.1)."""
        return self.seq_len * self.micro_batch * self.hidden * self.bytes_per_value / self.tensor_parallel


class TrafficConfig(Section):
    name: str = Field(default="", description="Label of this exchange in the report (default: the pattern).")
    count: int = Field(default=1, ge=1, le=10_000_000, description="Times this exchange runs per training step.")
    on_fabric: bool = Field(
        default=True,
        description="false: it runs on the scale-up domain (NVLink), not this fabric; listed with its bytes, not simulated.",
    )
    pattern: Literal["permutation", "ring", "hierarchical", "all_to_all"] = Field(
        default="permutation", description="Traffic pattern (geotrain/netsim/traffic.py)."
    )
    message_bytes: float | None = Field(default=None, gt=0, description="Bytes each host sends in the exchange.")
    model: ModelMessage | None = Field(default=None, description="Derive message_bytes from a model instead.")
    group_size: int | None = Field(
        default=None, ge=1, description="Hosts per group for hierarchical and all_to_all (default: all for all_to_all)."
    )
    in_group_on_fabric: bool = Field(
        default=True, description="hierarchical: run the in-group phases on this fabric (false: on the scale-up domain)."
    )

    @model_validator(mode="after")
    def _message(self) -> TrafficConfig:
        if (self.message_bytes is None) == (self.model is None):
            raise ValueError("give exactly one of message_bytes or model")
        return self

    @property
    def bytes(self) -> float:
        return self.message_bytes if self.message_bytes is not None else self.model.message_bytes  # type: ignore[union-attr]


Routing = Literal["ecmp", "ecmp_subflows", "spray", "adaptive"]


def _all_routings() -> list[Routing]:
    return ["ecmp", "ecmp_subflows", "spray", "adaptive"]


class TransportConfig(Section):
    routings: list[Routing] = Field(
        default_factory=_all_routings,
        min_length=1,
        description="Routings to compare (geotrain/netsim/routing.py).",
    )
    subflows: int = Field(default=8, ge=1, le=1024, description="Paths per flow for ecmp_subflows.")
    hop_latency_s: float = Field(
        default=4e-7, ge=0, le=1, description="One-way latency per link; base RTT = 2 x hops x this (3 tiers: 4.8 us)."
    )
    startup_s: float = Field(default=0.0, ge=0, le=10, description="Fixed start cost per flow (set-up, launch).")


class PaperSimulation(Section):
    """A published simulation of the same case, printed beside ours."""

    optimal_seconds: float | None = None
    ecmp_seconds: float | None = None
    multipath_within: float | None = Field(default=None, description="Multipath transports' distance to optimal (0.05 = 5%).")
    source: str = ""


class Scenario(Section):
    name: str = Field(default="netsim", description="Label in the report.")
    fabric: TreeConfig = Field(description="The fabric to size and simulate.")
    traffic: list[TrafficConfig] = Field(
        min_length=1,
        description="What the hosts exchange in one synchronized phase, or a list of exchanges run one after another "
        "(a training step's TP, PP and DP traffic: geotrain plan --netsim writes one).",
    )
    transport: TransportConfig = Field(default_factory=TransportConfig, description="Routings and timing parameters.")
    trials: int = Field(default=3, ge=1, le=1000, description="Seeded trials per routing (new permutation and hashes each).")
    seed: int = Field(default=0, ge=0, description="Seed of the first trial.")
    max_entries: int = Field(
        default=60_000_000, ge=1000, description="Refuse simulations whose routing matrix exceeds this (memory guard)."
    )
    sizing: list[SizingCase] = Field(default_factory=list, description="Extra sizing-only cases (e.g. the paper's).")
    paper: PaperSimulation | None = Field(default=None, description="Published simulation of this case.")

    @field_validator("traffic", mode="before")
    @classmethod
    def _one_or_many(cls, v: object) -> object:
        return [v] if isinstance(v, dict) else v

    @model_validator(mode="after")
    def _simulable(self) -> Scenario:
        if self.fabric.hosts > 65536:
            raise ValueError(
                f"fabric.hosts: simulation is limited to 65,536 hosts (got {self.fabric.hosts}); size bigger trees under sizing"
            )
        n = self.fabric.hosts
        for tr in self.traffic:
            g = tr.group_size
            if tr.pattern in ("hierarchical", "all_to_all") and g is not None and n % g:
                raise ValueError(f"traffic.group_size: must divide fabric.hosts ({n}), got {g}")
            if tr.pattern == "all_to_all" and (g or n) < 2:
                raise ValueError("traffic.group_size: all_to_all needs groups of at least 2 hosts")
        if not any(tr.on_fabric for tr in self.traffic):
            raise ValueError("traffic: at least one exchange must run on the fabric (on_fabric: true)")
        return self


def load_scenario(path: str | Path | None, overrides: list[str] | None = None) -> Scenario:
    """Load and validate a scenario file (raises ConfigError naming the field)."""
    return load_yaml_model(Scenario, path, overrides, option="SCENARIO")
