"""Typed, validated configuration for a geotrain run.

One pydantic model per section (topology, model, data, train, optim, sync, run). Every
field has a description (rendered into docs/CONFIG.md) and is checked when the config is
loaded, never deep inside a run: unknown keys, wrong types (strict mode: a string is not a
number) and out-of-range values raise :class:`ConfigError` whose message names the field.

Config comes from an optional YAML file plus ``KEY=VALUE`` overrides (``train.steps=200``);
override values are parsed as YAML scalars, so ``sync.algorithm=ddp`` and ``optim.lr=1e-3``
both do what one expects. This module imports no torch so the CLI can reject bad input fast.
"""

from __future__ import annotations

import contextlib
import copy
import re
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A configuration problem, with a one-line message that names the field."""


class Section(BaseModel):
    """Base of every section of a file geotrain reads: unknown keys refused, strict types."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True)


# --------------------------------------------------------------------------- topology


class LinkConfig(Section):
    """A network link class: bandwidth in bits per second and one-way latency in seconds.

    Inter-site links are emulated (see :mod:`geotrain.wan`): the bytes each rank sends to another
    site are paced to the link's bandwidth (shared by all ranks of the site) and delayed by its
    latency.
    """

    bandwidth_bps: float = Field(gt=0, description="Link bandwidth in bits per second (e.g. 1.0e+9 for 1 Gbit/s).")
    latency_s: float = Field(ge=0, le=10, description="One-way latency in seconds (0 to 10).")


class PairLinkConfig(LinkConfig):
    sites: list[str] = Field(description="The two sites this link joins (both directions get the same bandwidth and latency).")

    @field_validator("sites")
    @classmethod
    def _two(cls, v: list[str]) -> list[str]:
        if len(v) != 2 or v[0] == v[1]:
            raise ValueError("must name two different sites")
        return v


