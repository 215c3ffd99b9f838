"""The per-rank training entry point: the same code under geotrain's launcher and torchrun.

Run as ``python -m geotrain.run.worker --config FILE [--set K=V ...] --out DIR`` with the usual
torch.distributed environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT). The rank's site comes from the topology (ranks are numbered site by site).

The loop is plain — ``zero_grad -> backward -> step`` — the sync algorithm acts through
optimizer hooks. Global rank 0 writes ``OUT/summary.json`` (schema: docs/SUMMARY.md).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from geotrain.comm.collectives import Collectives
from geotrain.comm.emulate import describe_links, link_emulator
from geotrain.comm.emulate.inprocess import WanEmulator
from geotrain.comm.groups import ProcessGroups
from geotrain.comm.procs import die_with_parent
from geotrain.comm.topology import RankInfo, Topology
from geotrain.config import Config, load_config
from geotrain.data import build_rank_data
from geotrain.elastic.member import SiteMember
from geotrain.elastic.view import HealHooks
from geotrain.errors import ConfigError, MembershipRefused
from geotrain.models import build_model, count_params
from geotrain.privacy.build import Privacy, build_privacy
from geotrain.report.metrics import MetricsSink, log
from geotrain.run import checkpoint as ckpt
from geotrain.run.optim import build_optimizer
from geotrain.sync import DiLoCo, SyncAlgorithm, build_sync
from geotrain.sync.guard import UpdateGuard


def rank_threads(requested: int) -> int:
    """Threads per rank: as configured, else this machine's cores divided among its ranks."""
    if requested:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, cores // max(1, local_world))


@torch.no_grad()
def load_parameters(module: nn.Module, params: list[torch.Tensor]) -> None:
    """Copy ``params`` (e.g. the global parameters of a sync algorithm) into ``module``."""
    for dst, src in zip(module.parameters(), params, strict=True):
        dst.copy_(src)


@torch.no_grad()
def evaluate(
    eval_model: nn.Module, params: list[torch.Tensor], batches: list[tuple[torch.Tensor, torch.Tensor]], groups: ProcessGroups
) -> float:
    """Mean held-out loss of ``params``; batches are split over all ranks (control plane, not payload)."""
    load_parameters(eval_model, params)
    eval_model.eval()
    world, rank = groups.topology.world_size, groups.me.rank
    acc = torch.zeros(2, dtype=torch.float64)
    for x, y in batches[rank::world]:
        acc[0] += float(eval_model(x.to(groups.device), y.to(groups.device)))
        acc[1] += 1
    dist.all_reduce(acc, group=groups.world)
    return float(acc[0] / acc[1])


