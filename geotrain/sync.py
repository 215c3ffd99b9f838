"""Sync algorithms: wrap a model + inner optimizer so the training loop stays plain.

Each algorithm registers hooks on the inner optimizer (as torchft's DiLoCo does), so the loop
is only ``zero_grad -> backward -> step``:

* a *step pre-hook* averages gradients before the inner update;
* a *step post-hook* runs the outer synchronisation when one is due.

``DDP`` — data parallel across every rank: gradients are summed over all ranks every step
(hierarchically by default, see :mod:`geotrain.comm.collectives`) and divided by the world size.

``DiLoCo`` — Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
Models", arXiv:2311.08105, Algorithm 1:

1. inner step: gradients are averaged inside the site only (fast links), then AdamW;
2. every H inner steps: pseudo-gradient Δ = θ_global − θ_local (fp32);
3. Δ is averaged across sites (optionally weighted by tokens processed);
4. the outer optimizer (SGD with Nesterov momentum, fp32 state) steps θ_global with Δ as its
   gradient;
5. θ_local ← θ_global, and the next round starts (the inner optimizer state is kept).

``StreamingDiLoCo`` — Douillard et al., "Streaming DiLoCo with overlapping communication",
arXiv:2501.18512: the parameters are split into F fragments (strided groups of layers); fragment
p syncs when the step count is ≡ p·H/F (mod H), so only 1/F of the model crosses sites at any
sync point; its averaged pseudo-gradient is applied τ inner steps later (the communication has
τ steps of compute to hide behind), and the fresh global fragment is mixed into the local one:
θ_local ← α·θ_local + (1 − α)·θ_global.

What crosses sites goes through a :class:`SiteReducer`, which applies the configured codec
(:mod:`geotrain.codecs`) and keeps its error-feedback state.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from geotrain.codecs import Codec, Residual, build_codec
from geotrain.codecs.powersgd import PowerSGD
from geotrain.comm.collectives import Collectives
from geotrain.config import SyncConfig
from geotrain.guard import RoundFailed, UpdateGuard

if TYPE_CHECKING:
    from geotrain.membership import SiteMember
    from geotrain.privacy import ExampleDP, PrivateAggregation


class RoundPostponed(Exception):
    """Elastic mode: the membership coordinator is down; keep training and try again next step."""


def flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def views_like(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views into ``flat`` shaped like each tensor of ``like``, in order (the inverse of a cat)."""
    return [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in like]), like, strict=True)]