class LinksConfig(Section):
    emulate: Literal["off", "inprocess", "kernel"] = Field(
        default="inprocess",
        description="How inter-site links are emulated on one machine: 'inprocess' (pacing and delay inside geotrain, no root needed), "
        "'kernel' (a network namespace per site, tc bandwidth limits, latency in-process; needs root and ip), 'off' (loopback speed).",
    )

    @field_validator("emulate", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        return "off" if v is False else v  # YAML 1.1 reads a bare `off` as false

    intra: LinkConfig = Field(
        default_factory=lambda: LinkConfig(bandwidth_bps=100e9, latency_s=5e-6),
        description="Links between workers of the same site (scale-out fabric inside a datacenter).",
    )
    inter: LinkConfig = Field(
        default_factory=lambda: LinkConfig(bandwidth_bps=1e9, latency_s=0.02),
        description="Links between sites (wide-area network), unless a 'between' entry names the pair.",
    )
    between: list[PairLinkConfig] = Field(
        default_factory=list,
        description="Per site-pair links overriding 'inter', e.g. [{sites: [A, B], bandwidth_bps: 1.0e+8, latency_s: 0.04}].",
    )


class SiteConfig(Section):
    name: str = Field(min_length=1, max_length=64, description="Site (datacenter) name, unique; letters, digits, '-', '_'.")
    workers: int = Field(ge=1, le=1024, description="Number of workers (ranks) in this site.")
    region: str | None = Field(default=None, description="Optional region for multi-tier sync (site -> region -> continent).")
    corpus: str | None = Field(
        default=None,
        description="This site's private training data (file or directory): its workers read only this; "
        "unset: the site's share of data.corpus.",
    )

    @field_validator("corpus")
    @classmethod
    def _site_corpus_exists(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).expanduser().exists():
            raise ValueError(f"file or directory not found: {v}")
        return None if v is None else str(Path(v).expanduser().resolve())

    @field_validator("name")
    @classmethod
    def _name_chars(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_-]+", v):
            raise ValueError("may contain only letters, digits, '-' and '_'")
        return v


class TopologyConfig(Section):
    sites: list[SiteConfig] = Field(
        default_factory=lambda: [SiteConfig(name="A", workers=2), SiteConfig(name="B", workers=2)],
        description="The sites (datacenters) taking part; ranks are numbered site by site in this order.",
    )
    links: LinksConfig = Field(default_factory=LinksConfig, description="Intra-site and inter-site link properties.")

    @field_validator("sites")
    @classmethod
    def _sites_ok(cls, v: list[SiteConfig]) -> list[SiteConfig]:
        if not v:
            raise ValueError("at least one site is required")
        names = [s.name for s in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"site names must be unique (repeated: {', '.join(dup)})")
        if len({s.workers for s in v}) != 1:
            raise ValueError(
                "all sites must have the same number of workers for now "
                f"(got {[s.workers for s in v]}); heterogeneous sites are planned"
            )
        return v

    @model_validator(mode="after")
    def _links_name_sites(self) -> TopologyConfig:
        names = [s.name for s in self.sites]
        seen: set[frozenset[str]] = set()
        for i, link in enumerate(self.links.between):
            for name in link.sites:
                if name not in names:
                    raise ValueError(f"links.between[{i}].sites: unknown site {name!r} (sites: {', '.join(names)})")
            pair = frozenset(link.sites)
            if pair in seen:
                raise ValueError(f"links.between[{i}].sites: the link {link.sites[0]}-{link.sites[1]} is given twice")
            seen.add(pair)
        return self


# --------------------------------------------------------------------------- model / data


class ModelConfig(Section):
    kind: Literal["gpt", "hf"] = Field(
        default="gpt",
        description="'gpt': geotrain's GPT decoder; 'hf': a Hugging Face causal LM built from a config (needs the 'hf' extra).",
    )
    n_layer: int = Field(default=4, ge=1, le=256, description="Transformer blocks.")
    n_head: int = Field(default=4, ge=1, le=256, description="Attention heads.")
    n_embd: int = Field(default=128, ge=8, le=65536, description="Hidden size; must be divisible by n_head.")
    block_size: int = Field(default=64, ge=4, le=65536, description="Sequence length (context) in tokens.")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout probability.")
    hf: dict[str, Any] = Field(
        default_factory=lambda: {"model_type": "gpt2"},
        description="For kind=hf: keyword arguments for transformers.AutoConfig.for_model (model_type plus sizes). "
        "Sizes not given are taken from n_layer/n_head/n_embd/block_size; vocab is always 256 (bytes).",
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        return self


class DataConfig(Section):
    corpus: str | None = Field(
        default=None,
        description="A text file or directory of text files to train on. Default (null): text that ships with "
        "CPython (pydoc topics and standard-library sources), so nothing is downloaded.",
    )
    eval_fraction: float = Field(default=0.05, gt=0, lt=0.5, description="Share of the corpus held out for evaluation.")
    non_iid: bool = Field(
        default=False,
        description="Give each site its own contiguous slice of the corpus (sites as organisations with their own data).",
    )

    @field_validator("corpus")
    @classmethod
    def _corpus_exists(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).expanduser().exists():
            raise ValueError(f"file or directory not found: {v}")
        return None if v is None else str(Path(v).expanduser().resolve())


# --------------------------------------------------------------------------- training


class TrainConfig(Section):
    steps: int = Field(default=300, ge=1, le=10_000_000, description="Inner (local) optimizer steps per worker.")
    batch_size: int = Field(default=8, ge=1, le=65536, description="Sequences per worker per step.")
    seed: int = Field(default=1234, ge=0, description="Seed for model init and data sampling.")
    eval_every: int = Field(
        default=0, ge=0, description="Evaluate every N steps; 0 = every sync round (H) for diloco, every 25 steps for ddp."
    )
    eval_batches: int = Field(
        default=8, ge=1, le=10000, description="Held-out batches (of batch_size) per evaluation, split over all ranks."
    )
    log_every: int = Field(default=25, ge=1, description="Print a log line every N steps (local rank 0 of each site).")
    threads: int = Field(
        default=0, ge=0, le=1024, description="torch threads per rank; 0 = CPU cores / ranks on this machine (at least 1)."
    )
    save_final: bool = Field(default=True, description="Write the final global model to OUT/final_model.pt.")
    timeline: bool = Field(
        default=False, description="Record per-rank compute and network intervals to OUT/timeline/rank{r}.json (for plots)."
    )


class OptimConfig(Section):
    name: Literal["adamw", "sgd"] = Field(default="adamw", description="Inner optimizer.")
    lr: float = Field(default=4e-4, gt=0, le=10, description="Inner learning rate (DiLoCo paper: 4e-4).")
    weight_decay: float = Field(default=0.1, ge=0, le=1, description="Weight decay (DiLoCo paper: 0.1).")
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.95], description="AdamW betas (DiLoCo paper: 0.9, 0.95).")
    momentum: float = Field(default=0.0, ge=0, lt=1, description="Momentum for name=sgd.")
    warmup_steps: int = Field(default=20, ge=0, description="Linear learning-rate warm-up steps.")
    schedule: Literal["constant", "cosine"] = Field(
        default="cosine", description="Learning rate after warm-up: constant, or cosine decay to 10% at the last step."
    )
    grad_clip: float = Field(default=1.0, ge=0, description="Clip the (averaged) gradient norm to this value; 0 disables.")

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: list[float]) -> list[float]:
        if len(v) != 2 or not all(0 <= b < 1 for b in v):
            raise ValueError("must be two numbers in [0, 1)")
        return v


