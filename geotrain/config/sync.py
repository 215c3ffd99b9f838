"""The sync section: how sites synchronise (DDP, DiLoCo, Streaming DiLoCo), what crosses sites and how it is encoded."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from geotrain.config.base import Section

CODEC_BITS = {"none": 32, "bf16": 16, "fp16": 16, "int8": 8, "fp4": 4, "int4": 4}
FixedCodec = Literal["none", "bf16", "fp16", "int8", "fp4", "int4"]
ADAPT_CODECS: tuple[FixedCodec, ...] = ("none", "bf16", "int8", "fp4")  # sync.adapt.codecs' default
STREAMING_HOLD = 0.05  # sync.adapt.hold's default with Streaming DiLoCo


class AdaptConfig(Section):
    """Adaptation to the measured network (DiLoCo or Streaming DiLoCo, lock-step rounds;
    docs/PACE.md): after every round (streaming: every H steps, one cycle of its fragments) the
    link's achieved bandwidth and latency are measured, and H, the codec and (streaming) the
    fragment count are chosen with the planner's closed form
    (:func:`geotrain.plan.strategies.utilization`)."""

    target: float = Field(
        default=0.9, gt=0, lt=1, description="Compute utilisation to hold (compute time / wall time of a round)."
    )
    H_min: int = Field(default=10, ge=1, le=1_000_000, description="The fewest inner steps per round adaptation may choose.")
    H_max: int = Field(default=500, ge=1, le=1_000_000, description="The most inner steps per round adaptation may choose.")
    codecs: list[FixedCodec] = Field(
        default_factory=lambda: list(ADAPT_CODECS),
        min_length=1,
        description="The codecs adaptation may choose from (fixed-width ones, no error feedback); the least compression that "
        "reaches the target within H_max wins, then the smallest H.",
    )
    fragments: list[int] | None = Field(
        default=None,
        min_length=1,
        description="Streaming DiLoCo: the fragment counts adaptation may choose from (after the codec and H, the fewest "
        "that reach the target); default: 1, 2, 4, ... up to sync.fragments, and sync.fragments.",
    )
    hold: float | None = Field(
        default=None,
        ge=0,
        lt=1,
        description="Streaming DiLoCo: keep the current H, codec and fragment count while the formula predicts them "
        "between target and target + hold on the cycle's measured link (a change of H or of the fragment count merges "
        f"early and rebuilds the fragments); default {STREAMING_HOLD}, 0 = choose afresh every cycle.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> AdaptConfig:
        if self.H_min > self.H_max:
            raise ValueError(f"H_min: must be at most H_max={self.H_max} (got {self.H_min})")
        dup = sorted({c for c in self.codecs if self.codecs.count(c) > 1})
        if dup:
            raise ValueError(f"codecs: each codec once (repeated: {', '.join(dup)})")
        if self.fragments is not None:
            if any(not 1 <= f <= 4096 for f in self.fragments):
                raise ValueError(f"fragments: each count in 1..4096 (got {self.fragments})")
            if len(set(self.fragments)) < len(self.fragments):
                raise ValueError(f"fragments: each count once (got {self.fragments})")
        return self

    def fragment_choices(self, first: int) -> list[int]:
        """The fragment counts to choose from, ascending, given the run's first one (``sync.fragments``)."""
        if self.fragments is not None:
            return sorted(self.fragments)
        return sorted({1 << i for i in range(first.bit_length()) if 1 << i <= first} | {first})


class QuorumConfig(Section):
    """Asynchronous quorum rounds (DiLoCo, or Streaming DiLoCo's fragments; docs/QUORUM.md): a syncer
    beside the first site's local rank 0 (in two tiers, each region's first) merges pseudo-gradients when ``sites`` sites have delivered, plus ``grace_s``; a site
    whose update was computed from an older global model is not made to wait, and its update is
    merged later, discounted by its staleness."""

    sites: int = Field(
        ge=1,
        le=100_000,
        description="Deliveries a round needs before it merges (at most the number of sites; elastic mode: sites in a round, "
        "more than half of them).",
    )
    grace_s: float = Field(
        default=0.0,
        ge=0,
        description="Seconds a round stays open for more deliveries once it has its quorum ('.inf': until every running "
        "site has delivered; elastic rounds of two tiers: at least 1 s, so that a world round holds every site).",
    )
    staleness_power: float = Field(
        default=0.5,
        ge=0,
        le=8,
        description="A late update's weight is multiplied by (1 + staleness)^-power, staleness = merges since the global "
        "model it started from (FedAsync's polynomial rule; 0: no discount).",
    )


