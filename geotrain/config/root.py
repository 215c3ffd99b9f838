"""The whole training config: every section, and the checks that span sections."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field, model_validator

from geotrain.config.base import Section
from geotrain.config.privacy import PrivacyConfig, sparse_degree
from geotrain.config.resilience import MOVED_KEYS, ElasticConfig, FaultConfig, GuardConfig, LivenessConfig
from geotrain.config.sync import MOVED_CODEC_KEYS, SyncConfig
from geotrain.config.topology import TopologyConfig
from geotrain.config.training import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ReportConfig,
    RunConfig,
    TrainConfig,
)

WORLD_JOIN_S = 1.0  # elastic quorum rounds of two tiers: the least the Lighthouse waits for the sites not asking yet


def _refuse(refused: list[tuple[bool, str, str]]) -> None:
    """Raise, in one line, for the first ``(bad, field, why)`` that is bad: ``field: why``. Every
    refusal here has a reason of mathematics or physics (docs/COMPOSE.md lists them)."""
    for bad, field, why in refused:
        if bad:
            raise ValueError(f"{field}: {why}")


class Config(Section):
    """A whole training run: one field per section (each documented in docs/CONFIG.md)."""

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
    liveness: LivenessConfig = Field(
        default_factory=LivenessConfig, description="Failure detection and the bound of every wait, for every kind of run."
    )
    report: ReportConfig = Field(default_factory=ReportConfig, description="The HTML report and an experiment tracker.")
    moved_keys: ClassVar[dict[str, str]] = {**MOVED_KEYS, **MOVED_CODEC_KEYS}

    @model_validator(mode="after")
    def _privacy_fits(self) -> Config:
        p, n = self.privacy, len(self.topology.sites)
        if p.threshold is not None and p.threshold > n:
            raise ValueError(f"privacy.threshold: {p.threshold} is larger than the number of sites ({n})")
        if p.secure_aggregation and self.sync.algorithm == "ddp":
            raise ValueError("privacy.secure_aggregation: works on pseudo-gradients; use sync.algorithm=diloco or streaming")
        if p.dp.unit == "site" and self.sync.algorithm == "ddp":
            raise ValueError("privacy.dp.unit: 'site' protects pseudo-gradients; use sync.algorithm=diloco or streaming")
        if p.secure_aggregation and self.sync.codec.name != "none":
            raise ValueError(
                "sync.codec: secure aggregation sums updates masked uniformly over 2^32, and a masked value carries no "
                "structure a codec could compress (a codec before masking would need the unmasked update); set sync.codec=none"
            )
        if p.dp.unit == "site" and self.sync.codec.name != "none":
            raise ValueError(
                "sync.codec: site-level DP's accountant counts one noised release of each site's update per round, and a "
                "codec's error feedback adds what the last round's encoding left out to this one's, so each release "
                "mixes two rounds' updates; set sync.codec=none"
            )
        if (p.secure_aggregation or p.dp.unit == "site") and self.sync.eager:
            raise ValueError("sync.eager: the eager variant uses each site's own share of the average; not with privacy")
        if p.secure_aggregation and p.threshold is not None and p.graph == "sparse":
            k = sparse_degree(n)
            if p.threshold > k + 1:
                raise ValueError(
                    f"privacy.threshold: {p.threshold} is more than a site and its {k} neighbours can hold (graph=sparse)"
                )
        if p.dp.unit == "example" and (self.train.grad_accum > 1 or self.model.activation_checkpointing or self.train.compile):
            what = (
                "train.grad_accum"
                if self.train.grad_accum > 1
                else "model.activation_checkpointing"
                if self.model.activation_checkpointing
                else "train.compile"
            )
            raise ValueError(
                f"{what}: privacy.dp.unit=example clips each example's gradient, which its hooks read from one eager "
                "micro-batch's activations per step (accumulated, recomputed or compiled ones hide them); turn it off"
            )
        c = self.checkpoint
        if c.resume not in (None, "auto") and self.run.baseline not in ("none", self.sync.algorithm):
            raise ValueError("checkpoint.resume: a checkpoint path resumes one run; set run.baseline=none (or resume=auto)")
        if (c.every or c.resume) and self.sync.eager:
            raise ValueError(
                "checkpoint.every: the eager variant's sites each hold a global model of their own until the run's end, "
                "so no one state is the run's to resume; set checkpoint.every=0 (or sync.eager=false)"
            )
        names = [s.name for s in self.topology.sites]
        for (site, _), _kind in p.injections().items():
            if site not in names:
                raise ValueError(f"privacy.inject: unknown site {site!r} (sites: {', '.join(names)})")
        for site, _ in self.fault.nan_at():
            if site not in names:
                raise ValueError(f"fault.nan: unknown site {site!r} (sites: {', '.join(names)})")
        for site, _, kind in self.fault.site_faults():
            if site not in names:
                raise ValueError(f"fault.{kind}: unknown site {site!r} (sites: {', '.join(names)})")
            if kind == "kill" and self.sync.quorum is not None and not self.elastic.enabled:  # a site lost for good
                hubs = self.quorum_hubs()
                if site in hubs:
                    others = ", ".join(n for n in names if n not in hubs) or "none"
                    raise ValueError(f"fault.kill: site {site} holds a quorum syncer; kill another site (allowed: {others})")
            elif not self.elastic.enabled:
                raise ValueError(
                    f"fault.{kind}: failing a site this way needs elastic.enabled=true"
                    + (" (or sync.quorum, for fault.kill)" if kind == "kill" else "")
                )
        self._elastic_fits(len(names))
        self._fsdp_fits()
        self._unequal_fits()
        self._pace_fits()
        self._tiers_fit()
        self._adapt_fits()
        self._quorum_fits(len(names))
        self._exchange_fits()
        return self

    def _exchange_fits(self) -> None:
        """topology.exchange: a tree or a hub sums fp32 over a fixed set of sites (docs/PLACE.md)."""
        x = self.topology.exchange
        if (x.shape != "ring" or x.region_shape != "ring") and (refused := self.ring_only()):
            field, why = refused
            raise ValueError(f"{field}: not with topology.exchange.shape={x.shape}, region_shape={x.region_shape}: {why}")

    def ring_only(self, codec: str | None = None) -> tuple[str, str] | None:
        """(field, why) of the first setting that allows no tree or hub across sites, only a ring in
        exchange.order (None: any shape runs). ``codec``: judge this codec instead of sync.codec
        (geotrain place chooses its own)."""
        s = self.sync
        refused = [
            (
                self.elastic.enabled,
                "elastic.enabled",
                "an elastic round's sites change round by round, and a tree's root or a "
                "hub is one site whose loss fails every round; elastic rounds run a ring in exchange.order (use shape ring)",
            ),
            (
                (s.codec.name if codec is None else codec) != "none",
                "sync.codec",
                "an encoded sum already goes one hop (each site's payload to every other); a "
                "tree or hub would decode and re-encode at every hop, adding its error again (use shape ring)",
            ),
            (
                s.adapt is not None,
                "sync.adapt",
                "adaptation inverts the ring's time formula on the measured link (use shape ring)",
            ),
            (s.allreduce == "flat", "sync.allreduce", "the flat all-reduce is one ring over every rank (use hierarchical)"),
            (
                self.privacy.secure_aggregation,
                "privacy.secure_aggregation",
                "its protocol sends masked shares between every "
                "two sites (one hop each, as an encoded sum does); it has no tree or hub (use shape ring)",
            ),
        ]
        return next(((field, why) for bad, field, why in refused if bad), None)

    def _tiers_fit(self) -> None:
        """sync.region_every: rounds in two tiers (region rounds, rarer world rounds)."""
        if not self.sync.region_every:
            return
        if len(self.topology.regions) < 2:
            raise ValueError("sync.region_every: needs at least two topology.regions (or set sync.region_every=0)")
        _refuse([
            (self.sync.algorithm == "ddp", "sync.algorithm",
             "DDP has no rounds to put in two tiers (allowed with sync.region_every: diloco, streaming)"),
            (self.sync.eager, "sync.eager",
             "the eager step applies this site's own share of the average at once, and a world round averages the "
             "regions' models, in which no site has a share of its own; set sync.eager=false"),
            (self.sync.codec.name == "powersgd", "sync.codec",
             "PowerSGD's low-rank factors are one sum over every site's matrices, and a region round sums a region's "
             "only; use a byte codec or none"),
            (self.privacy.dp.unit == "site", "privacy.dp.unit",
             "site-level DP releases each update once per round, and in two tiers a site's update is released in its "
             "region round and again, inside the region's model, in the world round; use none or example"),
        ])  # fmt: skip
        if self.privacy.secure_aggregation:  # region rounds sum securely over each region's sites
            for region in self.topology.regions:
                k = len(region.sites)
                if k == 2:
                    raise ValueError(
                        f"privacy.secure_aggregation: region {region.name} has 2 sites, and a region round's sum of two "
                        "shows each the other's update; give every region 1 or at least 3 sites (or set sync.region_every=0)"
                    )
                t = self.privacy.threshold
                if k > 1 and t is not None and t > k:
                    raise ValueError(
                        f"privacy.threshold: {t} is more than region {region.name}'s {k} sites (region rounds aggregate "
                        f"securely among a region's sites; allowed: at most {k})"
                    )

    def _adapt_fits(self) -> None:
        """sync.adapt: H, the codec (and Streaming's fragment count) follow the measured network."""
        if self.sync.adapt is None:
            return
        _refuse([
            (self.sync.algorithm == "ddp", "sync.algorithm",
             "DDP exchanges every step and has no H to choose (allowed with sync.adapt: diloco, streaming)"),
            (self.privacy.dp.unit == "site", "privacy.dp.unit",
             "site-level DP calibrates its noise to the planned number of rounds, which adaptation changes; use none or example"),
        ])  # fmt: skip

    def _quorum_fits(self, n: int) -> None:
        """sync.quorum: asynchronous quorum rounds (a hub, or elastic rounds of k of n sites)."""
        q = self.sync.quorum
        if q is None:
            return
        if q.sites > n:
            raise ValueError(f"sync.quorum.sites: {q.sites} is more than the {n} sites in topology.sites (allowed: 1..{n})")
        p, hub = self.privacy, not self.elastic.enabled
        _refuse([
            (self.sync.algorithm == "ddp", "sync.algorithm",
             "quorum rounds merge the pseudo-gradients of rounds, and DDP has no rounds (allowed: diloco, streaming)"),
            (self.sync.codec.name == "powersgd", "sync.codec",
             "PowerSGD's low-rank factors are one sum over every site's matrices, and a quorum round merges whichever "
             "updates have arrived; use a byte codec (bf16, fp16, int8, fp4, int4, topk, sparseloco) or none"),
            (hub and p.secure_aggregation, "privacy.secure_aggregation",
             "a hub merges each site's update on its own, weighted by its staleness, and masked updates only cancel "
             "when summed together; use elastic quorum rounds (elastic.enabled=true) or turn it off"),
            (p.dp.unit == "site", "privacy.dp.unit",
             "site-level DP calibrates its noise to a plain average of every site's update, and quorum rounds weigh "
             "each update by its staleness; use none or example"),
            (self.sync.eager, "sync.eager",
             "the eager step applies this site's own share of a lock-step average at once, and a quorum round has no "
             "fixed set of sites to take a share of; set sync.eager=false"),
            (hub and self.topology.links.emulate == "kernel", "topology.links.emulate",
             "kernel shaping puts the sites in network namespaces of one torch.distributed world, and a hub's sites "
             "that come back join from a world of their own; use off or inprocess"),
        ])  # fmt: skip
        if self.elastic.enabled and q.sites <= n // 2:
            raise ValueError(
                f"sync.quorum.sites: elastic rounds need more than half of the sites ({n // 2 + 1} of {n}): two rounds of "
                f"disjoint sites would commit two models (allowed: {n // 2 + 1}..{n})"
            )
        if hub and self.sync.region_every and (self.checkpoint.every or self.checkpoint.resume):
            raise ValueError(
                "checkpoint.every: a checkpoint is one instant at which every site holds the state it resumes from; in two "
                "tiers each region's hub runs its sites asynchronously and the hubs meet only in world rounds, so no such "
                "instant exists short of stopping every region at once; set checkpoint.every=0 (or use elastic rounds in "
                "two tiers, whose sites each checkpoint their own state)"
            )
        if hub and self.checkpoint.every and self.fault.site_faults():
            raise ValueError(
                "checkpoint.every: a checkpoint is written by every rank of the run together, and a site killed in "
                "asynchronous rounds leaves the run's world for good; set checkpoint.every=0 or drop fault.kill"
            )

    def _pace_fits(self) -> None:
        """sync.pace=adaptive and train.max_seconds end rounds by measurement."""
        what = "sync.pace" if self.sync.pace != "lockstep" else "train.max_seconds" if self.train.max_seconds else None
        if what is None:
            return
        _refuse([
            (self.sync.algorithm == "ddp", "sync.algorithm",
             "DDP exchanges every step: it has no rounds to pace or to end on time (use diloco or streaming)"),
            (self.sync.eager, "sync.eager",
             "the eager step applies this site's share at once as 1/M of the average, and paced rounds weigh sites by "
             "their own steps; set sync.eager=false"),
            (self.elastic.enabled and bool(self.train.max_seconds) and self.sync.quorum is None, "train.max_seconds",
             "elastic sites are worlds of their own with clocks of their own, and a round holds only the sites that "
             "asked, so no one elapsed time reaches every site; end on train.steps (or use quorum rounds, each site "
             "on its own time)"),
            (self.privacy.dp.unit == "site", "privacy.dp.unit",
             "site-level DP's noise is calibrated to one update per site per round, and rounds of different lengths "
             "weigh sites differently; use none or example"),
        ])  # fmt: skip

    def _unequal_fits(self) -> None:
        """Sites of different sizes (docs/PACE.md says why these two stay refused)."""
        workers = [s.workers for s in self.topology.sites]
        if len(set(workers)) == 1:
            return
        _refuse([
            (self.privacy.dp.unit == "site", "privacy.dp.unit",
             f"site-level DP's noise is calibrated to one clipped update per site, and sites of different sizes "
             f"{workers} weigh by their tokens, which changes each site's sensitivity; use none or example"),
            (self.sync.eager, "sync.eager",
             f"the eager step applies this site's share as 1/M of the average, and sites of different sizes {workers} "
             "weigh by their tokens; set sync.eager=false"),
        ])  # fmt: skip

    def _fsdp_fits(self) -> None:
        """sync.within_site=fsdp: each site's model sharded over its workers (docs/SCALE.md)."""
        if self.sync.within_site != "fsdp":
            return
        if self.privacy.dp.unit == "example" and self.model.kind == "hf":
            raise ValueError(
                "privacy.dp.unit: example-level DP of a sharded model takes per-example norms of geotrain's GPT layers "
                "(Linear, Embedding, LayerNorm); set model.kind=gpt or sync.within_site=replicate"
            )
        _refuse([
            (self.sync.allreduce == "flat", "sync.allreduce",
             "FSDP shards inside a site and sums across sites shard by shard, which is the hierarchical all-reduce; "
             "use sync.allreduce=hierarchical"),
            (self.sync.eager, "sync.eager",
             "the eager step applies each site's own share of the whole pseudo-gradient at once, and under FSDP no "
             "rank holds a whole one; set sync.eager=false"),
        ])  # fmt: skip

    def _elastic_fits(self, n: int) -> None:
        e = self.elastic
        if not e.enabled:
            return
        if e.min_sites > n:
            raise ValueError(f"elastic.min_sites: {e.min_sites} is more than the number of sites ({n})")
        _refuse([
            (self.sync.algorithm == "ddp", "sync.algorithm",
             "elastic membership meets once per round, and DDP has no rounds, only steps (allowed: diloco, streaming)"),
            (self.sync.eager, "sync.eager",
             "the eager variant leaves each site on its own global model until the end, and an elastic round heals and "
             "commits one global model; set sync.eager=false in elastic mode"),
            (self.sync.codec.name == "powersgd", "sync.codec",
             "PowerSGD's factors are all-reduced over a fixed world; in elastic mode use a byte codec "
             "(bf16, fp16, int8, int4, fp4, topk, sparseloco) or none"),
            (bool(self.privacy.inject), "privacy.inject",
             "drops secure-aggregation rounds of plain mode; in elastic mode a site drops out for real "
             "(fault.kill or fault.hang)"),
            (self.checkpoint.resume not in (None, "auto"), "checkpoint.resume",
             "elastic sites resume from their own checkpoints; use auto (or none)"),
            (self.topology.links.emulate == "kernel", "topology.links.emulate",
             "elastic mode supports off or inprocess (each site is a world of its own, out of the kernel mode's namespaces)"),
        ])  # fmt: skip

    @property
    def lighthouse_join_s(self) -> float:
        """How long the Lighthouse waits for live sites that have not asked so far once a round has the
        sites it needs: elastic quorum rounds wait sync.quorum.grace_s; other elastic rounds wait 60 s
        (for every live site); '.inf', a day (a dead site stops beating, so it is not waited for). In
        two tiers at least WORLD_JOIN_S: a world round holds every site, and a quorum formed the
        instant k sites ask would never hold the last one (it asks a moment after the others)."""
        if self.sync.quorum is None or not self.elastic.enabled:
            return 60.0
        grace = min(self.sync.quorum.grace_s, 86_400.0)
        return max(grace, WORLD_JOIN_S) if self.sync.region_every else grace

    def quorum_hubs(self) -> list[str]:
        """The sites whose local rank 0 holds a quorum syncer: the first site, or in two tiers the
        first site of each region."""
        if self.sync.region_every and len(self.topology.regions) > 1:
            names = [s.name for s in self.topology.sites]
            return [min(r.sites, key=names.index) for r in self.topology.regions]
        return [self.topology.sites[0].name]

    @property
    def elastic_rounds(self) -> ElasticConfig:
        """The elastic section as the rounds use it: with secure aggregation a round needs 3 sites
        whatever ``elastic.min_sites`` says (a sum of two shows each site the other's update), so
        below 3 training pauses instead of every round rolling back."""
        least = 3 if self.privacy.secure_aggregation else 1
        if self.sync.quorum is not None:  # elastic quorum rounds: a round needs sync.quorum.sites sites
            least = max(least, self.sync.quorum.sites)
        if self.elastic.min_sites < least:
            return self.elastic.model_copy(update={"min_sites": least})
        return self.elastic

    def with_algorithm(self, algorithm: str) -> Config:
        """A copy of this config that trains with ``algorithm`` and no baseline. A DDP baseline is
        plain fp32 data parallelism over every rank (no codec, rounds, membership, faults or
        pseudo-gradient privacy: what the rounds are measured against); another round algorithm
        keeps every setting but the eager variant (Streaming DiLoCo's alone)."""
        data = self.model_dump()
        data["sync"]["algorithm"] = algorithm
        data["run"]["baseline"] = "none"
        if algorithm == "ddp":
            data["sync"].update(pace="lockstep", region_every=0, quorum=None, adapt=None, codec="none", eager=False)
            data["train"]["max_seconds"] = 0
            data["elastic"]["enabled"] = False
            data["fault"].update(kill=[], hang=[], tamper=[], split=[], migrate=[], nan=[])  # (each needs rounds)
            data["privacy"]["secure_aggregation"] = False
            data["privacy"]["inject"] = []
            if data["privacy"]["dp"]["unit"] == "site":
                data["privacy"]["dp"]["unit"] = "none"
            if data["topology"]["exchange"]["shape"] != "ring" or data["topology"]["exchange"]["region_shape"] != "ring":
                data["topology"]["exchange"].update(shape="ring", region_shape="ring")
        elif algorithm != "streaming":
            data["sync"]["eager"] = False
        if data["checkpoint"]["dir"] is not None and self.run.baseline not in ("none", self.sync.algorithm):
            data["checkpoint"]["dir"] = str(Path(data["checkpoint"]["dir"]) / algorithm)  # one directory per run
        return Config.model_validate(data)

    @property
    def eval_every(self) -> int:
        if self.train.eval_every:
            return self.train.eval_every
        return self.sync.H if self.sync.algorithm != "ddp" else 25

    @model_validator(mode="after")
    def _secure_aggregation_sites(self) -> Config:
        """Checked after every other rule, which name the setting that conflicts more precisely."""
        n = len(self.topology.sites)
        if self.privacy.secure_aggregation and n < 3:
            raise ValueError(
                f"privacy.secure_aggregation: needs at least 3 sites, not {n} (with two, each site learns the other's "
                "update from the sum)"
            )
        return self