CODEC_BITS = {"none": 32, "bf16": 16, "fp16": 16, "int8": 8, "fp4": 4, "int4": 4}


class SyncConfig(Section):
    algorithm: Literal["ddp", "diloco", "streaming"] = Field(
        default="diloco",
        description="'ddp': all-reduce gradients over all ranks every step. 'diloco': all-reduce in a site every step, average pseudo-gradients across sites every H steps. 'streaming': Streaming DiLoCo, fragments synced at staggered steps and merged tau steps later.",
    )
    H: int = Field(default=50, ge=1, le=1_000_000, description="DiLoCo inner steps per outer round.")
    outer_lr: float = Field(default=0.7, gt=0, le=10, description="Outer SGD learning rate (DiLoCo paper: 0.7).")
    outer_momentum: float = Field(default=0.9, ge=0, lt=1, description="Outer SGD momentum (DiLoCo paper: 0.9).")
    nesterov: bool = Field(default=True, description="Nesterov outer momentum (DiLoCo paper: true).")
    weight_by_tokens: bool = Field(
        default=False, description="Weight each site's pseudo-gradient by the tokens it processed in the round."
    )
    allreduce: Literal["hierarchical", "flat"] = Field(
        default="hierarchical",
        description="How gradients cross sites: 'hierarchical' (reduce-scatter in site, all-reduce across sites, all-gather in site) or 'flat' (one ring over all ranks).",
    )
    fragments: int = Field(
        default=4, ge=1, le=4096, description="Streaming DiLoCo: number of fragments (strided groups of layers)."
    )
    tau: int = Field(
        default=5, ge=0, le=1_000_000, description="Streaming DiLoCo: inner steps between a fragment's sync and its merge."
    )
    alpha: float = Field(
        default=0.5, ge=0, le=1, description="Streaming DiLoCo: merged = alpha * local + (1 - alpha) * new global."
    )
    codec: Literal["none", "bf16", "fp16", "int8", "fp4", "int4", "topk", "powersgd"] = Field(
        default="none",
        description="Encoding of what crosses sites (DiLoCo/streaming pseudo-gradients, DDP gradients); in-site traffic stays fp32.",
    )
    bits: int | None = Field(
        default=None, description="Optional check of the codec's width: bf16/fp16 16, int8 8, fp4/int4 4, none 32."
    )
    block_size: int = Field(default=64, ge=2, le=1 << 20, description="fp4/int4: values per fp32 scale (even).")
    sigma_range: float = Field(default=6.0, gt=0, le=64, description="int8: buckets span mean ± sigma_range · std.")
    topk_fraction: float = Field(default=0.01, gt=0, le=1, description="topk: fraction of entries sent.")
    rank: int = Field(default=4, ge=1, le=4096, description="powersgd: approximation rank.")
    chunk_bytes: int = Field(
        default=4 << 20,
        ge=4096,
        le=1 << 34,
        description="fp32 all-reduces are cut into chunks of this many bytes, pipelined over the lanes.",
    )
    lanes: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Chunks in flight at once (each lane has its own process groups), so one chunk's in-site phases "
        "and latency overlap with another's wide-area transfer.",
    )
    eager: bool = Field(
        default=False,
        description="Streaming DiLoCo, eager variant: a fragment's all-reduce gets a whole round; its outer step uses the "
        "fresh local pseudo-gradient plus the other sites' one-round-old ones (tau is not used).",
    )
    error_feedback: bool | None = Field(
        default=None,
        description="Add what the codec left out to the next round's input; default: on for topk and powersgd, off otherwise.",
    )

    @model_validator(mode="after")
    def _cross_field(self) -> SyncConfig:
        if self.nesterov and self.outer_momentum == 0:
            raise ValueError("nesterov needs outer_momentum > 0 (set sync.nesterov=false for plain SGD)")
        if self.bits is not None:
            width = CODEC_BITS.get(self.codec)
            if width is None:
                raise ValueError(f"bits: the {self.codec} codec has no fixed width; leave bits unset")
            if self.bits != width:
                raise ValueError(f"bits: the {self.codec} codec sends {width} bits per value (allowed: {width}; got {self.bits})")
        if self.block_size % 2:
            raise ValueError(f"block_size: must be even, two 4-bit codes per byte (got {self.block_size})")
        if self.eager and self.weight_by_tokens:
            raise ValueError("eager: the eager variant averages sites equally; it cannot be combined with weight_by_tokens")
        if self.algorithm == "streaming" and not self.eager and self.tau >= self.H:
            raise ValueError(f"tau: must be below H={self.H}, a fragment merges before it syncs again (got {self.tau})")
        return self

    @property
    def uses_error_feedback(self) -> bool:
        if self.error_feedback is not None:
            return self.error_feedback
        return self.codec in ("topk", "powersgd")