def train(cfg: Config, out: Path) -> dict[str, Any] | None:
    """Train this rank; returns the run summary on global rank 0, None elsewhere."""
    full = Topology.from_config(cfg.topology)
    elastic = cfg.elastic.enabled
    # elastic mode: this process's torch.distributed world is its site; sites meet per round
    site_index = int(os.environ.get("GEOTRAIN_SITE_INDEX", "0")) if elastic else 0
    incarnation = int(os.environ.get("GEOTRAIN_INCARNATION", "0")) if elastic else 0  # >0: a restarted site
    topo = site_topology(full, site_index) if elastic else full
    threads = rank_threads(cfg.train.threads)
    torch.set_num_threads(threads)
    groups = ProcessGroups.build(topo, cfg.run.backend, cfg.run.timeout_s, lanes=cfg.sync.lanes)
    me = groups.me
    where = full.info(site_index * full.workers_per_site + me.local_rank) if elastic else me  # place in the whole run
    out.mkdir(parents=True, exist_ok=True)
    wan = build_wan(full, where, cfg.topology.links.emulate)
    try:
        torch.manual_seed(cfg.train.seed)  # identical initial model on every rank
        model = build_model(cfg.model).to(groups.device)
        eval_model = copy.deepcopy(model)
        data = build_rank_data(
            cfg.data,
            where.rank,
            full.world_size,
            full.num_sites,
            cfg.model.block_size,
            cfg.train.batch_size,
            cfg.train.eval_batches,
            cfg.train.seed,
            site_corpus=cfg.topology.sites[where.site_index].corpus,
        )
        optimizer, scheduler = build_optimizer(cfg.optim, model, cfg.train.steps)
        comm = Collectives(groups, chunk_bytes=cfg.sync.chunk_bytes, wan=wan)
        if cfg.train.timeline:
            comm.stats.intervals = []
        tokens_per_rank_step = cfg.train.batch_size * cfg.model.block_size
        sync = build_sync(
            cfg.sync,
            model,
            optimizer,
            comm,
            grad_clip=cfg.optim.grad_clip,
            tokens_per_step=tokens_per_rank_step * topo.workers_per_site,
        )
        privacy = build_privacy(
            cfg.privacy,
            comm,
            model,
            out,
            seed=cfg.train.seed,
            steps=cfg.train.steps,
            rounds_planned=getattr(sync, "F", 1) * math.ceil(cfg.train.steps / cfg.sync.H),
            sample_rate=cfg.train.batch_size / (data.train.tokens.numel() - cfg.model.block_size - 1),
        )
        if privacy.aggregation is not None:
            sync.private = privacy.aggregation  # type: ignore[attr-defined]
        if privacy.example is not None:
            sync.example_dp = privacy.example
        if cfg.sync.algorithm != "ddp":  # guarded updates act on pseudo-gradients
            sync.nan_at = cfg.fault.nan_at()
            if cfg.guard.enabled and topo.num_sites > 1:
                sync.guard = UpdateGuard(cfg.guard, comm)
        ckpt_root = Path(cfg.checkpoint.dir).expanduser() if cfg.checkpoint.dir else out / "checkpoints"
        objs = RankObjects(model, optimizer, scheduler, sync, data, comm, privacy)
        start = 0
        if cfg.checkpoint.resume:
            start = _resume(cfg.checkpoint.resume, ckpt_root, objs, groups)
        member = on_step = None
        if elastic:
            member, on_step = _elastic_member(cfg, out, where, incarnation, groups, sync, objs, data, wan)
            start = member.healed_at_step or 0
        n_params = count_params(model)
        suffix = f".{incarnation}" if incarnation else ""  # a restarted site keeps its earlier metrics
        sink = MetricsSink(out, where, cfg.train.log_every, print_steps=me.local_rank == 0, suffix=suffix)
        if me.rank == 0:
            log(me, 0, f"{cfg.sync.algorithm} on {topo.describe()}, {n_params:,} parameters, {threads} thread(s)/rank")
            log(me, 0, f"inter-site links: {describe_links(full, wan)}")

        def checkpoint(step: int) -> None:
            d = ckpt.save(ckpt_root, step, objs.state(step), me.rank, topo.world_size, groups.world, cfg.checkpoint.keep)
            if me.rank == 0:
                log(me, step, f"checkpoint {d}")

        result = _loop(
            cfg,
            model,
            eval_model,
            data,
            optimizer,
            scheduler,
            sync,
            comm,
            groups,
            sink,
            tokens_per_rank_step,
            privacy,
            start,
            checkpoint if cfg.checkpoint.every else None,
            on_step,
        )
        sink.close()
        summary = _summarise(cfg, result, sync, comm, groups, n_params, threads, privacy)
        if me.rank == 0:
            assert summary is not None
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
            if cfg.train.save_final:
                load_parameters(eval_model, sync.global_parameters())
                torch.save(eval_model.state_dict(), out / "final_model.pt")
        if cfg.train.timeline:
            _write_timeline(out, where.rank, result["compute_intervals"], comm.stats.intervals or [], result["t0"])
        dist.barrier(group=groups.world)
        sync.close()
        comm.close()
        if member is not None:
            member.close()
        return summary
    finally:
        if wan is not None:
            wan.close(unlink=me.rank == 0 and not elastic)  # elastic: the launcher removes the link state
        groups.destroy()


def site_topology(full: Topology, site_index: int) -> Topology:
    """One site of ``full`` on its own (elastic mode: a site's process group holds only its ranks)."""
    return dataclasses.replace(
        full, site_names=(full.site_names[site_index],), regions=(full.regions[site_index],), pair_links=()
    )


