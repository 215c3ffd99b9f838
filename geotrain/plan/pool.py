"""The pool file of ``geotrain place``: sites with free accelerators, their data, the link matrix,
and the job (docs/PLACE.md). Strict like every file geotrain reads: an unknown key, a bad value or
a link naming an unknown site is refused in one line naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from geotrain.config.base import Section
from geotrain.config.load import load_yaml_model
from geotrain.config.topology import LinkConfig, PairLinkConfig, site_name

Codec = Literal["none", "bf16", "int8", "fp4"]  # the fixed-width codecs placement chooses from
CODEC_BITS = {"none": 32, "bf16": 16, "fp16": 16, "int8": 8, "fp4": 4, "int4": 4}


def _all_codecs() -> list[Codec]:
    return ["none", "bf16", "int8", "fp4"]


class PoolSite(Section):
    name: str = Field(min_length=1, max_length=64, description="Site name, unique; letters, digits, '-', '_'.")
    accelerators: int = Field(ge=0, le=1024, description="Free accelerators (workers) this site can lend the job.")
    kind: str = Field(default="cpu", max_length=64, description="What they are (a label: h100, a100, cpu).")
    speed: float = Field(
        default=1.0, gt=0, le=100, description="Relative step speed of one of them (1: job.step_s per inner step)."
    )
    cost_per_hour: float = Field(default=0.0, ge=0, description="Price of one accelerator-hour (any currency, the same for all).")
    corpus: str | None = Field(default=None, description="Training data that lives at this site (file or directory).")
    data_may_leave: bool = Field(
        default=True,
        description="false: this site's corpus may not leave it, so the site must take part (its workers read only it).",
    )

    _name_chars = field_validator("name")(site_name)

    @model_validator(mode="after")
    def _data(self) -> PoolSite:
        if not self.data_may_leave and self.corpus is None:
            raise ValueError("data_may_leave: false needs the site's corpus")
        if not self.data_may_leave and self.accelerators == 0:
            raise ValueError("accelerators: a site whose data may not leave must lend at least one")
        return self


class PoolLinks(Section):
    intra: LinkConfig = Field(
        default_factory=lambda: LinkConfig(bandwidth_bps=100e9, latency_s=5e-6), description="Links inside a site."
    )
    default: LinkConfig = Field(description="Links between two sites unless a pairs entry names them.")
    pairs: list[PairLinkConfig] = Field(
        default_factory=list, description="Measured or declared links of site pairs (both directions), overriding default."
    )


class Job(Section):
    tokens: float = Field(gt=0, le=1e16, description="Training tokens to reach (the target).")
    step_s: float = Field(gt=0, le=3600, description="Seconds of one inner step on one accelerator of speed 1.")
    params: int | None = Field(default=None, ge=1, description="Model parameters (unset: counted from the base config's model).")
    tokens_per_step: int | None = Field(
        default=None,
        ge=1,
        description="Tokens one worker trains per inner step (unset: batch_size x seq_len of the base config).",
    )
    objective: Literal["time", "cost"] = Field(
        default="time",
        description="'time': the shortest predicted time to the token target; 'cost': the lowest cost within deadline_h.",
    )
    deadline_h: float | None = Field(default=None, gt=0, description="Hours the run may take (needed by objective=cost).")
    budget: float | None = Field(default=None, gt=0, description="Most the run may cost (placements above it are left out).")
    utilization: float = Field(default=0.9, gt=0, lt=1, description="Compute utilisation the exchange is sized for.")
    H: list[int] = Field(
        default_factory=lambda: [10, 25, 50, 100, 250, 500],
        min_length=1,
        description="Inner steps per round to choose from (the smallest that reaches the utilisation).",
    )
    codecs: list[Codec] = Field(
        default_factory=_all_codecs,
        min_length=1,
        description="Codecs to choose from (the least compression that reaches it).",
    )
    tiers: bool = Field(default=True, description="Consider two tiers (regions by latency) beside one.")
    config: str | None = Field(
        default=None,
        description="Base geotrain config the placement fills in (relative: beside the pool file; unset: the defaults).",
    )
    set: list[str] = Field(default_factory=list, description="KEY=VALUE overrides of the base config.")

    @field_validator("H")
    @classmethod
    def _h(cls, v: list[int]) -> list[int]:
        if any(h < 1 or h > 100_000 for h in v):
            raise ValueError("every H must be between 1 and 100000")
        return sorted(set(v))

    @model_validator(mode="after")
    def _cost(self) -> Job:
        if self.objective == "cost" and self.deadline_h is None:
            raise ValueError("deadline_h: objective=cost chooses the cheapest placement within a deadline; set it")
        return self


class Pool(Section):
    sites: list[PoolSite] = Field(min_length=1, max_length=64, description="The sites with free accelerators.")
    links: PoolLinks = Field(description="The link matrix: a default and measured pairs.")
    job: Job = Field(description="What to train and the target.")

    @model_validator(mode="after")
    def _names(self) -> Pool:
        names = [s.name for s in self.sites]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"sites: site names must be unique (repeated: {', '.join(dup)})")
        if not any(s.accelerators for s in self.sites):
            raise ValueError("sites: no site lends an accelerator")
        seen: set[frozenset[str]] = set()
        for i, link in enumerate(self.links.pairs):
            for name in link.sites:
                if name not in names:
                    raise ValueError(f"links.pairs[{i}].sites: unknown site {name!r} (sites: {', '.join(names)})")
            if frozenset(link.sites) in seen:
                raise ValueError(f"links.pairs[{i}].sites: the link {link.sites[0]}-{link.sites[1]} is given twice")
            seen.add(frozenset(link.sites))
        return self

    def matrix(self) -> tuple[list[list[float]], list[list[float]]]:
        """(bandwidth bit/s, one-way latency s) between every two sites, by index."""
        n, d = len(self.sites), self.links.default
        bw = [[d.bandwidth_bps] * n for _ in range(n)]
        lat = [[d.latency_s] * n for _ in range(n)]
        index = {s.name: i for i, s in enumerate(self.sites)}
        for p in self.links.pairs:
            a, b = (index[s] for s in p.sites)
            bw[a][b] = bw[b][a] = p.bandwidth_bps
            lat[a][b] = lat[b][a] = p.latency_s
        return bw, lat


def load_pool(path: str | Path, overrides: list[str] | None = None) -> Pool:
    """Read and check a pool file (raises ConfigError: one line naming the field)."""
    return load_yaml_model(Pool, path, overrides, option="POOL")