def _check_site_at_round(items: list[str], kinds: tuple[str, ...]) -> list[str]:
    """Validate failure injections 'SITE@ROUND' (or 'SITE@ROUND:KIND' for one of ``kinds``)."""
    suffix = f":({'|'.join(kinds)})" if kinds else ""
    expected = " or ".join(f"SITE@ROUND:{k}" for k in kinds) or "SITE@ROUND"
    for i, item in enumerate(items):
        if not re.fullmatch(rf"[A-Za-z0-9_-]+@\d+{suffix}", item):
            raise ValueError(f"item {i} ({item!r}): expected {expected}")
    return items


def _parse_site_at_round(item: str) -> tuple[str, int, str]:
    """'SITE@ROUND[:KIND]' -> (site, round, kind or '')."""
    site, rest = item.split("@")
    rnd, _, kind = rest.partition(":")
    return site, int(rnd), kind


class DPConfig(Section):
    unit: Literal["none", "site", "example"] = Field(
        default="none",
        description="Differential privacy unit: none; site (each site clips its pseudo-gradient and adds its share of "
        "Gaussian noise, meaningful with many sites); example (DP-SGD on the inner steps: per-example clipping and noise).",
    )
    epsilon: float | None = Field(
        default=None,
        gt=0,
        description="Privacy budget ε: training stops before a step would exceed it. With noise_multiplier unset, the noise "
        "is calibrated so the planned run spends exactly this.",
    )
    delta: float = Field(default=1e-5, gt=0, lt=1, description="δ of (ε, δ)-DP (0 < δ < 1; well below 1/records).")
    clip_norm: float = Field(
        default=1.0, gt=0, description="L2 bound of one unit's contribution: a site's pseudo-gradient, or one example's gradient."
    )
    noise_multiplier: float | None = Field(
        default=None, ge=0, description="Noise std / clip_norm; unset: calibrated from epsilon (one of the two is needed)."
    )
    accountant: Literal["rdp", "prv"] = Field(default="rdp", description="Opacus privacy accountant.")