def _elastic_member(
    cfg: Config,
    out: Path,
    where: RankInfo,
    incarnation: int,
    groups: ProcessGroups,
    sync: SyncAlgorithm,
    objs: RankObjects,
    data: Any,
    wan: WanEmulator | None,
) -> tuple[SiteMember, Callable[[int], None]]:
    """Join the elastic membership (geotrain.elastic); a restarted site (``incarnation`` > 0)
    heals from a live peer first. Returns the member and the per-step failure-injection hook."""
    faults = {step: kind for (site, step), kind in cfg.fault.site_faults().items() if site == where.site}
    (out / "elastic").mkdir(parents=True, exist_ok=True)

    def inject(step: int) -> None:
        kind = faults.pop(step, None)
        if kind is None or (incarnation and member.healed_at_step is None):  # not before a restarted site healed
            return
        request = out / "elastic" / f"fault-{where.site}-{step}.json"
        if where.local_rank == 0:  # the launcher signals every process of this site
            request.write_text(json.dumps({"site": where.site, "kind": kind, "step": step, "time": time.time()}))
            log(where, step, f"fault injection: {kind} this site now")
        skip = request.with_suffix(".skip")  # the launcher declined: it is the last live site
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if skip.exists():
                return
            time.sleep(0.01)
        raise RuntimeError(f"fault injection: the launcher did not {kind} site {where.site}")

    def load(state: dict[str, Any]) -> None:
        objs.load_training(state)
        if member.joining:  # a restarted site takes the source's step: its data stream catches up
            data.train.skip(int(state["step"]))

    def note(message: str) -> None:
        if where.local_rank == 0:
            log(where, sync.local_steps, message)

    def committed() -> int:
        return sync.rounds - sync.rounds_rolled_back

    hooks = HealHooks(
        committed=committed,
        global_hash=sync.global_hash,
        step=lambda: sync.local_steps,
        state=lambda: {**objs.training_state(sync.local_steps), "committed": committed()},
        load=load,
    )
    member = SiteMember(
        cfg.elastic,
        [s.name for s in cfg.topology.sites],
        where.site,
        where.site_index,
        where.local_rank,
        groups.topology.workers_per_site,
        groups.world,
        wan,
        hooks,
        note,
        on_mid_round=lambda: inject(sync.local_steps),
        stats=objs.comm.stats,
    )
    if where.local_rank == 0:
        member.record_file = out / "elastic" / f"rounds-{where.site}.jsonl"
    assert isinstance(sync, DiLoCo)  # the config allows elastic mode with diloco only
    sync.elastic = member
    live = out / "elastic" / f"live-{where.site}.{incarnation}"  # tells the launcher this site takes part
    if not incarnation:
        member.rendezvous(len(cfg.topology.sites), cfg.elastic.start_timeout_s)
    else:  # restarted: heal from a live peer at the next round boundary, before any step
        member.joining = True
        note(f"incarnation {incarnation}: joining the run and healing from a live peer")
        deadline = time.monotonic() + cfg.elastic.start_timeout_s
        while member.healed_at_step is None:
            sync.outer_step()
            if member.healed_at_step is None:
                if time.monotonic() > deadline:
                    raise MembershipRefused(
                        f"no live site to heal from within elastic.start_timeout_s={cfg.elastic.start_timeout_s:g}s"
                    )
                time.sleep(cfg.elastic.heartbeat_s)
    if where.local_rank == 0:
        live.touch()
    return member, inject


def build_wan(topo: Topology, me: RankInfo, requested: str) -> WanEmulator | None:
    """The link emulation for this rank. The launcher states the mode it set up in
    GEOTRAIN_WAN_MODE (kernel mode needs its namespaces); without it, kernel mode falls back to
    in-process pacing with a notice."""
    mode = os.environ.get("GEOTRAIN_WAN_MODE", requested)
    if mode == "kernel" and "GEOTRAIN_WAN_MODE" not in os.environ:
        if me.rank == 0:
            log(me, 0, "kernel link emulation needs geotrain's launcher (network namespaces); using in-process emulation")
        mode = "inprocess"
    key = os.environ.get("GEOTRAIN_WAN_KEY") or os.environ.get("MASTER_PORT", "0")  # elastic: one key for all sites
    return link_emulator(topo, me.site_index, mode, key)