# the codec's keys that were flat in sync: refused in one line naming their new key
MOVED_CODEC_KEYS = {
    f"sync.{old}": f"sync.codec.{new}"
    for old, new in {
        "bits": "bits", "block_size": "block_size", "sigma_range": "sigma_range", "topk_fraction": "fraction",
        "sparse_fraction": "fraction", "sparse_chunk": "chunk", "sparse_variant": "variant", "sparse_tile": "tile",
        "sparse_spread": "spread", "rank": "rank", "error_feedback": "error_feedback", "ef_decay": "ef_decay",
    }.items()
}  # fmt: skip


class CodecConfig(Section):
    """How what crosses sites is encoded (docs/CODECS.md): the codec by name and its parameters.
    Set by its name alone (``sync.codec=int8``: the other keys keep their values) or key by key
    (``sync.codec.fraction=0.02``)."""

    name: Literal["none", "bf16", "fp16", "int8", "fp4", "int4", "topk", "sparseloco", "powersgd"] = Field(
        default="none", description="The codec: fp32 ('none'), a fixed width, a sparse one (top-k, SparseLoCo) or PowerSGD."
    )
    bits: int | None = Field(
        default=None, description="Optional check of the codec's width: bf16/fp16 16, int8 8, fp4/int4 4, none 32."
    )
    block_size: int = Field(default=64, ge=2, le=1 << 20, description="fp4/int4: values per fp32 scale (even).")
    sigma_range: float = Field(default=6.0, gt=0, le=64, description="int8: buckets span mean ± sigma_range · std.")
    fraction: float = Field(
        default=0.01, gt=0, le=1, description="topk: fraction of entries sent; sparseloco: of each chunk's or tile's (0.5-5%)."
    )
    chunk: int = Field(
        default=4096,
        ge=64,
        le=1 << 20,
        description="sparseloco, chunks variant: values per chunk (top-k, offsets and 2-bit scales per chunk).",
    )
    variant: Literal["published", "chunks"] = Field(
        default="published",
        description="sparseloco: 'published' (arXiv 2508.15706 and its code: top-k in tiles of each matrix of up to "
        "tile x tile, vectors in runs of tile^2, 2-bit bins per tensor decoded to the bins' means, each coordinate "
        "averaged over the sites that sent it, error feedback decayed by ef_decay=0.95, outer SGD lr 1 without momentum) "
        "or 'chunks' (geotrain's first variant: contiguous runs of chunk values, sign and two levels per chunk, the sum "
        "divided by every site; DiLoCo's outer step; docs/CODECS.md).",
    )
    tile: int = Field(
        default=64, ge=8, le=1024, description="sparseloco, published variant: the side of a matrix's tiles (64: 64 x 64)."
    )
    spread: float = Field(
        default=6.0,
        gt=0,
        le=64,
        description="sparseloco, published variant: the 4 bins of the kept values span spread standard deviations.",
    )
    rank: int = Field(default=4, ge=1, le=4096, description="powersgd: approximation rank.")
    error_feedback: bool | None = Field(
        default=None,
        description="Add what the codec left out to the next round's input; default: on for topk, sparseloco and powersgd, "
        "off otherwise.",
    )
    ef_decay: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Error feedback: the residual is multiplied by this before the next round adds it (SparseLoCo's beta); "
        "default 0.95 for sparseloco's published variant, else 1 (no decay).",
    )

    @model_validator(mode="before")
    @classmethod
    def _by_name(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _check(self) -> CodecConfig:
        if self.bits is not None:
            width = CODEC_BITS.get(self.name)
            if width is None:
                raise ValueError(f"bits: the {self.name} codec has no fixed width; leave bits unset")
            if self.bits != width:
                raise ValueError(f"bits: the {self.name} codec sends {width} bits per value (allowed: {width}; got {self.bits})")
        if self.block_size % 2:
            raise ValueError(f"block_size: must be even, two 4-bit codes per byte (got {self.block_size})")
        if self.name == "sparseloco" and not 0.005 <= self.fraction <= 0.05:
            raise ValueError(f"fraction: sparseloco sends 0.5-5% of each chunk's entries (0.005..0.05; got {self.fraction:g})")
        return self

    @property
    def published_sparseloco(self) -> bool:
        return self.name == "sparseloco" and self.variant == "published"

    @property
    def error_decay(self) -> float:
        """:attr:`ef_decay` resolved: what each round's residual is multiplied by."""
        if self.ef_decay is not None:
            return self.ef_decay
        return 0.95 if self.published_sparseloco else 1.0

    @property
    def uses_error_feedback(self) -> bool:
        if self.error_feedback is not None:
            return self.error_feedback
        return self.name in ("topk", "sparseloco", "powersgd")


class SyncConfig(Section):
    algorithm: Literal["ddp", "diloco", "streaming"] = Field(
        default="diloco",
        description="'ddp': all-reduce gradients over all ranks every step. 'diloco': all-reduce in a site every step, average pseudo-gradients across sites every H steps. 'streaming': Streaming DiLoCo, fragments synced at staggered steps and merged tau steps later.",
    )
    within_site: Literal["replicate", "fsdp"] = Field(
        default="replicate",
        description="How a site holds the model: 'replicate' (every worker a whole copy, gradients all-reduced in the site) or 'fsdp' (FSDP2 fully_shard per block and root on the site's mesh: parameters, gradients, inner and outer optimizer state sharded over the site's workers; HSDP).",
    )
    H: int = Field(default=50, ge=1, le=1_000_000, description="DiLoCo inner steps per outer round.")
    outer_lr: float | None = Field(
        default=None,
        gt=0,
        le=10,
        description="Outer SGD learning rate; default 0.7 (DiLoCo paper), or 1.0 with sync.codec=sparseloco's published "
        "variant (SparseLoCo's outer step: plain SGD, error feedback in momentum's place).",
    )
    outer_momentum: float | None = Field(
        default=None, ge=0, lt=1, description="Outer SGD momentum; default 0.9 (DiLoCo paper), 0 for SparseLoCo."
    )
    nesterov: bool | None = Field(
        default=None, description="Nesterov outer momentum; default true (DiLoCo paper), false for SparseLoCo."
    )
    weight_by_tokens: bool = Field(
        default=True,
        description="Weight each site's pseudo-gradient by the tokens it processed in the round (its workers times its inner "
        "steps); sites that processed equal tokens are averaged equally, bit for bit as with false.",
    )
    pace: Literal["lockstep", "adaptive"] = Field(
        default="lockstep",
        description="How many inner steps each site runs per outer round: 'lockstep' (H everywhere: a fast site waits for the "
        "slowest at every round) or 'adaptive' (site s runs about H * rate_s / rate_max steps, from the step rates measured "
        "in the run and exchanged at each round boundary, so every site reaches the boundary at about the same time; "
        "after a lock-step calibration round of max(1, H/20) steps the run lasts ceil(train.steps / H) rounds; docs/PACE.md). "
        "With sync.quorum, where no site waits for another: dynamic local updates (Async Local-SGD), each site running about "
        "H x its measured steps per second / the fastest site's, at least 1, after a first round of max(1, H/10) steps, so "
        "every site delivers about as often.",
    )
    region_every: int = Field(
        default=0,
        ge=0,
        le=100_000,
        description="Multi-tier DiLoCo over topology.regions: sites average inside their region every H steps, and regions "
        "run the outer step together every region_every region rounds (H2 = region_every x H); 0 = one tier (every round "
        "across all sites).",
    )
    tier_outer: Literal["region", "world", "both"] = Field(
        default="region",
        description="Multi-tier: where the outer optimizer (sync.outer_lr, outer_momentum, nesterov) steps: 'region' (every "
        "H steps inside each region, with momentum per region; the world tier averages the regions' models), 'world' "
        "(regions average plainly every H steps; the outer step every region_every rounds across regions) or 'both' "
        "(HALoS-like); measured in docs/PACE.md.",
    )
    adapt: AdaptConfig | None = Field(
        default=None,
        description="Adaptation to the measured network: H (within H_min..H_max), the codec and (streaming) the fragment "
        "count chosen after every round from the measured link to hold a target utilisation (unset: fixed H and codec; "
        "set e.g. sync.adapt={} for the defaults).",
    )
    quorum: QuorumConfig | None = Field(
        default=None,
        description="Asynchronous quorum rounds (DiLoCo, or each of Streaming DiLoCo's fragments): merge when quorum.sites "
        "sites have delivered, plus quorum.grace_s; late updates are merged later with a staleness discount and no site "
        "waits for the slowest one; with sync.region_every a syncer per region and world rounds among them; a final "
        "synchronous round leaves every site bit-identical; with elastic.enabled no syncer: elastic rounds of the first "
        "quorum.sites sites to ask (more than half), a late site's update counted in its next round (unset: lock-step rounds).",
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
    codec: CodecConfig = Field(
        default_factory=lambda: CodecConfig(name="none"),
        description="Encoding of what crosses sites (DiLoCo/streaming pseudo-gradients, DDP gradients; in-site traffic "
        "stays fp32): a codec's name (sync.codec=int8) or the section {name: topk, fraction: 0.02, ...} (sync.codec.*).",
    )
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

    @model_validator(mode="after")
    def _cross_field(self) -> SyncConfig:
        if self.outer_sgd[2] and self.outer_sgd[1] == 0:
            raise ValueError("nesterov needs outer_momentum > 0 (set sync.nesterov=false for plain SGD)")
        if self.adapt is not None:
            a = self.adapt
            first = self.H * max(1, self.region_every)  # (tiers: adaptation chooses the world tier's period)
            if not a.H_min <= first <= a.H_max:
                what = f"H x region_every = {first}" if self.region_every else f"{self.H}"
                raise ValueError(
                    f"H: the first round's H must lie in sync.adapt's H_min..H_max ({a.H_min}..{a.H_max}; got {what})"
                )
            if self.codec.name not in a.codecs:
                raise ValueError(
                    f"codec: adaptation chooses among fixed-width codecs by their bits per value, and starts from one of "
                    f"sync.adapt.codecs ({', '.join(a.codecs)}; got {self.codec.name}): a sparse codec's size depends on its "
                    "density and its error feedback would be lost at every switch"
                )
            if self.codec.error_feedback:
                raise ValueError("codec.error_feedback: adaptation switches codecs between rounds; leave it unset")
            for name, value in (("fragments", a.fragments), ("hold", a.hold)):
                if self.algorithm != "streaming" and value is not None:
                    raise ValueError(f"adapt.{name}: Streaming DiLoCo only (sync.algorithm=streaming); leave it unset")
            if self.algorithm == "streaming":
                if self.eager:
                    raise ValueError(
                        "eager: the eager step owes each fragment the rest of its last round's average, and adaptation "
                        "rebuilds the fragments when it changes H or their count, leaving those debts on fragments that "
                        "are gone; set sync.eager=false"
                    )
                if a.fragments is not None and self.fragments not in a.fragments:
                    raise ValueError(
                        f"fragments: the first fragment count must be one of sync.adapt.fragments "
                        f"({', '.join(map(str, a.fragments))}; got {self.fragments})"
                    )
                if a.H_min <= self.tau:
                    raise ValueError(
                        f"adapt.H_min: must exceed tau={self.tau}, a fragment merges before it syncs again (got {a.H_min})"
                    )
        if self.algorithm == "streaming" and not self.eager and self.tau >= self.H:
            raise ValueError(f"tau: must be below H={self.H}, a fragment merges before it syncs again (got {self.tau})")
        return self

    @property
    def dynamic_quorum_steps(self) -> bool:
        """Asynchronous quorum rounds whose sites run steps by their measured rates: pace=adaptive
        (what adaptive pace means when no site waits for another)."""
        return self.quorum is not None and self.pace == "adaptive"

    @property
    def outer_sgd(self) -> tuple[float, float, bool]:
        """(lr, momentum, nesterov) of the outer SGD, unset ones from the defaults: DiLoCo's 0.7, 0.9,
        Nesterov, or SparseLoCo's 1, 0, plain (with its published variant)."""
        lr, momentum, nesterov = (1.0, 0.0, False) if self.codec.published_sparseloco else (0.7, 0.9, True)
        if self.outer_momentum == 0 and self.nesterov is None:
            nesterov = False
        return (
            lr if self.outer_lr is None else self.outer_lr,
            momentum if self.outer_momentum is None else self.outer_momentum,
            nesterov if self.nesterov is None else self.nesterov,
        )