class PrivacyConfig(Section):
    secure_aggregation: bool = Field(
        default=False,
        description="Sum pseudo-gradients across sites with secure aggregation (pairwise masks; no site sees another's update).",
    )
    threshold: int | None = Field(
        default=None,
        ge=2,
        description="Shamir threshold t: shares needed to remove a dropped site's masks; a round needs t survivors. "
        "Default: a majority of each sharing set.",
    )
    graph: Literal["complete", "sparse"] = Field(
        default="complete", description="Masking graph: complete (Bonawitz et al.) or sparse (SecAgg+, O(log n) neighbours)."
    )
    update_bound: float = Field(
        default=100.0,
        gt=0,
        le=1e6,
        description="L2 bound a pseudo-gradient is clipped to before fixed-point encoding (with dp.unit=site: dp.clip_norm).",
    )
    dp: DPConfig = Field(default_factory=DPConfig, description="Differential privacy.")
    inject: list[str] = Field(
        default_factory=list,
        description="Failure injection for tests: 'SITE@ROUND:drop' withdraws the site's update after key agreement, "
        "'SITE@ROUND:malformed' sends a malformed masked update.",
    )

    @field_validator("inject")
    @classmethod
    def _inject_form(cls, v: list[str]) -> list[str]:
        return _check_site_at_round(v, ("drop", "malformed"))

    @model_validator(mode="after")
    def _dp_ok(self) -> PrivacyConfig:
        if self.dp.unit != "none" and self.dp.epsilon is None and self.dp.noise_multiplier is None:
            raise ValueError("dp.noise_multiplier: set it or dp.epsilon (to calibrate the noise) when dp.unit is not none")
        return self

    def injections(self) -> dict[tuple[str, int], str]:
        return {(site, rnd): kind for site, rnd, kind in map(_parse_site_at_round, self.inject)}


class GuardConfig(Section):
    enabled: bool = Field(default=True, description="Leave non-finite or outlier pseudo-gradients out of the average.")
    norm_factor: float = Field(
        default=10.0, gt=1, le=1e6, description="Exclude a site whose update norm exceeds this many times the running median."
    )
    window: int = Field(default=20, ge=1, le=10_000, description="Accepted norms the running median is taken over.")
    warmup: int = Field(default=3, ge=1, le=10_000, description="Accepted norms needed before the outlier test applies.")


class FaultConfig(Section):
    nan: list[str] = Field(
        default_factory=list, description="Failure injection: 'SITE@ROUND' makes that site's pseudo-gradient NaN in that round."
    )
    kill: list[str] = Field(
        default_factory=list,
        description="Failure injection (elastic mode): 'SITE@STEP' SIGKILLs every process of that site at that inner step; "
        "at a round's last step, in the middle of the cross-site all-reduce.",
    )
    hang: list[str] = Field(
        default_factory=list, description="Like kill, but SIGSTOPs the site (a hung datacenter: sockets stay open)."
    )
    restart_after: float = Field(
        default=0.0,
        ge=0,
        le=3600,
        description="Seconds after a kill or hang when the launcher starts the site again (it heals from a live peer); 0: never.",
    )

    @field_validator("nan", "kill", "hang")
    @classmethod
    def _site_at_round(cls, v: list[str]) -> list[str]:
        return _check_site_at_round(v, ())

    def nan_at(self) -> set[tuple[str, int]]:
        return {(site, rnd) for site, rnd, _ in map(_parse_site_at_round, self.nan)}

    def site_faults(self) -> dict[tuple[str, int], str]:
        """{(site, step): 'kill' | 'hang'} from ``kill`` and ``hang``."""
        out = {(site, step): "kill" for site, step, _ in map(_parse_site_at_round, self.kill)}
        out.update({(site, step): "hang" for site, step, _ in map(_parse_site_at_round, self.hang)})
        return out


class ElasticConfig(Section):
    """Elastic cross-site membership (geotrain.membership): a quorum per outer round, rollback of
    failed rounds, heartbeats, live healing, HMAC-authenticated joins."""

    enabled: bool = Field(
        default=False,
        description="Run sites as independent jobs joined per round by a membership layer (torchft Lighthouse): a site may "
        "die, hang or rejoin without stopping the others. DiLoCo only.",
    )
    min_sites: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="Fewest live sites a round needs; below it training pauses (logged) until sites return.",
    )
    lighthouse: str | None = Field(
        default=None,
        description="HOST:PORT of a running membership coordinator (geotrain lighthouse); default: the launcher starts and "
        "supervises one on 127.0.0.1.",
    )
    heartbeat_s: float = Field(default=0.25, gt=0, le=60, description="Seconds between heartbeats.")
    heartbeat_timeout_s: float = Field(
        default=2.0, gt=0, le=600, description="A site silent this long is declared failed and its round aborted."
    )
    quorum_timeout_s: float = Field(
        default=5.0, gt=0, le=3600, description="Seconds one quorum request waits before it is retried (and logged)."
    )
    start_timeout_s: float = Field(
        default=120.0,
        gt=0,
        le=86_400,
        description="At the start, wait this long for every site before training without the missing ones.",
    )
    collective_timeout_s: float = Field(
        default=120.0, gt=0, le=86_400, description="Backstop timeout of one cross-site operation (heartbeats abort sooner)."
    )
    secret_env: str = Field(default="GEOTRAIN_SECRET", description="Environment variable holding the shared membership secret.")
    secret_file: str | None = Field(
        default=None, description="File holding the shared membership secret (instead of secret_env)."
    )

    @model_validator(mode="after")
    def _timeouts(self) -> ElasticConfig:
        if self.heartbeat_timeout_s <= 2 * self.heartbeat_s:
            raise ValueError("heartbeat_timeout_s: must exceed twice elastic.heartbeat_s")
        return self


