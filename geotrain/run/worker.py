"""The per-rank training entry point and composition root: the same code under geotrain's
launcher and torchrun.

Run as ``python -m geotrain.run.worker --config FILE [--set K=V ...] --out DIR`` with the usual
torch.distributed environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT). The rank's site comes from the topology (ranks are numbered site by site).

:func:`train` builds each part once, from that part's own config section — communication,
model, data, optimizer, privacy, sync, checkpoints, elastic membership, metrics — and then runs
the plain loop of :mod:`geotrain.run.loop`. Global rank 0 writes ``OUT/summary.json``
(schema: docs/SUMMARY.md).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from geotrain.comm.collectives import Collectives
from geotrain.comm.emulate import describe_links, link_mode
from geotrain.comm.faults import FaultPlan
from geotrain.comm.procs import die_with_parent, leave, rank_threads
from geotrain.comm.session import close_collectives, open_collectives
from geotrain.comm.topology import RankInfo, Topology
from geotrain.config import Config, load_config
from geotrain.data import build_rank_data, tokenizer_file, vocab_size
from geotrain.elastic.auth import optional_secret
from geotrain.errors import (
    DRAINED_EXIT,
    CheckpointError,
    ConfigError,
    ElasticTimeout,
    LaunchError,
    MembershipRefused,
    SiteDrained,
    SyncerTimeout,
)
from geotrain.models import build_model, count_params, export_model
from geotrain.privacy.build import build_privacy, keys_dir
from geotrain.privacy.masking import PairMasks
from geotrain.report.metrics import MetricsSink, log, write_timeline
from geotrain.report.summary import flops_per_token, rank_record, run_summary
from geotrain.report.trackers import open_tracker
from geotrain.round import RoundEngine, build_round
from geotrain.round.hub import Rejoin
from geotrain.round.schedule import fragment_count
from geotrain.run import checkpoint as ckpt
from geotrain.run.elastic_site import join_elastic, request_fault
from geotrain.run.fsdp import copy_on, shard_model
from geotrain.run.loop import Evaluator, StepWindow, load_parameters, train_loop
from geotrain.run.optim import build_optimizer
from geotrain.run.state import RankObjects, check_same_start
from geotrain.sync import UpdateGuard

ELASTIC_ENV = ("GEOTRAIN_SITE_INDEX", "GEOTRAIN_INCARNATION")


def elastic_env(full: Topology) -> tuple[int, int]:
    """This process's site index and incarnation in elastic mode, from the environment that
    ``geotrain site`` (or geotrain's local launcher) sets; documented in docs/ELASTIC.md.

    Raises:
        ConfigError: a variable is missing or out of range (every site claiming to be the first
            would silently break the run).
    """
    values = []
    for name, high in zip(ELASTIC_ENV, (full.num_sites - 1, 1_000_000), strict=True):
        raw = os.environ.get(name)
        if raw is None or not raw.strip().isdigit() or int(raw) > high:
            raise ConfigError(
                f"{name}: elastic mode needs it set to 0..{high} (got {raw!r}); start each site with "
                "`geotrain site --config FILE --site NAME --lighthouse HOST:PORT`"
            )
        values.append(int(raw))
    return values[0], values[1]


@dataclass(frozen=True)
class Placement:
    """Where this process is in the run.

    Plain mode: the whole run is one torch.distributed world. Elastic mode: this process's world
    is its own site (``GEOTRAIN_SITE_INDEX``; ``GEOTRAIN_INCARNATION`` > 0 for a restarted site),
    and sites meet once per round through :mod:`geotrain.elastic`. A site of asynchronous quorum
    rounds that the launcher started again after it was lost (``GEOTRAIN_REJOIN=1``, with the same
    two variables) is its own world too, and talks to the syncer through the run's store.
    """

    full: Topology  # every site of the run
    world: Topology  # the ranks of this process's torch.distributed world
    elastic: bool
    site_index: int = 0
    incarnation: int = 0
    rejoined: bool = False  # a quorum-rounds site that came back

    @classmethod
    def from_env(cls, cfg: Config) -> Placement:
        full = Topology.from_config(cfg.topology)
        rejoined = cfg.sync.quorum is not None and not cfg.elastic.enabled and os.environ.get("GEOTRAIN_REJOIN") == "1"
        if not cfg.elastic.enabled and not rejoined:
            return cls(full, full, False)
        site, incarnation = elastic_env(full)
        one = dataclasses.replace(
            full, site_names=(full.site_names[site],), workers=(full.workers[site],), pair_links=(), region_of=(), region_names=()
        )
        return cls(full, one, cfg.elastic.enabled, site, incarnation, rejoined)

    @property
    def own_world(self) -> bool:
        """This process's world is its site alone (elastic mode, or a site that came back)."""
        return self.elastic or self.rejoined

    def where(self, me: RankInfo) -> RankInfo:
        """This rank's place in the whole run (``me``: its place in its own world)."""
        return self.full.info(self.full.first_rank(self.site_index) + me.local_rank) if self.own_world else me


def quorum_kill(cfg: Config, out: Path, where: RankInfo, done: int = 0) -> Callable[[int], None] | None:
    """``fault.kill`` with asynchronous quorum rounds: at the step, this site asks the launcher to
    SIGKILL every process of it (:func:`request_fault`, in ``OUT/faults``). A site started again
    skips its first ``done`` kills (``GEOTRAIN_KILLS_DONE``, set by the launcher): they happened to
    its predecessors (a site that came back goes on from its last delivered round, before the step
    it was killed at). A death from outside is not one of them."""
    kills = sorted(step for site, step in cfg.fault.at("kill") if site == where.site)
    steps = set(kills[done:])
    if not steps:
        return None

    def inject(step: int) -> None:
        if step in steps:
            request_fault(out / "faults", where, "kill", step, timeout_s=60.0)

    return inject


def train(cfg: Config, out: Path) -> dict[str, Any] | None:
    """Train this rank; returns the run summary on global rank 0, None elsewhere."""
    place = Placement.from_env(cfg)
    threads = rank_threads(cfg.train.threads)
    torch.set_num_threads(threads)
    mode, notice = link_mode(cfg.topology.links.emulate)
    comm = open_collectives(
        place.world,
        backend=cfg.run.backend,
        timeout_s=cfg.liveness.group_timeout_s,
        lanes=cfg.sync.lanes,
        chunk_bytes=cfg.sync.chunk_bytes,
        emulate=mode,
        run_key=os.environ.get("GEOTRAIN_WAN_KEY") or None,  # elastic, rejoined: one key for all sites (else MASTER_PORT)
        links=place.full,
        site_index=place.site_index if place.own_world else None,
        site_mesh=cfg.sync.within_site == "fsdp",
    )
    me = comm.groups.me
    out.mkdir(parents=True, exist_ok=True)
    if notice and me.rank == 0:
        log(me, 0, notice)
    # Every part that holds a file, a thread or a peer is closed on every path, in the reverse
    # order of its making, whatever fails: the metrics are flushed and the audit log gets its
    # closing line after a failure too (it says the run failed, and why).
    with contextlib.ExitStack() as closing:
        # the launcher of an elastic run removes its shared link state; a plain run's rank 0 does
        closing.callback(close_collectives, comm, unlink_links=me.rank == 0 and not place.own_world)
        return _train(cfg, out, place, comm, threads, closing)


def _train(
    cfg: Config, out: Path, place: Placement, comm: Collectives, threads: int, closing: contextlib.ExitStack
) -> dict[str, Any] | None:
    """:func:`train` once communication is open; everything that must be closed goes on ``closing``."""
    groups = comm.groups
    me, where = groups.me, place.where(groups.me)
    torch.manual_seed(cfg.train.seed)  # identical initial model on every rank
    model = build_model(cfg.model, vocab_size(cfg.data)).to(groups.device)
    check_same_start(model, groups.world)
    eval_model = copy.deepcopy(model)
    fsdp = groups.mesh is not None
    # the shape of the model to export, without its memory: rank 0 fills it with the gathered global model
    template = copy_on(eval_model, "meta") if fsdp and me.rank == 0 and cfg.train.save_final else None
    if fsdp:  # HSDP: sharded over the site's workers (docs/SCALE.md); the evaluation copy too
        assert groups.mesh is not None
        shard_model(model, groups.mesh, cfg.train.precision, compile_blocks=cfg.train.compile, stats=comm.stats)
        shard_model(eval_model, groups.mesh, cfg.train.precision, reshard_root=True, stats=comm.stats)
    own = cfg.topology.sites[where.site_index].corpus
    if own is not None and not Path(own).exists():  # checked here: it may exist on this site's machine only
        raise ConfigError(f"topology.sites[{where.site_index}].corpus: file or directory not found on this machine: {own}")
    data = build_rank_data(
        cfg.data,
        where.rank,
        place.full.workers,
        cfg.model.block_size,
        cfg.train.batch_size,
        cfg.train.eval_batches,
        cfg.train.seed,
        site_corpus=cfg.topology.sites[where.site_index].corpus,
    )
    data.micro_batches = cfg.train.grad_accum
    if cfg.train.compile and not fsdp:  # in place: the same parameters under the same names, for sync and checkpoints
        model.compile()
    optimizer, scheduler = build_optimizer(cfg.optim, model, cfg.train.steps)
    if cfg.train.timeline:
        comm.stats.intervals = []
    tokens_per_rank_step = cfg.train.batch_size * cfg.train.grad_accum * cfg.model.block_size
    n_tensors = sum(1 for p in model.parameters() if p.requires_grad)
    seal = ckpt.Seal.of(optional_secret(cfg.elastic))
    # failure injection, one plan for this site: NaN updates, altered frames, missed votes, secure-aggregation dropouts
    f = cfg.fault
    plan = FaultPlan.for_site(where.site, f.nan_at(), f.at("tamper"), cfg.privacy.injections(), f.at("split"))
    privacy = build_privacy(
        cfg.privacy,
        comm,
        model,
        out,
        seed=cfg.train.seed,
        steps=cfg.train.steps,
        rounds_planned=fragment_count(cfg.sync, n_tensors) * math.ceil(cfg.train.steps / cfg.sync.H),
        sample_rate=cfg.train.batch_size / (data.train.num_tokens - cfg.model.block_size - 1),
        run_id=seal.run if seal is not None else None,
        elastic=place.elastic,
        faults=plan,
        min_sites=cfg.elastic_rounds.min_sites,
    )
    closing.push(lambda _type, exc, _tb: privacy.close(failure=exc))  # the audit log's closing line
    outer = cfg.sync.algorithm != "ddp"  # guarded updates and NaN injection act on pseudo-gradients
    sync = build_round(
        cfg.sync,
        model,
        optimizer,
        comm,
        grad_clip=cfg.optim.grad_clip,
        example_dp=privacy.example,
        private=privacy.aggregation,
        guard=UpdateGuard(cfg.guard, comm) if outer and cfg.guard.enabled and place.full.num_sites > 1 else None,
        faults=plan,
        rejoin=Rejoin(place.full, place.site_index) if place.rejoined else None,
        elastic=place.elastic,
        region=place.full.region_name(place.site_index),
        site_sizes=place.full.workers,
        liveness=cfg.liveness,
    )
    closing.callback(sync.close)
    sync.checkpoint_every = cfg.checkpoint.every
    objs = RankObjects(model, optimizer, scheduler, sync, data, comm, privacy, seal, cfg.checkpoint.allow_foreign)
    ckpt_root = Path(cfg.checkpoint.dir.replace("{site}", where.site)).expanduser() if cfg.checkpoint.dir else out / "checkpoints"
    if place.elastic:  # every site is its own world with its own checkpoints
        ckpt_root = ckpt_root / where.site
    resume = cfg.checkpoint.resume.replace("{site}", where.site) if cfg.checkpoint.resume else None
    start = objs.resume(resume, ckpt_root) if resume else 0
    began = privacy.begin(start)  # the audit log: a fresh chain, or the interrupted run's carried on
    if began:
        log(where, start, began)
    if place.rejoined:  # heal from the syncer's model; data and schedule go on from the steps delivered
        assert isinstance(sync, RoundEngine)
        start = sync.rejoin_run()
        data.train.skip(start * data.micro_batches)
        with warnings.catch_warnings():  # no optimizer step yet: torch warns about the order
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(start):
                scheduler.step()
        log(where, start, f"incarnation {place.incarnation}: rejoined the asynchronous rounds at version {sync.version}")
    done = int(os.environ.get("GEOTRAIN_KILLS_DONE", "0")) if place.rejoined else 0
    inject = quorum_kill(cfg, out, where, done) if cfg.sync.quorum is not None and not place.elastic else None
    member = None
    if place.elastic:
        launcher = ("kill", "hang", "migrate")  # carried out by the launcher (tamper, split: by the member, from the plan)
        faults = {step: k for site, step, k in cfg.fault.site_faults() if site == where.site and k in launcher}
        keys = keys_dir(cfg.privacy)
        masks = PairMasks(cfg.privacy.update_bound, place.full.num_sites) if cfg.privacy.secure_aggregation else None
        member, inject = join_elastic(
            cfg.elastic_rounds,
            place.full,
            faults,
            out,
            where,
            place.incarnation,
            objs,
            keys,
            masks,
            plan,
            privacy.round_noise,
            cfg.liveness,
        )
        closing.callback(member.close)  # its heartbeat thread must not outlive the interpreter
        start = member.healed_at_step if member.healed_at_step is not None else start
    n_params = count_params(model)
    suffix = f".{place.incarnation}" if place.incarnation else ""  # a restarted site keeps its earlier metrics
    tracker = None
    if me.local_rank == 0:  # each site's first rank: one tracker run per site (and incarnation)
        tracker = open_tracker(cfg.report, out, f"{cfg.sync.algorithm} {where.site}{suffix}", cfg.model_dump())
        if tracker is not None:
            closing.push(lambda _type, exc, _tb: tracker.close(failed=exc is not None))
    sink = MetricsSink(
        out, where, cfg.train.log_every, print_steps=me.local_rank == 0, suffix=suffix, resumed_at=start, tracker=tracker
    )
    closing.callback(sink.close)
    if me.rank == 0:
        log(me, 0, f"{cfg.sync.algorithm} on {place.world.describe()}, {n_params:,} parameters, {threads} thread(s)/rank")
        log(me, 0, f"inter-site links: {describe_links(place.full, comm.wan)}")
        if cfg.train.compile:
            how = "each block compiled before fully_shard" if fsdp else "the whole model compiled"
            log(me, 0, f"train.compile: {how}")

    def after_step(step: int, window: StepWindow) -> None:
        label = sync.checkpoint_due(step, cfg.checkpoint.every) if cfg.checkpoint.every else None
        if label is not None:
            window.flush()  # the steps it holds are logged (and their losses checked) before the checkpoint that keeps them
            objs.save(ckpt_root, step, cfg.checkpoint.keep, label)
        if inject is not None:
            try:
                inject(step)
            except SiteDrained:  # a migration leaves at a committed round: the steps trained so far are logged first
                window.flush()
                raise

    evaluator = Evaluator(eval_model, data.eval, groups, tokens_per_rank_step, world_broken=lambda: sync.world_broken)
    result = train_loop(
        model,
        data,
        optimizer,
        scheduler,
        sync,
        evaluator,
        sink,
        privacy,
        precision="fp32" if fsdp else cfg.train.precision,  # under FSDP its mixed-precision policy does bf16
        steps=cfg.train.steps,
        start=start,
        eval_every=cfg.eval_every,
        timeline=cfg.train.timeline,
        after_step=after_step,
        compute_speed=cfg.topology.sites[where.site_index].compute_speed,
        max_seconds=cfg.train.max_seconds,
        read_every=cfg.train.read_every or (cfg.train.log_every if groups.device.type == "cuda" else 1),
    )
    sink.close()  # closed again on the way out: each close is idempotent
    privacy.close()
    # every rank's numbers, gathered on the world group (control plane)
    final_params = None
    if cfg.train.save_final:  # whole tensors (sharded: gathered in each site, every rank takes part)
        final_params = sync.full_tensors(sync.global_parameters())
    # a site that came back reports its ranks' places in the whole run
    record = rank_record(where if place.rejoined else me, comm.stats, result, sync.global_hash())
    if cfg.sync.quorum is not None and cfg.sync.region_every and sync.pace_log():  # a region's syncer: its merges
        record["merges"] = sync.pace_log()
    gathered = sync.gather_records(record)
    summary = None
    if me.rank == 0 and not place.rejoined:
        run = {
            "algorithm": cfg.sync.algorithm,
            "H": cfg.sync.H if cfg.sync.algorithm != "ddp" else 1,
            "fragments": sync.F,
            "rounds": sync.rounds,
            "region_rounds": sync.region_rounds,
            "rounds_rolled_back": sync.rounds_rolled_back,
            "guard_rejections": dict(sync.guard.rejected) if sync.guard is not None else {},
            "guard_events": list(sync.guard.events) if sync.guard is not None else [],
            "codec": cfg.sync.codec.name,
            "pace": sync.pace_log(),
            "adapt": sync.adapt_log(),
            "params": n_params,
            "flops_per_token": flops_per_token(n_params, cfg.model.n_layer, cfg.model.n_embd, cfg.model.block_size),
            "device": torch.cuda.get_device_name(groups.device) if groups.device.type == "cuda" else "cpu",
            "link_emulation": comm.wan.mode if comm.wan is not None else "off",
            "threads_per_rank": threads,
            "backend": groups.backend,
            "config": cfg.model_dump(),
        }
        summary = run_summary(gathered, place.world, result, run, privacy.summary())
        if member is not None:
            summary.update(
                site=where.site,
                rounds_committed=sync.rounds - sync.rounds_rolled_back,
                detected=member.events,
                started_at_step=start,
            )
            (out / "elastic" / f"summary-{where.site}.json").write_text(json.dumps(summary, indent=2))
        else:
            (out / "summary.json").write_text(json.dumps(summary, indent=2))
        if final_params is not None:
            whole = eval_model
            if template is not None:
                whole = copy_on(template, "cpu")
                for name, buf in eval_model.named_buffers():  # FSDP leaves buffers whole
                    whole.get_buffer(name).copy_(buf)
            load_parameters(whole, final_params)
            torch.save(whole.state_dict(), out / "final_model.pt")
            export_model(whole, cfg.model, out / "final_model", tokenizer_file(cfg.data))  # safetensors + config
    if tracker is not None:  # the whole run's summary on rank 0, this rank's own numbers on other sites
        tracker.log_summary(summary if summary is not None else record)
    if cfg.train.timeline:
        write_timeline(out, where.rank, result["compute_intervals"], comm.stats.intervals or [], result["t0"])
    if not sync.world_broken:  # with a site gone, the world group cannot be used
        dist.barrier(group=groups.world)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m geotrain.run.worker", description="One geotrain rank (use under torchrun or geotrain's launcher)."
    )
    parser.add_argument("--config", default=None, help="YAML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default="runs/geotrain", help="output directory")
    args = parser.parse_args(argv)
    die_with_parent()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        print(
            f"geotrain: the worker needs the torch.distributed environment ({', '.join(missing)} not set): "
            "start it with `geotrain train`, `geotrain site` or torchrun",
            file=sys.stderr,
        )
        return 2
    try:
        cfg = load_config(args.config, args.overrides)
        train(cfg, Path(args.out))
    except ConfigError as exc:
        print(f"geotrain: config error: {exc}", file=sys.stderr, flush=True)
        return 2
    except MembershipRefused as exc:
        print(f"geotrain: membership refused: {exc}", file=sys.stderr, flush=True)
        return 3
    except CheckpointError as exc:
        print(f"geotrain: checkpoint.resume: refused: {exc}", file=sys.stderr, flush=True)
        return 2
    except ElasticTimeout as exc:
        print(f"geotrain: elastic wait timed out: {exc}", file=sys.stderr, flush=True)
        return 4
    except SyncerTimeout as exc:
        print(f"geotrain: sync.quorum: {exc}", file=sys.stderr, flush=True)
        return 4
    except LaunchError as exc:
        print(f"geotrain: {exc}", file=sys.stderr, flush=True)
        return 1
    except SiteDrained as exc:  # migration: left at a round boundary, not a failure
        print(f"geotrain: {exc}", file=sys.stderr, flush=True)
        return DRAINED_EXIT
    return 0


def run_main(argv: list[str] | None = None) -> int:
    """:func:`main`, with what escapes it turned into an exit code (an uncaught error's traceback
    is printed, as the interpreter would)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    leave(run_main())  # as under the zygote: a failed rank must not wait for its threads (comm/procs.leave)
