"""The whole training config: every section, and the checks that span sections."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from geotrain.config.base import Section
from geotrain.config.privacy import PrivacyConfig, sparse_degree
from geotrain.config.resilience import ElasticConfig, FaultConfig, GuardConfig
from geotrain.config.sync import SyncConfig
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


def _refuse(refused: list[tuple[bool, str, str]], combined: str, suffix: str = "") -> None:
    """Raise, in one line, for the first ``(bad, field, fix)`` that is bad: FIELD is not combined with ``combined`` yet."""
    for bad, field, fix in refused:
        if bad:
            raise ValueError(f"{field}: not combined with {combined} yet; {fix}{suffix}")


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
    report: ReportConfig = Field(default_factory=ReportConfig, description="The HTML report and an experiment tracker.")

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
                f"{what}: not with privacy.dp.unit=example (its per-example gradient hooks need one eager micro-batch per step)"
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
                (s.codec if codec is None else codec) != "none",
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
        """sync.region_every: multi-tier DiLoCo, with what it is not combined with yet."""
        if not self.sync.region_every:
            return
        if len(self.topology.regions) < 2:
            raise ValueError("sync.region_every: needs at least two topology.regions (or set sync.region_every=0)")
        streaming = self.sync.algorithm == "streaming"  # each fragment's syncs in two tiers
        refused = [
            (self.sync.algorithm not in ("diloco", "streaming"), "sync.algorithm", "use sync.algorithm=diloco or streaming"),
            (streaming and self.sync.eager, "sync.eager", "set sync.eager=false"),
            (streaming and self.sync.pace != "lockstep", "sync.pace", "use sync.pace=lockstep with Streaming DiLoCo"),
            (streaming and bool(self.train.max_seconds), "train.max_seconds", "set train.max_seconds=0 with Streaming DiLoCo"),
            (streaming and self.sync.adapt is not None, "sync.adapt", "leave sync.adapt unset with Streaming DiLoCo"),
            (self.sync.codec == "powersgd", "sync.codec", "use a byte codec or none"),
            (self.privacy.dp.unit == "site", "privacy.dp.unit", "use none or example"),
        ]
        _refuse(refused, "sync.region_every")
        e = self.elastic.enabled  # elastic rounds in two tiers (sync/tiers_elastic.py): DiLoCo's lock-step rounds
        elastic = [
            (e and streaming, "sync.algorithm", "use sync.algorithm=diloco"),
            (e and self.sync.pace != "lockstep", "sync.pace", "use sync.pace=lockstep"),
            (e and self.sync.adapt is not None, "sync.adapt", "leave sync.adapt unset"),
        ]
        _refuse(elastic, "elastic.enabled and sync.region_every together")
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
        """sync.adapt: lock-step rounds of DiLoCo or Streaming DiLoCo; what it is not combined with yet (docs/HETERO.md)."""
        if self.sync.adapt is None:
            return
        p = self.privacy
        refused = [
            (self.sync.algorithm == "ddp", "sync.algorithm", "use sync.algorithm=diloco or streaming"),
            (bool(self.train.max_seconds), "train.max_seconds", "set train.max_seconds=0 (adaptation plans rounds by steps)"),
            (
                self.sync.pace != "lockstep" and self.sync.algorithm == "streaming",
                "sync.pace",
                "use sync.pace=lockstep",
            ),
            (
                self.elastic.enabled and (self.sync.algorithm == "streaming" or self.sync.pace != "lockstep"),
                "elastic.enabled",
                "set elastic.enabled=false, or adapt DiLoCo's lock-step rounds (elastic Streaming DiLoCo syncs fragments "
                "at fixed steps; elastic adaptive pace budgets rounds from claimed rates)",
            ),
            (
                p.dp.unit == "site",
                "privacy.dp.unit",
                "use none or example (site-level DP calibrates its noise to the planned rounds, which adaptation changes)",
            ),
            (
                self.sync.algorithm == "streaming" and bool(self.checkpoint.every or self.checkpoint.resume),
                "checkpoint.every",
                "set checkpoint.every=0 and resume=none (Streaming DiLoCo's adapted fragments are not checkpointed)",
            ),
        ]
        _refuse(refused, "sync.adapt")

    def _quorum_fits(self, n: int) -> None:
        """sync.quorum: asynchronous rounds of plain DiLoCo; what it is not combined with yet (docs/HETERO.md)."""
        q = self.sync.quorum
        if q is None:
            return
        if q.sites > n:
            raise ValueError(f"sync.quorum.sites: {q.sites} is more than the {n} sites in topology.sites (allowed: 1..{n})")
        p = self.privacy
        if self.sync.algorithm == "ddp":
            raise ValueError(
                "sync.algorithm: quorum rounds merge the pseudo-gradients of rounds, and DDP has no rounds "
                "(allowed: diloco, streaming)"
            )
        refused = [
            (
                self.sync.codec == "powersgd",
                "sync.codec",
                "use a byte codec (bf16, fp16, int8, fp4, int4, topk, sparseloco) or none",
            ),
            (p.secure_aggregation or p.dp.unit == "site", "privacy", "turn privacy off"),
            (self.topology.links.emulate == "kernel", "topology.links.emulate", "use off or inprocess"),
        ]
        _refuse(refused, "sync.quorum")
        if self.elastic.enabled:  # quorum rounds as elastic rounds (sync/quorum_elastic.py)
            self._elastic_quorum_fits(n)
            return
        if self.sync.algorithm == "streaming":  # each fragment's sync a delivery (sync/quorum_streaming.py)
            s = self.sync
            streaming = [
                (
                    s.eager,
                    "sync.eager",
                    "set sync.eager=false (its step applies this site's share at once, as 1/M of the average)",
                ),
                (bool(s.region_every), "sync.region_every", "set sync.region_every=0"),
                (
                    s.dynamic_quorum_steps,
                    "sync.pace" if s.pace != "lockstep" else "sync.quorum.local_steps",
                    "use fixed local steps at lock-step pace (the fragments' schedule is H)",
                ),
                (s.adapt is not None, "sync.adapt", "leave sync.adapt unset"),
                (s.within_site == "fsdp", "sync.within_site", "use sync.within_site=replicate"),
                (bool(self.checkpoint.every or self.checkpoint.resume), "checkpoint.every", "set checkpoint.every=0"),
            ]
            _refuse(streaming, "Streaming DiLoCo in asynchronous quorum rounds")
        if self.sync.region_every:  # a syncer per region, world rounds among them (sync/quorum_world.py)
            tiers = [
                (
                    bool(self.checkpoint.every or self.checkpoint.resume),
                    "checkpoint.every",
                    "set checkpoint.every=0 and resume=none (a checkpoint's barrier round would need every region's at once)",
                ),
                (self.sync.adapt is not None, "sync.adapt", "leave sync.adapt unset (each region's syncer would choose alone)"),
            ]
            _refuse(tiers, "sync.quorum in two tiers (sync.region_every)")
        if self.checkpoint.every and self.sync.dynamic_quorum_steps:
            raise ValueError(
                "checkpoint.every: a checkpoint of asynchronous rounds is taken at a round every site ends at the same "
                "step, and dynamic local steps (or sync.pace=adaptive) give each site its own; use fixed local steps or checkpoint.every=0"
            )
        if self.checkpoint.every and self.fault.site_faults():
            raise ValueError(
                "checkpoint.every: a checkpoint is written by every rank of the run together, and a site killed in "
                "asynchronous rounds leaves the run's world for good; set checkpoint.every=0 or drop fault.kill"
            )

    def _pace_fits(self) -> None:
        """sync.pace=adaptive and train.max_seconds end rounds by measurement: DiLoCo's rounds and Streaming DiLoCo's
        slots (one fragment's sync each)."""
        what = "sync.pace" if self.sync.pace != "lockstep" else "train.max_seconds" if self.train.max_seconds else None
        if what is None:
            return
        p = self.privacy
        streaming = self.sync.algorithm == "streaming"  # each fragment's sync ends a slot of the clock
        refused = [
            (self.sync.algorithm not in ("diloco", "streaming"), "sync.algorithm", "use sync.algorithm=diloco or streaming"),
            (
                streaming and self.elastic.enabled,
                "elastic.enabled",
                "set elastic.enabled=false (elastic Streaming DiLoCo syncs fragments at fixed steps, and ends on them)",
            ),
            (
                streaming and self.sync.eager,
                "sync.eager",
                "set sync.eager=false (its step applies this site's share at once, as 1/M of the average)",
            ),
            (
                self.elastic.enabled and bool(self.train.max_seconds) and self.sync.quorum is None,
                "elastic.enabled",
                "set train.max_seconds=0 (elastic sites end on their steps or, with sync.pace=adaptive, on rounds; "
                "in quorum rounds each on its own time)",
            ),
            (
                p.dp.unit == "site",
                "privacy.dp.unit",
                "use none or example (site-level DP's noise is calibrated to one update per site per round, "
                "and rounds of different lengths weigh sites differently)",
            ),
        ]
        _refuse(refused, what)

    def _unequal_fits(self) -> None:
        """What sites of different sizes are not combined with yet (docs/HETERO.md says why)."""
        workers = [s.workers for s in self.topology.sites]
        if len(set(workers)) == 1:
            return
        p = self.privacy
        refused = [
            (p.dp.unit == "site", "privacy.dp.unit", "set privacy.dp.unit=none or example"),
            (self.sync.eager, "sync.eager", "set sync.eager=false"),
        ]
        _refuse(refused, f"sites of different sizes {workers}")
        if self.sync.within_site == "fsdp":  # each site's pseudo-gradient is gathered whole in DiLoCo's rounds
            fsdp = [
                (self.sync.algorithm != "diloco", "sync.algorithm", "use sync.algorithm=diloco"),
                (self.elastic.enabled, "elastic.enabled", "set elastic.enabled=false"),
                (bool(self.sync.region_every), "sync.region_every", "set sync.region_every=0"),
                (p.secure_aggregation, "privacy.secure_aggregation", "set privacy.secure_aggregation=false"),
            ]
            _refuse(fsdp, f"sync.within_site=fsdp over sites of different sizes {workers}")

    def _fsdp_fits(self) -> None:
        """What sync.within_site=fsdp is not combined with yet (docs/DESIGN.md §23 says why)."""
        if self.sync.within_site != "fsdp":
            return
        p = self.privacy
        if p.dp.unit == "example" and self.model.kind == "hf":
            raise ValueError(
                "privacy.dp.unit: example-level DP of a sharded model takes per-example norms of geotrain's GPT layers "
                "(Linear, Embedding, LayerNorm); set model.kind=gpt or sync.within_site=replicate"
            )
        refused = [
            (self.sync.allreduce == "flat", "sync.allreduce", "use sync.allreduce=hierarchical"),
            (self.sync.eager, "sync.eager", "set sync.eager=false"),
        ]
        _refuse(refused, "sync.within_site=fsdp", " (or sync.within_site=replicate)")

    def _elastic_fits(self, n: int) -> None:
        e = self.elastic
        if not e.enabled:
            return
        if e.min_sites > n:
            raise ValueError(f"elastic.min_sites: {e.min_sites} is more than the number of sites ({n})")
        if self.sync.algorithm not in ("diloco", "streaming"):
            raise ValueError("sync.algorithm: elastic mode runs diloco or streaming (allowed: diloco, streaming)")
        if self.sync.eager:
            raise ValueError(
                "sync.eager: the eager variant leaves each site on its own global model until the end, and an elastic "
                "round heals and commits one global model; set sync.eager=false in elastic mode"
            )
        if self.sync.codec == "powersgd":
            raise ValueError(
                "sync.codec: PowerSGD's factors are all-reduced over a fixed world; in elastic mode use a byte codec "
                "(bf16, fp16, int8, int4, fp4, topk, sparseloco) or none"
            )
        if self.privacy.inject:
            raise ValueError(
                "privacy.inject: drops secure-aggregation rounds of plain mode; in elastic mode a site drops out "
                "for real (fault.kill or fault.hang)"
            )
        if self.checkpoint.resume not in (None, "auto"):
            raise ValueError("checkpoint.resume: elastic sites resume from their own checkpoints; use auto (or none)")
        if self.topology.links.emulate == "kernel":
            raise ValueError("topology.links.emulate: elastic mode supports off or inprocess")

    def _elastic_quorum_fits(self, n: int) -> None:
        """Quorum rounds in elastic mode: the Lighthouse forms a round once sync.quorum.sites sites have
        asked (docs/COMPOSE.md); what it is not combined with yet."""
        q, s = self.sync.quorum, self.sync
        assert q is not None
        if q.sites <= n // 2:
            raise ValueError(
                f"sync.quorum.sites: elastic rounds need more than half of the sites ({n // 2 + 1} of {n}): two rounds of "
                f"disjoint sites would commit two models (allowed: {n // 2 + 1}..{n})"
            )
        refused = [
            (s.algorithm == "streaming", "sync.algorithm", "use sync.algorithm=diloco"),
            (bool(s.region_every), "sync.region_every", "set sync.region_every=0"),
            (s.dynamic_quorum_steps, "sync.pace" if s.pace != "lockstep" else "sync.quorum.local_steps", "use fixed local steps"),
            (s.adapt is not None, "sync.adapt", "leave sync.adapt unset"),
            (bool(self.checkpoint.every), "checkpoint.every", "set checkpoint.every=0"),
        ]
        _refuse(refused, "elastic quorum rounds")

    @property
    def lighthouse_join_s(self) -> float:
        """How long the Lighthouse waits for live sites that have not asked yet once a round has the
        sites it needs: elastic quorum rounds wait sync.quorum.grace_s; other elastic rounds wait 60 s
        (for every live site); '.inf', a day (a dead site stops beating, so it is not waited for)."""
        return min(self.sync.quorum.grace_s, 86_400.0) if self.sync.quorum is not None and self.elastic.enabled else 60.0

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
        """A copy of this config that trains with ``algorithm`` and no baseline."""
        data = self.model_dump()
        data["sync"]["algorithm"] = algorithm
        data["run"]["baseline"] = "none"
        if algorithm != "diloco":  # time limits, tiers and quorums are DiLoCo's; adaptive pace DiLoCo's and Streaming's
            if algorithm == "ddp" or self.elastic.enabled or self.sync.eager or self.sync.adapt is not None:
                data["sync"]["pace"], data["train"]["max_seconds"] = "lockstep", 0
            if algorithm == "ddp" or data["sync"]["pace"] != "lockstep" or data["train"]["max_seconds"] or self.sync.eager:
                data["sync"]["region_every"] = 0  # (Streaming DiLoCo's tiers run lock-step slots)
            data["sync"]["quorum"] = None
        if algorithm == "ddp" or (algorithm == "streaming" and self.elastic.enabled):  # (elastic: DiLoCo's rounds only)
            data["sync"]["adapt"] = None
            if len({s.workers for s in self.topology.sites}) > 1:  # (HSDP sums shards rank by rank: one layout)
                data["sync"]["within_site"] = "replicate"
        if algorithm == "ddp" or (algorithm == "streaming" and self.sync.eager):  # no elastic rounds: it runs plain
            data["elastic"]["enabled"] = False
            data["fault"].update(kill=[], hang=[], tamper=[], split=[], migrate=[])  # (each needs elastic rounds)
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