def _write_timeline(
    out: Path, rank: int, compute: list[tuple[float, float]], network: list[tuple[float, float]], t0: float
) -> None:
    """Per-rank intervals (seconds since the first step) for the timeline plot."""
    (out / "timeline").mkdir(exist_ok=True)
    data = {
        "rank": rank,
        "compute": [(a - t0, b - t0) for a, b in compute],
        "network": [(a - t0, b - t0) for a, b in network if b >= t0],
    }
    (out / "timeline" / f"rank{rank}.json").write_text(json.dumps(data))


def _loop(
    cfg: Config,
    model: nn.Module,
    eval_model: nn.Module,
    data: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    sync: SyncAlgorithm,
    comm: Collectives,
    groups: ProcessGroups,
    sink: MetricsSink,
    tokens_per_rank_step: int,
    privacy: Privacy,
    resumed_at: int = 0,
    checkpoint: Callable[[int], None] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    world = groups.topology.world_size
    eval_every = cfg.eval_every
    curve: list[dict[str, float]] = []
    compute = eval_seconds = 0.0
    device = groups.device

    def do_eval(step: int) -> float:
        nonlocal eval_seconds
        t = time.perf_counter()
        loss = evaluate(eval_model, sync.global_parameters(), data.eval, groups)
        eval_seconds += time.perf_counter() - t
        curve.append({"step": step, "tokens": step * world * tokens_per_rank_step, "eval_loss": loss})
        return loss

    do_eval(resumed_at)
    eval_at_start = eval_seconds
    model.train()
    start = time.perf_counter()
    t_origin = time.monotonic()
    compute_intervals: list[tuple[float, float]] = []
    peak_inter = 0
    record: dict[str, Any] = {"step": 0, "tokens": 0}
    last = cfg.train.steps
    for step in range(resumed_at + 1, cfg.train.steps + 1):
        if privacy.active and (step > privacy.max_steps or sync.budget_exhausted()):
            last = privacy.stopped_at = step - 1  # same decision on every rank
            if groups.me.rank == 0:
                log(groups.me, step, f"privacy budget ε={cfg.privacy.dp.epsilon} reached: stopping after step {last}")
            break
        t0 = time.perf_counter()
        m0 = time.monotonic()
        wait0 = comm.stats.wan_wait_seconds
        inter0 = comm.stats.inter_bytes
        x, y = data.train.next()
        loss = model(x.to(device), y.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()  # the sync algorithm's hooks average gradients / run the outer step
        scheduler.step()
        dt = time.perf_counter() - t0
        waited = comm.stats.wan_wait_seconds - wait0  # blocked on inter-site communication
        compute += dt - waited
        if cfg.train.timeline:
            compute_intervals.append((m0, m0 + dt - waited))
        peak_inter = max(peak_inter, comm.stats.inter_bytes - inter0)
        record = {
            "step": step,
            "loss": loss.item(),
            "lr": scheduler.get_last_lr()[0],
            "tokens": step * world * tokens_per_rank_step,
            "round": sync.rounds,
            "inter_site_bytes": comm.stats.inter_bytes,
            "intra_site_bytes": comm.stats.intra_bytes,
            "comm_seconds": comm.stats.comm_seconds,
            "wait_seconds": waited,
            "in_flight_bytes": sync.in_flight_bytes(),
            "compute_seconds": compute,
            "step_seconds": dt,
            "tokens_per_second": tokens_per_rank_step / dt,
        }
        eps = privacy.epsilon()
        if eps is not None:
            record["epsilon"] = eps
        if not math.isfinite(record["loss"]):
            raise FloatingPointError(f"loss is {record['loss']} at step {step}")
        if step % eval_every == 0 and step != last:
            record["eval_loss"] = do_eval(step)
            model.train()
        sink.step(record)
        if checkpoint is not None and step % cfg.checkpoint.every == 0:
            checkpoint(step)
        if on_step is not None:
            on_step(step)
    t_fin = time.perf_counter()
    compute_steps, eval_at_fin = compute, eval_seconds
    wait0 = comm.stats.wan_wait_seconds
    inter0 = comm.stats.inter_bytes
    sync.finish()
    compute += (time.perf_counter() - t_fin) - (comm.stats.wan_wait_seconds - wait0)
    final_sync_inter = comm.stats.inter_bytes - inter0
    final = do_eval(last)
    eps = privacy.epsilon()
    sink.step(
        {
            **record,
            **({"epsilon": eps} if eps is not None else {}),
            "eval_loss": final,
            "inter_site_bytes": comm.stats.inter_bytes,
            "intra_site_bytes": comm.stats.intra_bytes,
            "comm_seconds": comm.stats.comm_seconds,
        },
        step_line=False,
    )
    wall = time.perf_counter() - start
    return {
        "compute_intervals": compute_intervals,
        "t0": t_origin,
        # compute time / wall time over the training steps (evaluations excluded from both)
        "utilization": compute_steps / max(1e-9, t_fin - start - (eval_at_fin - eval_at_start)),
        "curve": curve,
        "final_eval_loss": final,
        "compute_seconds": compute,
        "eval_seconds": eval_seconds,
        "wall_seconds": wall,
        "peak_inter_site_bytes_per_step": peak_inter,
        "final_sync_inter_site_bytes": final_sync_inter,
        "steps_done": last,
    }


@dataclass
class RankObjects:
    """What a checkpoint holds for one rank: saved and restored side by side, so the two stay in step."""

    model: nn.Module
    optimizer: Any
    scheduler: Any
    sync: SyncAlgorithm
    data: Any
    comm: Collectives
    privacy: Privacy

    def training_state(self, step: int) -> dict[str, Any]:
        """Model, optimizers, schedule and sync state after ``step`` (what a healing site receives)."""
        return {
            "step": step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "sync": self.sync.checkpoint_state(),
        }

    def load_training(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sync.load_checkpoint_state(state["sync"])

    def state(self, step: int) -> dict[str, Any]:
        """Everything this rank needs to continue exactly after ``step``."""
        st = self.comm.stats
        return {
            **self.training_state(step),
            "data": self.data.train.state(),
            "rng": torch.get_rng_state(),
            "bytes": [st.intra_bytes, st.inter_bytes, st.inter_raw_bytes],
            "accountant": self.privacy.accountant_state(),
        }

    def load(self, state: dict[str, Any]) -> int:
        """Restore :meth:`state`'s output; the step it was taken after."""
        st = self.comm.stats
        self.load_training(state)
        self.data.train.set_state(state["data"])
        torch.set_rng_state(state["rng"])
        st.intra_bytes, st.inter_bytes, st.inter_raw_bytes = state["bytes"]
        self.privacy.load_accountant_state(state["accountant"])
        return int(state["step"])


def _resume(spec: str, root: Path, objs: RankObjects, groups: ProcessGroups) -> int:
    """Load the checkpoint ``spec`` ('auto' or a path) into this rank's objects; the step it was
    taken after (0 when 'auto' finds none). Every rank verifies every file, so all choose alike."""
    me = groups.me

    def warn(msg: str) -> None:
        if me.rank == 0:
            log(me, 0, msg)

    d = ckpt.find(spec, root, groups.topology.world_size, warn)
    if d is None:
        warn(f"no valid checkpoint under {root}: starting from step 0")
        return 0
    step = objs.load(ckpt.load(d, me.rank))
    warn(f"resumed from {d} (after step {step})")
    return step


def _summarise(
    cfg: Config,
    result: dict[str, Any],
    sync: SyncAlgorithm,
    comm: Collectives,
    groups: ProcessGroups,
    n_params: int,
    threads: int,
    privacy: Privacy,
) -> dict[str, Any] | None:
    """Gather per-rank numbers on the world group (control plane) and build the summary on rank 0."""
    me, topo = groups.me, groups.topology
    mine = {
        "rank": me.rank,
        "site": me.site,
        "local_rank": me.local_rank,
        "inter_site_bytes": comm.stats.inter_bytes,
        "inter_site_raw_bytes": comm.stats.inter_raw_bytes,
        "intra_site_bytes": comm.stats.intra_bytes,
        "peak_inter_site_bytes_per_step": result["peak_inter_site_bytes_per_step"],
        "final_sync_inter_site_bytes": result["final_sync_inter_site_bytes"],
        "compute_seconds": result["compute_seconds"],
        "utilization": result["utilization"],
        "network_seconds": comm.stats.network_seconds,
        "comm_wait_seconds": comm.stats.comm_seconds,
        "wan_wait_seconds": comm.stats.wan_wait_seconds,
        "eval_seconds": result["eval_seconds"],
        "wall_seconds": result["wall_seconds"],
        "global_param_hash": sync.global_hash(),
    }
    gathered: list[Any] = [None] * topo.world_size
    dist.all_gather_object(gathered, mine, group=groups.world)
    if me.rank != 0:
        return None
    ranks = sorted(gathered, key=lambda r: r["rank"])
    hashes = {name: ranks[topo.site_ranks(i)[0]]["global_param_hash"] for i, name in enumerate(topo.site_names)}
    agree = all(r["global_param_hash"] == hashes[r["site"]] for r in ranks)
    n = len(ranks)
    inter = sum(r["inter_site_bytes"] for r in ranks)
    raw = sum(r["inter_site_raw_bytes"] for r in ranks)
    return {
        "algorithm": cfg.sync.algorithm,
        "sites": list(topo.site_names),
        "workers_per_site": topo.workers_per_site,
        "world_size": topo.world_size,
        "steps": result["steps_done"],
        "H": cfg.sync.H if cfg.sync.algorithm != "ddp" else 1,
        "fragments": getattr(sync, "F", 1),
        "rounds": sync.rounds,
        "rounds_rolled_back": sync.rounds_rolled_back,
        "guard_rejections": dict(sync.guard.rejected) if sync.guard is not None else {},
        "guard_events": list(sync.guard.events) if sync.guard is not None else [],
        "codec": cfg.sync.codec,
        "tokens": result["curve"][-1]["tokens"],
        "params": n_params,
        "final_eval_loss": result["final_eval_loss"],
        "inter_site_bytes": inter,
        "compression_ratio": raw / inter if inter else 1.0,
        "utilization": min(r["utilization"] for r in ranks),
        "link_emulation": comm.wan.mode if comm.wan is not None else "off",
        "peak_inter_site_bytes_per_step": sum(r["peak_inter_site_bytes_per_step"] for r in ranks),
        "final_sync_inter_site_bytes": sum(r["final_sync_inter_site_bytes"] for r in ranks),
        "intra_site_bytes": sum(r["intra_site_bytes"] for r in ranks),
        "wall_seconds": max(r["wall_seconds"] for r in ranks),
        "compute_seconds": sum(r["compute_seconds"] for r in ranks) / n,
        "comm_wait_seconds": sum(r["comm_wait_seconds"] for r in ranks) / n,
        "wan_wait_seconds": sum(r["wan_wait_seconds"] for r in ranks) / n,
        "eval_seconds": sum(r["eval_seconds"] for r in ranks) / n,
        "global_param_hash": hashes,
        "hashes_agree_within_sites": agree,
        **privacy.summary(),
        "eval_curve": result["curve"],
        "per_rank": ranks,
        "threads_per_rank": threads,
        "backend": groups.backend,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "config": cfg.model_dump(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m geotrain.run.worker", description="One geotrain rank (use under torchrun or geotrain's launcher)."
    )
    parser.add_argument("--config", default=None, help="YAML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default="runs/geotrain", help="output directory")
    args = parser.parse_args(argv)
    die_with_parent()
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"geotrain: config error: {exc}", file=sys.stderr)
        return 2
    try:
        train(cfg, Path(args.out))
    except MembershipRefused as exc:
        print(f"geotrain: membership refused: {exc}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