def write_grads(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    for p, v in zip(params, views_like(flat, params), strict=True):
        if p.grad is None:
            p.grad = torch.empty_like(p)
        p.grad.copy_(v)


def clip_flat_(flat: torch.Tensor, max_norm: float) -> None:
    """Scale ``flat`` in place so its 2-norm is at most ``max_norm`` (0 disables), like clip_grad_norm_."""
    if max_norm > 0:
        norm = flat.norm()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        flat.mul_(coef)


def params_hash(tensors: list[torch.Tensor]) -> str:
    """sha256 of the fp32 bytes of ``tensors`` in order: equal hashes mean bit-identical models."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def make_codec(cfg: SyncConfig) -> Codec | None:
    """The byte codec of ``cfg`` (None: fp32 ring, or PowerSGD which is not a byte codec)."""
    if cfg.codec in ("none", "powersgd"):
        return None
    return build_codec(cfg.codec, sigma_range=cfg.sigma_range, block_size=cfg.block_size, topk_fraction=cfg.topk_fraction)


def contiguous_split(sizes: Sequence[int], parts: int) -> list[int]:
    """Cut ``sizes`` (in order) into ``parts`` contiguous runs of near-equal total; the run totals."""
    total = sum(sizes)
    runs = [0] * parts
    acc = 0
    for n in sizes:
        j = min(parts - 1, (acc * parts) // max(1, total)) if total else 0
        # a tensor goes to the part its start falls in
        runs[j] += n
        acc += n
    return runs


class SiteReducer:
    """Sums a flat fp32 vector that is identical on every rank of a site across sites, encoded.

    Byte codecs run on each local rank's 1/G shard (:meth:`Collectives.all_reduce_across_sites`).
    PowerSGD needs matrices, so each local rank takes a contiguous run of whole tensors, all-reduces
    their P and Q factors across sites, and the site all-gathers the runs.
    """

    def __init__(self, cfg: SyncConfig, comm: Collectives, shapes: Sequence[torch.Size], seed: int = 0) -> None:
        if cfg.codec != "none" and comm.groups.device.type != "cpu":
            raise ValueError(
                f"sync.codec={cfg.codec}: codecs encode CPU tensors; with the {comm.groups.backend} backend use sync.codec=none for now"
            )
        self.comm = comm
        self.codec = make_codec(cfg)
        self.residual = Residual() if (self.codec is not None and cfg.uses_error_feedback) else None
        self.shapes = list(shapes)
        self.powersgd: PowerSGD | None = None
        if cfg.codec == "powersgd":
            self.powersgd = PowerSGD(cfg.rank, cfg.uses_error_feedback, seed)
            g = comm.groups
            numels = [int(s.numel()) for s in self.shapes]
            self.run_sizes = contiguous_split(numels, len(g.intra_ranks))
            # which tensors this local rank owns: the run its index falls in
            start = sum(self.run_sizes[: g.me.local_rank])
            stop = start + self.run_sizes[g.me.local_rank]
            offsets = list(itertools.accumulate(numels, initial=0))[:-1]  # where each tensor starts
            self.mine = [i for i, (o, n) in enumerate(zip(offsets, numels, strict=True)) if start <= o < stop and n]

    def __call__(self, flat: torch.Tensor) -> None:
        """Replace ``flat`` by its sum over sites (every rank of every site ends with the same values)."""
        if self.powersgd is None:
            self.comm.all_reduce_across_sites(flat, self.codec, self.residual)
            return
        g = self.comm.groups
        stats = self.comm.stats
        raw0 = stats.inter_raw_bytes
        views = [v.view(shape) for v, shape in zip(flat.split([s.numel() for s in self.shapes]), self.shapes, strict=True)]
        self.powersgd.all_reduce([views[i] for i in self.mine], self.comm.all_reduce_inter)
        # reference for the compression ratio: an fp32 ring all-reduce of the same tensors
        n, mine = len(g.inter_ranks), sum(views[i].numel() for i in self.mine)
        stats.inter_raw_bytes = raw0 + round(2 * (n - 1) / n * 4 * mine)
        self.comm.all_gather_intra(flat, self.run_sizes)

    def forget_residual(self) -> None:
        """Drop the error-feedback residual (a site left out of a round must send exactly nothing)."""
        if self.residual is not None:
            self.residual.tensor = None
        if self.powersgd is not None:
            self.powersgd.errors = [None] * len(self.powersgd.errors)

    def state_dict(self) -> dict[str, Any]:
        """Error-feedback / warm-start state: belongs to the site, goes into its checkpoint."""
        return {
            "residual": None if self.residual is None else self.residual.tensor,
            "powersgd": None if self.powersgd is None else self.powersgd.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.residual is not None:
            self.residual.tensor = state["residual"]
        if self.powersgd is not None and state["powersgd"] is not None:
            self.powersgd.load_state_dict(state["powersgd"])


class SyncAlgorithm:
    """Base class: owns the optimizer hooks. Use as a context manager or call :meth:`close`."""

    name = "base"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Collectives, grad_clip: float) -> None:
        self.model = model
        self.optimizer = optimizer
        self.comm = comm
        self.grad_clip = grad_clip
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.local_steps = 0
        self.rounds = 0
        self.rounds_rolled_back = 0
        self.example_dp: ExampleDP | None = None  # DP-SGD on the inner steps (privacy.dp.unit=example)
        self.guard: UpdateGuard | None = None  # leaves non-finite / outlier pseudo-gradients out (DiLoCo, streaming)
        self.nan_at: set[tuple[str, int]] = set()  # failure injection: (site, round) whose update is NaN
        self._handles = [
            optimizer.register_step_pre_hook(lambda *_: self.sync_gradients()),
            optimizer.register_step_post_hook(lambda *_: self.after_step()),
        ]

    def sync_gradients(self) -> None:
        """Average gradients as the algorithm requires. Called by the optimizer before each step."""
        raise NotImplementedError

    def _average_gradients(self, members: int, reduce_sum: Callable[[torch.Tensor], None]) -> None:
        """Sum gradients with ``reduce_sum`` over ``members`` ranks, divide, clip the average.
        With DP-SGD, what is summed is each rank's clipped, noised per-example gradient sum."""
        if self.example_dp is not None:
            flat = self.example_dp.privatize()
            if members > 1:
                reduce_sum(flat)
                flat.div_(members)
            write_grads(self.params, flat)
            return
        if members == 1:  # nothing to exchange; keep the single-worker path as cheap as plain PyTorch
            if self.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
            return
        flat = flat_grads(self.params)
        reduce_sum(flat)
        flat.div_(members)
        clip_flat_(flat, self.grad_clip)
        write_grads(self.params, flat)

    def after_step(self) -> None:
        """Called by the optimizer after each inner step."""
        self.local_steps += 1

    def finish(self) -> None:
        """Bring the run to a consistent end (e.g. a last outer sync). Call once after the loop."""

    def budget_exhausted(self) -> bool:
        """True when the next step would start a round the privacy budget cannot pay for (then the
        training loop stops; the answer is the same on every rank)."""
        return False

    def global_parameters(self) -> list[torch.Tensor]:
        """The parameters every site agrees on (the model to evaluate and save)."""
        return [p.detach() for p in self.params]

    def global_hash(self) -> str:
        return params_hash(self.global_parameters())

    def in_flight_bytes(self) -> int:
        """Bytes handed to a background exchange that has not finished (0: all exchanges block)."""
        return 0

    def state_dict(self) -> dict[str, Any]:
        """Sync state a checkpoint must carry beyond parameters and optimizers (codec state)."""
        return {}

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything this algorithm needs to continue exactly (waits for exchanges in flight)."""
        return {
            "local_steps": self.local_steps,
            "rounds": self.rounds,
            "rolled_back": self.rounds_rolled_back,
            **self.state_dict(),
        }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.local_steps = state["local_steps"]
        self.rounds = state["rounds"]
        self.rounds_rolled_back = state["rolled_back"]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> SyncAlgorithm:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class DDP(SyncAlgorithm):
    """Average gradients over every rank, every step.

    Args:
        allreduce: 'hierarchical' (reduce-scatter in site, all-reduce across, all-gather in site)
            or 'flat' (one ring over all ranks).
        cfg: the sync section; its codec encodes the across-sites step (None: fp32).
    """

    name = "ddp"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        comm: Collectives,
        grad_clip: float,
        allreduce: str = "hierarchical",
        cfg: SyncConfig | None = None,
    ) -> None:
        super().__init__(model, optimizer, comm, grad_clip)
        self.allreduce = allreduce
        self.world = comm.groups.topology.world_size
        self.reducer = SiteReducer(cfg, comm, [p.shape for p in self.params]) if cfg and cfg.codec != "none" else None

    def sync_gradients(self) -> None:
        self._average_gradients(self.world, self._sum)

    def _sum(self, flat: torch.Tensor) -> None:
        r = self.reducer
        if r is None:
            self.comm.all_reduce(flat, self.allreduce)
        elif r.powersgd is not None:  # PowerSGD needs whole tensors: sum in site first
            self.comm.all_reduce_intra(flat)
            r(flat)
        else:
            self.comm.all_reduce(flat, self.allreduce, r.codec, r.residual)

    def after_step(self) -> None:
        super().after_step()
        self.rounds = self.local_steps  # every step is a global sync

    def state_dict(self) -> dict[str, Any]:
        return {"reducer": None if self.reducer is None else self.reducer.state_dict()}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        super().load_checkpoint_state(state)
        if self.reducer is not None:
            self.reducer.load_state_dict(state["reducer"])


class _OuterSync(SyncAlgorithm):
    """What DiLoCo and Streaming DiLoCo share: DDP inside a site, fp32 global parameters, and the
    averaging of pseudo-gradients across sites (token-weighted if configured) through a reducer.

    Args:
        cfg: the sync section (H, outer SGD settings, token weighting, codec).
        tokens_per_step: tokens this site processes per inner step (for token weighting).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        comm: Collectives,
        grad_clip: float,
        cfg: SyncConfig,
        tokens_per_step: int = 1,
    ) -> None:
        super().__init__(model, optimizer, comm, grad_clip)
        self.cfg = cfg
        self.H = cfg.H
        self.weight_by_tokens = cfg.weight_by_tokens
        self.tokens_per_step = tokens_per_step
        topo = comm.groups.topology
        self.num_sites = topo.num_sites
        self.workers_per_site = topo.workers_per_site
        # fp32 outer state, whatever the model's dtype
        self.global_params = [p.detach().clone().to(torch.float32) for p in self.params]
        self.rollback_reasons: list[str] = []
        self.private: PrivateAggregation | None = None  # clipping, site DP, secure aggregation
        self.elastic: SiteMember | None = None  # elastic mode: the cross-site average goes through the membership layer

    def _outer_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        c = self.cfg
        return torch.optim.SGD(params, lr=c.outer_lr, momentum=c.outer_momentum, nesterov=c.nesterov)

    def sync_gradients(self) -> None:
        self._average_gradients(self.workers_per_site, self.comm.all_reduce_intra)

    def _average_across_sites(
        self, delta: torch.Tensor, reducer: SiteReducer, steps: int, round_id: int = 0, key: int = 0
    ) -> None:
        """Average a site's pseudo-gradient over sites (token-weighted if configured), via ``reducer``;
        with privacy, clipped/noised and summed by :class:`PrivateAggregation` (may raise RoundFailed)."""
        site = self.comm.groups.topology.site_names[self.comm.groups.me.site_index]
        if (site, round_id) in self.nan_at:  # failure injection: this site's update is NaN
            delta.fill_(float("nan"))
        if self.private is not None:
            self.private.average(delta, round_id)
            return
        if self.elastic is not None:
            if self.elastic.round(delta) is None:
                raise RoundPostponed(f"round {round_id}")
            return
        if self.num_sites == 1:
            return
        included = [True] * self.num_sites
        if self.guard is not None:
            included = self.guard.include(delta, key, round_id)
            if not any(included):
                raise RoundFailed(f"round {round_id}: every site's update was rejected by the guard")
            if not included[self.comm.groups.me.site_index]:
                delta.zero_()
                reducer.forget_residual()  # else its old error feedback would still be sent
        if self.weight_by_tokens:
            mine = float(steps * self.tokens_per_step) if included[self.comm.groups.me.site_index] else 0.0
            total = torch.tensor([mine], dtype=torch.float64)
            self.comm.all_reduce_across_sites(total)
            delta.mul_(mine / float(total.item()))
            reducer(delta)
        else:
            reducer(delta)
            delta.div_(sum(included))

    def global_parameters(self) -> list[torch.Tensor]:
        return self.global_params

    @torch.no_grad()
    def _roll_back(self, indices: Sequence[int], why: str) -> None:
        """A failed round: nothing of it is applied; the parameters ``indices`` go back to the global ones."""
        for i in indices:
            self.params[i].copy_(self.global_params[i])
        self.rounds_rolled_back += 1
        self.rollback_reasons.append(why)

    def _privacy_allows_round(self) -> bool:
        return self.private is None or self.private.can_afford()

    def checkpoint_state(self) -> dict[str, Any]:
        return {
            **super().checkpoint_state(),
            "global_params": [g.clone() for g in self.global_params],
            "guard": None if self.guard is None else self.guard.state_dict(),
        }

    @torch.no_grad()
    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        super().load_checkpoint_state(state)
        for g, saved in zip(self.global_params, state["global_params"], strict=True):
            g.copy_(saved)
        if self.guard is not None and state["guard"] is not None:
            self.guard.load_state_dict(state["guard"])