class CheckpointConfig(Section):
    every: int = Field(default=0, ge=0, description="Write a checkpoint every N inner steps (0: never).")
    dir: str | None = Field(default=None, description="Where checkpoints go; default OUT/checkpoints.")
    keep: int = Field(default=3, ge=1, le=1000, description="Keep the newest N checkpoints.")
    resume: str | None = Field(
        default=None,
        description="Resume from 'auto' (the newest valid checkpoint under dir) or from this checkpoint "
        "(a step-N directory); a truncated or tampered one is refused.",
    )


class RunConfig(Section):
    baseline: Literal["ddp", "diloco", "streaming", "none"] = Field(
        default="ddp", description="Also train this algorithm on the same tokens and compare; 'none' to skip."
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto", description="torch.distributed backend; auto = nccl with CUDA, else gloo."
    )
    timeout_s: float = Field(default=300, gt=0, le=86400, description="Collective timeout in seconds.")


class Config(Section):
    topology: TopologyConfig = Field(default_factory=TopologyConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig, description="Cross-organisation mode: secure aggregation, DP.")
    guard: GuardConfig = Field(default_factory=GuardConfig, description="Guarded updates.")
    fault: FaultConfig = Field(default_factory=FaultConfig, description="Failure injection (tests, chaos).")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Atomic, hashed checkpoints and exact resume."
    )
    elastic: ElasticConfig = Field(
        default_factory=ElasticConfig, description="Sites that fail, hang and rejoin: quorum, rollback, healing."
    )

    @model_validator(mode="after")
    def _privacy_fits(self) -> Config:
        p, n = self.privacy, len(self.topology.sites)
        if p.threshold is not None and p.threshold > n:
            raise ValueError(f"privacy.threshold: {p.threshold} is larger than the number of sites ({n})")
        if p.secure_aggregation and self.sync.algorithm == "ddp":
            raise ValueError("privacy.secure_aggregation: works on pseudo-gradients; use sync.algorithm=diloco or streaming")
        if p.dp.unit == "site" and self.sync.algorithm == "ddp":
            raise ValueError("privacy.dp.unit: 'site' protects pseudo-gradients; use sync.algorithm=diloco or streaming")
        if (p.secure_aggregation or p.dp.unit == "site") and self.sync.codec != "none":
            raise ValueError("sync.codec: secure aggregation and site-level DP send fixed-point/fp32 values; set sync.codec=none")
        if (p.secure_aggregation or p.dp.unit == "site") and self.sync.weight_by_tokens:
            raise ValueError("sync.weight_by_tokens: would reveal each site's token count; not with privacy")
        if (p.secure_aggregation or p.dp.unit == "site") and self.sync.eager:
            raise ValueError("sync.eager: the eager variant uses each site's own share of the average; not with privacy")
        if p.secure_aggregation and p.threshold is not None and p.graph == "sparse":
            from geotrain.secagg import sparse_degree

            k = sparse_degree(n)
            if p.threshold > k + 1:
                raise ValueError(
                    f"privacy.threshold: {p.threshold} is more than a site and its {k} neighbours can hold (graph=sparse)"
                )
        c = self.checkpoint
        if c.resume not in (None, "auto") and self.run.baseline not in ("none", self.sync.algorithm):
            raise ValueError("checkpoint.resume: a checkpoint path resumes one run; set run.baseline=none (or resume=auto)")
        if (c.every or c.resume) and self.sync.eager:
            raise ValueError("checkpoint.every: checkpoints of the eager streaming variant are not supported")
        names = [s.name for s in self.topology.sites]
        for (site, _), _kind in p.injections().items():
            if site not in names:
                raise ValueError(f"privacy.inject: unknown site {site!r} (sites: {', '.join(names)})")
        for site, _ in self.fault.nan_at():
            if site not in names:
                raise ValueError(f"fault.nan: unknown site {site!r} (sites: {', '.join(names)})")
        for (site, _), kind in self.fault.site_faults().items():
            if site not in names:
                raise ValueError(f"fault.{kind}: unknown site {site!r} (sites: {', '.join(names)})")
            if not self.elastic.enabled:
                raise ValueError(f"fault.{kind}: killing or hanging a site needs elastic.enabled=true")
        self._elastic_fits(len(names))
        return self

    def _elastic_fits(self, n: int) -> None:
        e = self.elastic
        if not e.enabled:
            return
        if e.min_sites > n:
            raise ValueError(f"elastic.min_sites: {e.min_sites} is more than the number of sites ({n})")
        if self.sync.algorithm != "diloco":
            raise ValueError("sync.algorithm: elastic mode runs diloco (allowed: diloco)")
        if self.sync.codec != "none" or self.sync.weight_by_tokens:
            raise ValueError(
                "sync.codec: elastic mode averages fp32 pseudo-gradients; set sync.codec=none, weight_by_tokens=false"
            )
        if self.privacy.secure_aggregation or self.privacy.dp.unit != "none":
            raise ValueError("privacy: not combined with elastic mode yet; set elastic.enabled=false")
        if self.checkpoint.every or self.checkpoint.resume:
            raise ValueError("checkpoint.every: elastic sites heal from live peers instead; set checkpoint.every=0")
        if self.topology.links.emulate == "kernel":
            raise ValueError("topology.links.emulate: elastic mode supports off or inprocess")

    def with_algorithm(self, algorithm: str) -> Config:
        """A copy of this config that trains with ``algorithm`` and no baseline."""
        data = self.model_dump()
        data["sync"]["algorithm"] = algorithm
        data["run"]["baseline"] = "none"
        if algorithm != "diloco":  # elastic mode (and site kills) is DiLoCo's; the baseline runs plain
            data["elastic"]["enabled"] = False
            data["fault"]["kill"], data["fault"]["hang"] = [], []
        if algorithm == "ddp":  # a DDP baseline exchanges gradients: no pseudo-gradient privacy to apply
            data["privacy"]["secure_aggregation"] = False
            if data["privacy"]["dp"]["unit"] == "site":
                data["privacy"]["dp"]["unit"] = "none"
        if data["checkpoint"]["dir"] is not None and self.run.baseline not in ("none", self.sync.algorithm):
            data["checkpoint"]["dir"] = str(Path(data["checkpoint"]["dir"]) / algorithm)  # one directory per run
        return Config.model_validate(data)

    @property
    def eval_every(self) -> int:
        if self.train.eval_every:
            return self.train.eval_every
        return self.sync.H if self.sync.algorithm != "ddp" else 25


