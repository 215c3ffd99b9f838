"""The training loop of one rank: batch, forward, backward, step, log.

The sync algorithm acts through optimizer hooks (:mod:`geotrain.sync`), so the loop is plain
PyTorch. Around it: evaluation of the global model (:class:`Evaluator`), and the time
accounting behind compute utilisation (:class:`StepClock`): compute = step time minus the time
the training thread was blocked on communication that crosses sites, and the window of steps
whose numbers wait on the device (:class:`StepWindow`): a GPU runs ahead of the host, so its
loss and its clock are read once every ``train.read_every`` steps, not at every step.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from geotrain.comm.collectives import CommStats
from geotrain.comm.groups import ProcessGroups, is_dtensor
from geotrain.data import RankData
from geotrain.privacy.build import Privacy
from geotrain.report.metrics import MetricsSink, log
from geotrain.sync import SyncAlgorithm
from geotrain.sync.base import local_tensor


@torch.no_grad()
def load_parameters(module: nn.Module, params: list[torch.Tensor]) -> None:
    """Copy ``params`` (e.g. the global parameters of a sync algorithm) into ``module`` (an FSDP
    module: each rank's own shards into its shards)."""
    for dst, src in zip(module.parameters(), params, strict=True):
        local_tensor(dst).copy_(src)


class Evaluator:
    """Mean held-out loss of the parameters every site agrees on, in a separate copy of the model
    (evaluating mid-round does not disturb local training). Batches are split over all ranks;
    the sums are control plane (an all-reduce on the world group), not payload.

    Args:
        model: a copy of the model to load the global parameters into.
        batches: the fixed evaluation batches (identical on every rank).
        tokens_per_rank_step: tokens one rank processes per step (the curve's x axis counts all ranks').
        world_broken: whether a site was lost (asynchronous quorum rounds go on without it). From
            then on the world group cannot be used: the first site's ranks evaluate alone, on
            their site's group, and the other ranks get NaN (a site that came back, whose world is
            its own ranks, evaluates on it).
    """

    def __init__(
        self,
        model: nn.Module,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        groups: ProcessGroups,
        tokens_per_rank_step: int,
        world_broken: Callable[[], bool] = lambda: False,
    ) -> None:
        self.model, self.batches, self.groups, self.world_broken = model, batches, groups, world_broken
        self.tokens_per_rank_step = tokens_per_rank_step
        self.sharded = any(is_dtensor(p) for p in model.parameters())
        self.curve: list[dict[str, float]] = []
        self.seconds = 0.0

    @torch.no_grad()
    def loss(self, params: list[torch.Tensor]) -> float:
        g = self.groups
        ranks, group = list(range(g.topology.world_size)), g.world
        if self.world_broken():
            if g.me.site_index != 0:
                return float("nan")
            ranks, group = list(g.intra_ranks), g.intra
        load_parameters(self.model, params)
        self.model.eval()
        world, rank = len(ranks), ranks.index(g.me.rank)
        acc = torch.zeros(2, dtype=torch.float64)
        mine = self.batches[rank::world]
        for x, y in mine:
            acc[0] += float(self.model(x.to(g.device), y.to(g.device)))
            acc[1] += 1
        if self.sharded:  # every rank of a site runs as many forwards (each gathers the site's shards)
            for x, y in self.batches[: -(-len(self.batches) // world) - len(mine)]:
                self.model(x.to(g.device), y.to(g.device))
        dist.all_reduce(acc, group=group)
        return float(acc[0] / acc[1])

    def __call__(self, params: list[torch.Tensor], step: int, world_steps: int) -> float:
        """Evaluate after ``step`` (``world_steps``: steps all ranks ran by then), timed, and add the point to the curve."""
        t = time.perf_counter()
        loss = self.loss(params)
        self.seconds += time.perf_counter() - t
        self.curve.append({"step": step, "tokens": world_steps * self.tokens_per_rank_step, "eval_loss": loss})
        return loss


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch on ``device``: to a GPU from pinned memory without waiting (a copy from pageable
    memory would wait for the work queued before it, a device sync at every step)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def settle(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a GPU runs ahead of the host: a clock read without
    this measures the launch queue, not the work); nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Compute time, network waits and inter-site bytes per step, from the collectives' counters.

    ``utilisation`` = compute ÷ wall over the training steps, evaluations excluded from both. The
    device is synchronised where the clock is read (:func:`settle`).
    """

    def __init__(self, stats: CommStats, intervals: bool, device: torch.device | None = None) -> None:
        self.stats, self.device = stats, device or torch.device("cpu")
        self.compute = 0.0
        self.peak_inter = 0
        self.intervals: list[tuple[float, float]] | None = [] if intervals else None
        self._t0 = self._m0 = self._wait0 = 0.0
        self._inter0 = 0
        self.seconds = self.waited = 0.0

    def start(self) -> None:
        self._t0, self._m0 = time.perf_counter(), time.monotonic()
        self._wait0, self._inter0 = self.stats.wan_wait_seconds, self.stats.inter_bytes

    def stop(self, read: bool = True) -> None:
        """End the step; ``read``: wait for the device first (else the time is the host's, which a
        later read's wait makes up: a window of steps adds up to the work)."""
        if read:
            settle(self.device)
        self.seconds = time.perf_counter() - self._t0
        self.waited = self.stats.wan_wait_seconds - self._wait0  # blocked on inter-site communication
        self.compute += self.seconds - self.waited
        if self.intervals is not None:
            self.intervals.append((self._m0, self._m0 + self.seconds - self.waited))
        self.peak_inter = max(self.peak_inter, self.stats.inter_bytes - self._inter0)


class StepWindow:
    """Step records waiting for their loss, a device scalar read for the whole window at once.

    ``every`` = 1 (a CPU) writes each record at its step. Otherwise records are kept until a step
    :meth:`due` says ends the window (every ``every`` steps, an evaluation, the run's end) or a
    checkpoint (:meth:`flush`): one copy reads all their losses, each is checked (a non-finite one
    stops the run, naming its step, after the steps before it are written) and every record gets
    the window's mean step time, the only one the device clock gives.
    """

    def __init__(self, sink: MetricsSink, every: int, tokens_per_rank_step: int) -> None:
        self.sink, self.every, self.tokens = sink, max(1, every), tokens_per_rank_step
        self.pending: list[tuple[dict[str, Any], torch.Tensor]] = []

    def due(self, step: int) -> bool:
        """Whether ``step`` ends a window by the count (the loop adds evaluations and the end)."""
        return self.every == 1 or step % self.every == 0

    def add(self, record: dict[str, Any], loss: torch.Tensor) -> None:
        self.pending.append((record, loss.detach()))

    def flush(self) -> None:
        """Read the pending losses (one device sync), check them and write the records."""
        if not self.pending:
            return
        losses = [self.pending[0][1].item()] if len(self.pending) == 1 else torch.stack([x for _, x in self.pending]).tolist()
        records = [r for r, _ in self.pending]
        self.pending = []
        if len(records) > 1:
            mean = sum(r["step_seconds"] for r in records) / len(records)
            for r in records:
                r["step_seconds"], r["tokens_per_second"] = mean, self.tokens / mean
        for r, loss in zip(records, losses, strict=True):
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {r['step']}")
            r["loss"] = loss
            self.sink.step(r)


def train_loop(
    model: nn.Module,
    data: RankData,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    sync: SyncAlgorithm,
    evaluator: Evaluator,
    sink: MetricsSink,
    privacy: Privacy,
    *,
    steps: int,
    start: int = 0,
    precision: str = "fp32",
    eval_every: int,
    timeline: bool = False,
    after_step: Callable[[int, StepWindow], None] | None = None,
    compute_speed: float = 1.0,
    max_seconds: float = 0.0,
    read_every: int = 1,
) -> dict[str, Any]:
    """Train from ``start`` to ``steps`` (or until the sync algorithm says the run is done); the
    numbers the summary needs.

    Args:
        precision: 'bf16' runs forward and backward under autocast; parameters stay fp32.
        compute_speed: emulated relative speed of this site's hardware: after each
            forward+backward the rank sleeps (1/speed - 1) times its typical duration (the median of
            its last nine).
        max_seconds: end the run at the first round boundary after this much training (0: no limit).
        eval_every: evaluate the global model every this many steps (and at the start and end).
        timeline: record this rank's compute intervals (for the timeline plot).
        after_step: called after every step's log (checkpoints, failure injection), with the
            loop's :class:`StepWindow` (a checkpoint flushes it first).
        read_every: read the loss and wait for the device every this many steps (1: every step).
    """
    stats = sync.comm.stats
    device = sync.comm.groups.device
    me = sync.comm.groups.me
    tokens_per_rank_step = evaluator.tokens_per_rank_step
    slow = 1.0 / compute_speed - 1.0
    recent: deque[float] = deque(maxlen=9)  # the last forward+backward seconds (pacing)
    sync.set_limits(steps, max_seconds)
    evaluator(sync.global_parameters(), start, sync.world_steps(start))
    eval_at_start = evaluator.seconds
    model.train()
    clock = StepClock(stats, timeline, device)
    window = StepWindow(sink, read_every, tokens_per_rank_step)
    t_start, t_origin = time.perf_counter(), time.monotonic()
    record: dict[str, Any] = {"step": start, "tokens": sync.world_steps(start) * tokens_per_rank_step}
    seen_adapt = 0
    last = steps
    limit = sync.step_limit(steps)  # (adaptive rounds: a bound; the run ends on ``sync.done``)
    if sync.done:  # (elastic: a site that healed in the run's last round has no step left to run)
        last = limit = start
    for step in range(start + 1, limit + 1):
        # (the step cap is example-level DP's ε budget: without it, train.steps is no cap, as a fast
        # site under adaptive pace passes it mid-run, and stopping it there left the others waiting)
        capped = privacy.example is not None and step > privacy.max_steps
        if privacy.active and (capped or sync.budget_exhausted()):
            last = privacy.stopped_at = step - 1  # same decision on every rank
            if me.rank == 0:
                log(me, step, f"privacy budget ε={privacy.cfg.dp.epsilon} reached: stopping after step {last}")
            break
        clock.start()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.zeros((), device=device)
        t_work = time.perf_counter()
        for _ in range(data.micro_batches):  # gradients add up in .grad; the step averages them once
            x, y = data.train.next()

            def forward(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                    return model(to_device(x, device), to_device(y, device)) / data.micro_batches

            loss += privacy.backward(forward)  # (DP-SGD of a sharded model: two passes, clipped per example)
        if slow > 0:  # (the pacing needs the forward and backward done, not only queued)
            settle(device)  # emulated slower hardware (topology.sites[].compute_speed): the GPU would still be busy
            # scaled from the median of this rank's last forward+backward times, so a stall of this
            # shared machine (or the slow first step) is felt once, not multiplied by 1/speed
            recent.append(time.perf_counter() - t_work)
            time.sleep(statistics.median(recent) * slow)
        sync.add_compute(time.perf_counter() - t_work)
        optimizer.step()  # the sync algorithm's hooks average gradients / run the outer step
        scheduler.step()
        done = sync.done  # the run ended at this step's round boundary (same on every rank)
        evaluate = sync.eval_due(step, eval_every) and not done and step != limit
        read = window.due(step) or evaluate or done or step == limit
        clock.stop(read)
        adapted = sync.adapt_log()
        n = len(adapted)  # streaming appends from its exchange thread
        for a in adapted[seen_adapt:n] if me.rank == 0 else ():  # sync.adapt: print each change, and why
            if a["changed"]:
                moved = ", ".join(
                    f"{k} {a[k]} -> {a['next'][k]}" for k in ("H", "codec", "fragments") if k in a and a[k] != a["next"][k]
                )
                log(me, step, f"adapt: {moved}: {a['why']}")
        seen_adapt = n
        if done:
            last = step
        record = {
            "step": step,
            "elapsed_seconds": time.perf_counter() - t_start,  # since the loop began, evaluations included
            "loss": None,  # (read for the window: StepWindow.flush)
            "lr": scheduler.get_last_lr()[0],
            "tokens": sync.world_steps(step) * tokens_per_rank_step,
            "round": sync.rounds,
            "inter_site_bytes": stats.inter_bytes,
            "intra_site_bytes": stats.intra_bytes,
            "comm_seconds": stats.comm_seconds,
            "wait_seconds": clock.waited,
            "in_flight_bytes": sync.in_flight_bytes(),
            "compute_seconds": clock.compute,
            "step_seconds": clock.seconds,
            "tokens_per_second": tokens_per_rank_step / clock.seconds,
        }
        eps = privacy.epsilon()
        if eps is not None:
            record["epsilon"] = eps
        # not at the run's last step (evaluated after the last round below): where sites run different
        # steps that is the step ``done`` ends, not train.steps, which a fast site passes mid-run (an
        # evaluation is collective: one site skipping it there while the others evaluate hung a run)
        if evaluate:
            record["eval_loss"] = evaluator(sync.global_parameters(), step, sync.world_steps(step))
            model.train()
        window.add(record, loss)
        if read:
            window.flush()
        if after_step is not None:
            after_step(step, window)
        if done:
            break
    window.flush()  # (a privacy stop ends the loop between windows)
    t_fin = time.perf_counter()
    compute_steps, eval_at_fin = clock.compute, evaluator.seconds
    wait0, inter0 = stats.wan_wait_seconds, stats.inter_bytes
    sync.finish()  # a last round so every site ends on the global model
    compute = clock.compute + (time.perf_counter() - t_fin) - (stats.wan_wait_seconds - wait0)
    final_sync_inter = stats.inter_bytes - inter0
    final = evaluator(sync.global_parameters(), last, sync.world_steps(last))
    eps = privacy.epsilon()
    sink.step(
        {
            **record,
            **({"epsilon": eps} if eps is not None else {}),
            "eval_loss": final,
            "inter_site_bytes": stats.inter_bytes,
            "intra_site_bytes": stats.intra_bytes,
            "comm_seconds": stats.comm_seconds,
        },
        step_line=False,
    )
    return {
        "compute_intervals": clock.intervals or [],
        "t0": t_origin,
        # compute time / wall time over the training steps (evaluations excluded from both)
        "utilization": compute_steps / max(1e-9, t_fin - t_start - (eval_at_fin - eval_at_start)),
        "curve": evaluator.curve,
        "final_eval_loss": final,
        "compute_seconds": compute,
        "eval_seconds": evaluator.seconds,
        "eval_seconds_before": eval_at_start,  # the evaluation before the first step (not in wall_seconds)
        "wall_seconds": time.perf_counter() - t_start,
        "peak_inter_site_bytes_per_step": clock.peak_inter,
        "final_sync_inter_site_bytes": final_sync_inter,
        "steps_done": last,
        "step_seconds": compute_steps / max(1, last - start),  # compute per step, waits on the network excluded
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