class DiLoCo(_OuterSync):
    """DiLoCo across sites, synchronous data parallel inside a site.

    Settings come from the sync section: H inner steps per outer round, outer SGD (paper: 0.7,
    0.9, Nesterov), token weighting, codec.
    """

    name = "diloco"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        comm: Collectives,
        grad_clip: float,
        cfg: SyncConfig,
        tokens_per_step: int = 1,
    ) -> None:
        super().__init__(model, optimizer, comm, grad_clip, cfg, tokens_per_step)
        self.outer_optimizer = self._outer_optimizer(self.global_params)
        self._steps_in_round = 0
        self.reducer = SiteReducer(cfg, comm, [p.shape for p in self.params])

    def after_step(self) -> None:
        super().after_step()
        self._steps_in_round += 1
        if self._steps_in_round >= self.H:  # more than H: a postponed round, retried every step
            self.outer_step()

    def finish(self) -> None:
        if self._steps_in_round:  # a last, shorter round so every site ends on the global model
            if self._privacy_allows_round():
                self.outer_step()
                while self._steps_in_round and self.elastic is not None:  # postponed: wait for the coordinator
                    time.sleep(self.elastic.cfg.heartbeat_s)
                    self.outer_step()
            else:
                self._roll_back(range(len(self.params)), "privacy budget: the last partial round is not released")
                self._steps_in_round = 0

    def budget_exhausted(self) -> bool:
        return self._steps_in_round == 0 and not self._privacy_allows_round()

    @torch.no_grad()
    def outer_step(self) -> None:
        """Steps 2-5 of DiLoCo: average pseudo-gradients across sites and apply the outer optimizer."""
        # 2. pseudo-gradient, fp32
        delta = pseudo_gradient(self.global_params, self.params)
        # 3. average across sites (every local rank carries 1/G of it over the WAN)
        try:
            self._average_across_sites(delta, self.reducer, self._steps_in_round, self.rounds)
        except RoundPostponed:
            return
        except RoundFailed as exc:
            self._roll_back(range(len(self.params)), str(exc))
            self._steps_in_round = 0
            self.rounds += 1
            self._note("rolled_back", str(exc))
            return
        # 4. outer optimizer step with Δ as the gradient
        outer_step_(self.outer_optimizer, self.global_params, delta)
        # 5. local ← global
        for g, p in zip(self.global_params, self.params, strict=True):
            p.copy_(g)
        self._steps_in_round = 0
        self.rounds += 1
        self._note("committed", "")

    def _note(self, outcome: str, reason: str) -> None:
        if self.elastic is not None:
            self.elastic.note(outcome, reason, self.global_hash(), self.rounds - self.rounds_rolled_back, self.local_steps)

    def state_dict(self) -> dict[str, Any]:
        return {"reducer": self.reducer.state_dict()}

    def checkpoint_state(self) -> dict[str, Any]:
        return {**super().checkpoint_state(), "outer": self.outer_optimizer.state_dict(), "in_round": self._steps_in_round}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        super().load_checkpoint_state(state)
        self.outer_optimizer.load_state_dict(state["outer"])
        self._steps_in_round = state["in_round"]
        self.reducer.load_state_dict(state["reducer"])