# --------------------------------------------------------------------------- loading


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e9`` as a float (YAML 1.1 insists on ``1.0e+9``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?[eE][-+]?\d+$|^[-+]?\d[\d_]*\.\d*$|^[-+]?\.\d+$"),
    list("-+0123456789."),
)


def _parse_scalar(text: str) -> Any:
    return yaml.load(text, Loader=_Loader) if text.strip() else ""


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"{'.'.join(parts[: i + 1])}: no such list element in override '{key}'")
            node = node[int(part)]
            continue
        if part not in node or node[part] is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is not a section, cannot set '{key}'")
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError(f"{key}: no such list element")
        node[int(last)] = value
    else:
        node[last] = value


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, recursively for mappings; anything else in ``top`` replaces."""
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _loc_to_str(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "config"


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The config section type an annotation holds (``X``, ``X | None``, ``list[X]``), if any."""
    for a in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _allowed_keys(root: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    model: Any = root
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = _submodel(field.annotation)
        if model is None:
            return []
    return sorted(getattr(model, "model_fields", {}))


def format_error(err: ValidationError, root: type[BaseModel]) -> str:
    """The first validation error as one line: ``field.path: message (got value)``."""
    e = err.errors(include_url=False)[0]
    loc = tuple(e["loc"])
    field = _loc_to_str(loc)
    if e["type"] == "extra_forbidden":
        allowed = _allowed_keys(root, loc)
        hint = f"; allowed keys: {', '.join(allowed)}" if allowed else ""
        return f"{field}: unknown key{hint}"
    msg = e["msg"].removeprefix("Value error, ")
    named = re.match(r"([A-Za-z_][A-Za-z0-9_.\[\]]*): (.*)", msg)
    if e["type"] == "value_error" and named and named.group(1).split(".")[0].split("[")[0] in _allowed_keys(root, (*loc, "")):
        # a cross-field check that names its field: report it at that field
        return f"{_loc_to_str((*loc, named.group(1)))}: {named.group(2)}"
    if "input" in e and e["type"] not in ("missing",) and not isinstance(e["input"], dict):
        return f"{field}: {msg} (got {e['input']!r})"
    return f"{field}: {msg}"


def load_yaml_model(root: type[M], path: str | Path | None, overrides: list[str] | None = None, option: str = "--config") -> M:
    """Validate ``root`` from an optional YAML file plus ``KEY=VALUE`` overrides.

    Shared by training configs and the planner/simulator scenarios, so every file geotrain reads
    has the same rules: strict types, unknown keys refused, one-line errors naming the field.

    Raises:
        ConfigError: with a one-line message naming the offending field.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{option}: file not found: {path}")
        try:
            loaded = yaml.load(p.read_text(), Loader=_Loader)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{option}: not valid YAML: {str(exc).splitlines()[0]}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{option}: the file must hold a mapping of sections ({', '.join(root.model_fields)})")
        data = loaded
    data = copy.deepcopy(data)
    if overrides:  # so an override can reach into defaults, e.g. topology.sites.0.region=eu
        with contextlib.suppress(ValidationError):  # a root with required keys: overrides apply to the file only
            data = _merge(root().model_dump(), data)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set: expected KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        if not key or not re.fullmatch(r"[A-Za-z0-9_.]+", key):
            raise ConfigError(f"--set: bad key {key!r}")
        try:
            parsed = _parse_scalar(value)
        except yaml.YAMLError:
            raise ConfigError(f"{key}: cannot parse value {value!r}") from None
        _set_dotted(data, key, parsed)
    try:
        return root.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_error(exc, root)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a training config from an optional YAML file plus ``KEY=VALUE`` overrides.

    Raises:
        ConfigError: with a one-line message naming the offending field.
    """
    return load_yaml_model(Config, path, overrides)


def markdown_reference() -> str:
    """The config reference (docs/CONFIG.md), generated from the field descriptions."""
    lines = [
        "# Configuration reference",
        "",
        "Generated by `geotrain config --markdown` from `geotrain/config.py`; a test keeps it in sync.",
        "Set values in a YAML file (`--config FILE`) or on the command line (`--set section.key=value`,",
        "list elements by index: `--set topology.sites.0.workers=4`). Unknown keys and bad values are",
        "rejected at load time with a one-line error naming the field (exit code 2).",
        "",
    ]

    def walk(model: type[BaseModel], prefix: str, defaults: dict[str, Any], about: str) -> None:
        rows, element_sections = [], []
        for name, f in model.model_fields.items():
            sub = _submodel(f.annotation)
            is_list = getattr(f.annotation, "__origin__", None) is list
            if sub is not None and not is_list:
                walk(sub, f"{prefix}{name}.", defaults[name], f.description or "")
                continue
            if name in defaults:
                default = f"`{defaults[name]!r}`"
            else:  # inside a list element there are no config-level defaults
                default = "required" if f.is_required() else f"`{f.get_default(call_default_factory=True)!r}`"
            rows.append(f"| `{prefix}{name}` | {default} | {f.description or ''} |")
            if sub is not None:  # a list of sections (topology.sites): document one element's keys
                element_sections.append((sub, f"{prefix}{name}[i]."))
        if rows:
            head = [f"## `{prefix.rstrip('.')}`", ""] + ([about, ""] if about else [])
            lines.extend([*head, "| key | default | meaning |", "|---|---|---|", *rows, ""])
        for sub, element_prefix in element_sections:
            walk(sub, element_prefix, {}, "")

    walk(Config, "", Config().model_dump(), "")
    return "\n".join(lines)