def pseudo_gradient(global_params: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Δ = θ_global − θ_local, flat fp32."""
    return torch.cat([(g - p.to(torch.float32)).reshape(-1) for g, p in zip(global_params, params, strict=True)])


def outer_step_(optimizer: torch.optim.Optimizer, global_params: Sequence[torch.Tensor], delta: torch.Tensor) -> None:
    """One outer optimizer step on ``global_params`` with the flat ``delta`` as their gradient."""
    for g, v in zip(global_params, views_like(delta, global_params), strict=True):
        g.grad = v
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


_LAYER = re.compile(r"(?:^|\.)(\d+)\.")


def strided_fragments(names: Sequence[str], sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Parameter indices per fragment: layer i goes to fragment i mod F (strided, as in the paper);
    parameters outside numbered layers (embeddings, final norm, head) go to the smallest fragment."""
    out: list[list[int]] = [[] for _ in range(fragments)]
    load = [0] * fragments
    loose = []
    for i, name in enumerate(names):
        m = _LAYER.search(name)
        if m is None:
            loose.append(i)
            continue
        f = int(m.group(1)) % fragments
        out[f].append(i)
        load[f] += sizes[i]
    for i in sorted(loose, key=lambda i: -sizes[i]):
        f = min(range(fragments), key=lambda f: load[f])
        out[f].append(i)
        load[f] += sizes[i]
    return [sorted(f) for f in out]


class StreamingDiLoCo(_OuterSync):
    """Streaming DiLoCo: F fragments sync at staggered steps; each merges τ steps after its sync.

    Fragment p syncs after inner step t when t ≡ p·H/F (mod H), t > 0: its pseudo-gradient Δ_p
    is computed and handed to a background thread, which averages it across sites while the
    inner steps go on. At step t + τ the training thread waits for the average (if it is not in
    yet — that wait is the only time compute stalls on the network), the outer optimizer
    applies it to the global fragment and θ_local,p ← α·θ_local,p + (1 − α)·θ_global,p. Every
    fragment has its own outer optimizer.

    Eager variant (``cfg.eager``, Kale et al. arXiv:2502.12996): a fragment's exchange gets a
    whole round. At its sync the outer step is applied at once with the eager pseudo-gradient
    Δ_local/M + (the previous round's average − the previous Δ_local/M): this site's fresh
    pseudo-gradient stands in for its share, the other sites' one-round-old ones for theirs (in
    the first round there are none yet). Sites' global models differ by their own fresh share
    until :meth:`finish` applies what is still owed and averages them.
    """

    name = "streaming"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        comm: Collectives,
        grad_clip: float,
        cfg: SyncConfig,
        tokens_per_step: int = 1,
    ) -> None:
        super().__init__(model, optimizer, comm, grad_clip, cfg, tokens_per_step)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.F = min(cfg.fragments, len(self.params))
        self.tau = cfg.tau
        self.alpha = cfg.alpha
        self.eager = cfg.eager
        self.fragments = strided_fragments(names, [p.numel() for p in self.params], self.F)
        self.offsets = [(f * self.H) // self.F for f in range(self.F)]
        self.outer = [self._outer_optimizer([self.global_params[i] for i in frag]) for frag in self.fragments]
        self.reducers = [
            SiteReducer(cfg, comm, [self.params[i].shape for i in frag], seed=f) for f, frag in enumerate(self.fragments)
        ]
        self.last_sync = [0] * self.F
        # fragment -> (merge at step, the exchange in flight, its averaged Δ when done)
        self.pending: dict[int, tuple[int, Future[None], torch.Tensor]] = {}
        self.previous: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # eager: (local Δ, its exchange result)
        self._network = ThreadPoolExecutor(1, thread_name_prefix="wan-exchange")

    def after_step(self) -> None:
        super().after_step()
        t = self.local_steps
        if not self.eager:
            for f in [f for f, (at, _, _) in self.pending.items() if at <= t]:
                self._merge(f)
        for f in range(self.F):
            if t % self.H == self.offsets[f] and t > 0 and (self.eager or f not in self.pending):
                self._sync(f, t)

    def budget_exhausted(self) -> bool:
        t = self.local_steps + 1
        due = any(t % self.H == self.offsets[f] for f in range(self.F))
        return due and not self._privacy_allows_round()

    def in_flight_bytes(self) -> int:
        """fp32 bytes of pseudo-gradient fragments whose exchange has not finished."""
        return sum(4 * d.numel() for _, fut, d in self.pending.values() if not fut.done())

    def _start(self, f: int, delta: torch.Tensor, steps: int) -> Future[None]:
        return self._network.submit(self._average_across_sites, delta, self.reducers[f], steps, self.rounds, f)

    def _wait(self, fut: Future[None]) -> None:
        """Block the training thread until ``fut`` is done; the time counts as waiting on the network."""
        t0 = time.perf_counter()
        fut.result()
        self.comm.add_wait(time.perf_counter() - t0)

    def _globals(self, f: int) -> list[torch.Tensor]:
        return [self.global_params[i] for i in self.fragments[f]]

    def _add_others_last_share(self, f: int, into: torch.Tensor) -> None:
        """Eager: add the other sites' part of fragment ``f``'s last exchanged average (average − own
        Δ/M) to ``into``; nothing before the fragment's first exchange."""
        if f in self.previous:
            old_local, old_avg = self.previous[f]
            into.add_(old_avg).sub_(old_local, alpha=1 / self.num_sites)

    @torch.no_grad()
    def _sync(self, f: int, t: int) -> None:
        frag = self.fragments[f]
        delta = pseudo_gradient(self._globals(f), [self.params[i] for i in frag])
        steps = t - self.last_sync[f]
        self.last_sync[f] = t
        if self.eager:
            self.rounds += 1  # for streaming, a round is one fragment's sync
            self._eager_step(f, delta, steps)
            return
        if self.private is not None:
            self.private.reserve()
        fut = self._start(f, delta, steps)
        self.rounds += 1
        self.pending[f] = (t + self.tau, fut, delta)
        if self.tau == 0:
            self._merge(f)

    @torch.no_grad()
    def _merge(self, f: int) -> None:
        _, fut, delta = self.pending.pop(f)
        try:
            self._wait(fut)
        except RoundFailed as exc:
            self._roll_back(self.fragments[f], str(exc))
            return
        globals_ = self._globals(f)
        outer_step_(self.outer[f], globals_, delta)
        for g, i in zip(globals_, self.fragments[f], strict=True):
            p = self.params[i]
            p.mul_(self.alpha).add_(g.to(p.dtype), alpha=1 - self.alpha)

    @torch.no_grad()
    def _eager_step(self, f: int, local: torch.Tensor, steps: int) -> None:
        if f in self.pending:  # last round's exchange of this fragment: it had a whole round
            self._wait(self.pending.pop(f)[1])
        eager = local / self.num_sites
        self._add_others_last_share(f, eager)
        outgoing = local.clone()
        self.pending[f] = (0, self._start(f, outgoing, steps), outgoing)
        self.previous[f] = (local, outgoing)  # ``outgoing`` becomes the average once the exchange is done
        globals_ = self._globals(f)
        outer_step_(self.outer[f], globals_, eager)
        for g, i in zip(globals_, self.fragments[f], strict=True):
            self.params[i].copy_(g)

    def finish(self) -> None:
        """Bring every site onto one model: wait for what is in flight, then (τ variant) merge it and
        sync every fragment with unsynced steps, or (eager) apply what is still owed and average
        the sites' global models."""
        if self.eager:
            self._finish_eager()
        else:
            for f in list(self.pending):
                self._merge(f)
            t = self.local_steps
            for f in range(self.F):
                if self.last_sync[f] < t and not self._privacy_allows_round():
                    self._roll_back(self.fragments[f], "privacy budget: the last partial round is not released")
                    self.last_sync[f] = t
                elif self.last_sync[f] < t:
                    self._sync(f, t)
                    if f in self.pending:
                        self._merge(f)
        self._network.shutdown()

    @torch.no_grad()
    def _finish_eager(self) -> None:
        """Per fragment, one last outer step, blocking: the other sites' shares of the last eager
        round (now arrived) plus, if the fragment trained since its last sync, the exact average of
        the fresh pseudo-gradients; then the sites' global models are averaged."""
        t = self.local_steps
        for f in range(self.F):
            if f in self.pending:
                self._wait(self.pending.pop(f)[1])
            globals_ = self._globals(f)
            step = torch.zeros(sum(g.numel() for g in globals_))
            self._add_others_last_share(f, step)
            if self.last_sync[f] < t:
                delta = pseudo_gradient(globals_, [self.params[i] for i in self.fragments[f]])
                fut = self._start(f, delta, t - self.last_sync[f])
                self._wait(fut)
                step.add_(delta)
                self.last_sync[f] = t
                self.rounds += 1
            outer_step_(self.outer[f], globals_, step)
        self._average_global_models()

    @torch.no_grad()
    def _average_global_models(self) -> None:
        flat = torch.cat([g.reshape(-1) for g in self.global_params])
        self.comm.all_reduce_across_sites(flat)
        flat.div_(self.num_sites)
        for g, v, p in zip(self.global_params, views_like(flat, self.global_params), self.params, strict=True):
            g.copy_(v)
            p.copy_(g)

    def close(self) -> None:
        self._network.shutdown(wait=True)
        super().close()

    def state_dict(self) -> dict[str, Any]:
        return {"reducers": [r.state_dict() for r in self.reducers]}

    def checkpoint_state(self) -> dict[str, Any]:
        """Exchanges in flight are waited for: their averaged Δ and merge step are saved."""
        if self.eager:
            raise ValueError("checkpoints of the eager streaming variant are not supported")
        pending = {}
        for f, (at, fut, delta) in self.pending.items():
            try:
                self._wait(fut)
                pending[f] = (at, delta.clone(), True)
            except RoundFailed:
                pending[f] = (at, delta.clone(), False)  # merging it will roll the fragment back
        return {
            **super().checkpoint_state(),
            "outer": [o.state_dict() for o in self.outer],
            "last_sync": list(self.last_sync),
            "pending": pending,
        }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        super().load_checkpoint_state(state)
        for o, saved in zip(self.outer, state["outer"], strict=True):
            o.load_state_dict(saved)
        self.last_sync = list(state["last_sync"])
        for r, saved in zip(self.reducers, state["reducers"], strict=True):
            r.load_state_dict(saved)
        self.pending = {}
        for f, (at, delta, ok) in state["pending"].items():
            fut: Future[None] = Future()
            if ok:
                fut.set_result(None)
            else:
                fut.set_exception(RoundFailed("the exchange failed before the checkpoint"))
            self.pending[int(f)] = (at, fut, delta)


def build_sync(
    cfg: SyncConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    comm: Collectives,
    *,
    grad_clip: float,
    tokens_per_step: int,
) -> SyncAlgorithm:
    """The algorithm ``cfg.algorithm`` with its settings from the ``sync`` config section."""
    if cfg.algorithm == "ddp":
        return DDP(model, optimizer, comm, grad_clip, cfg.allreduce, cfg)
    cls = StreamingDiLoCo if cfg.algorithm == "streaming" else DiLoCo
    return cls(model, optimizer, comm, grad_clip, cfg, tokens_per_step)
