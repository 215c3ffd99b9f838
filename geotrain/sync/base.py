"""What every sync algorithm shares: the optimizer hooks, flat-buffer helpers, and the
interfaces of the parts it can be given (DP-SGD, private aggregation, elastic membership).

An algorithm registers hooks on the inner optimizer (as torchft's DiLoCo does), so the loop is
only ``zero_grad -> backward -> step``:

* a *step pre-hook* averages gradients before the inner update;
* a *step post-hook* runs the outer synchronisation when one is due.

The privacy and membership parts are described here as protocols, so this package never
imports :mod:`geotrain.privacy` or :mod:`geotrain.elastic`: the composition root
(:mod:`geotrain.run.worker`) builds them and hands them over.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Protocol

import torch
import torch.nn as nn

from geotrain.codecs import Codec, Residual
from geotrain.comm.collectives import Collectives
from geotrain.comm.control import all_gather_json
from geotrain.comm.faults import FaultPlan
from geotrain.comm.groups import is_dtensor
from geotrain.config import LivenessConfig
from geotrain.sync.guard import UpdateGuard


class GradientPrivatizer(Protocol):
    """DP-SGD on the inner steps: per-example gradients of whole tensors
    (:class:`geotrain.privacy.dp.ExampleDP`) or ghost norms of FSDP shards
    (:class:`geotrain.privacy.ghost.GhostClipping`)."""

    def privatize(self) -> torch.Tensor:
        """Whole tensors: this rank's clipped, noised per-example gradient sum of the last backward, flat."""
        ...

    def noise_shards(self, grads: list[torch.Tensor]) -> None:
        """FSDP shards: add this rank's noise to its shards of the site's averaged, clipped gradient."""
        ...


class PrivateAverage(Protocol):
    """Clipping, site-level DP and secure aggregation of pseudo-gradients
    (:class:`geotrain.privacy.aggregation.PrivateAggregation`)."""

    def average(self, delta: torch.Tensor, round_id: int, weights: list[float] | None = None, region: bool = False) -> int:
        """Replace ``delta`` by the average over surviving sites (``region``: of this site's
        region), each weighted by ``weights`` (one per site of the run, public; None: equal); the
        number that survived.

        Raises:
            RoundFailed: the round cannot complete; the caller rolls it back.
        """
        ...

    def reserve(self) -> None:
        """An aggregation was handed to a background exchange (for the budget check)."""
        ...

    def can_afford(self) -> bool:
        """Whether one more aggregation fits the privacy budget (same answer on every rank)."""
        ...


class Running(Protocol):
    """An elastic round whose exchange runs beside compute (``overlap``): finished before the next round."""

    def finish(self) -> int:
        """Wait, agree, vote: the contributors (the average in the membership's ``average``).

        Raises:
            RoundFailed: roll the round back.
        """
        ...


class RoundMembership(Protocol):
    """Elastic mode's cross-site round (:class:`geotrain.elastic.member.SiteMember`)."""

    part: int  # the part of the model the last round summed
    paced: bool  # adaptive pace: sites run different steps, weighted by tokens, and the run ends on rounds
    # sync.adapt: this rank's seconds in the last round after its meeting (exchange and vote), and
    # its ping around the ring (0: it carried nothing)
    measured: tuple[float, float]
    average: torch.Tensor | None  # the last round's average
    split: bool  # the last round that reached its vote committed on some sites only (the next one heals them)
    done: bool  # this site has run its steps and takes part in the others' rounds only (it says so in its claims)
    top: int  # the most committed rounds a member of the last round held
    live: LivenessConfig  # failure detection's timing, every wait's bound

    @property
    def retry_seconds(self) -> float:
        """How long to wait before retrying a postponed round."""
        ...

    def round(
        self,
        delta: torch.Tensor,
        *,
        contribute: bool = True,
        weight: float = 1.0,
        codec: Codec | None = None,
        residual: Residual | None = None,
        part: int = -1,
        rest: int = 0,
        sizes: list[int] | None = None,
        pace: int = 0,
        link: str = "",
        overlap: bool = False,
    ) -> int | Running | None:
        """Average ``delta`` over the admitted sites, each weighted by ``weight``
        (``contribute=False``: this site withdraws its own and takes the others' average),
        encoded with ``codec`` and this rank's error feedback ``residual``; None when postponed.
        ``part``: which part of the model ``delta`` is (a fragment; -1: all of it, or none),
        ``sizes`` this rank's values of each part, ``rest`` the rounds this site still owes after
        this one once its steps are run, ``pace`` its compute microseconds per inner step (adaptive
        pace), ``link`` what it measured in its last committed round (``sync.adapt``). With
        ``overlap`` a round in which no site heals comes back running (:class:`Running`). The round
        sums the part in :attr:`part`; its average is in :attr:`average` (``delta`` itself unless
        the part is another).

        Raises:
            RoundFailed: roll the round back.
        """
        ...

    def next_boundary(self, step: int, H: int, total: int) -> int:
        """After a round (committed or rolled back) at ``step``: the step at which the next round
        ends, the same on every site still training toward ``total`` (sites may meet at different
        steps after a postponed round)."""
        ...

    def furthest(self, step: int, total: int) -> int:
        """The furthest step a site still training toward ``total`` had reached in the last round
        (this site's ``step`` if it is further)."""
        ...

    def all_finished(self, total: int) -> bool:
        """Whether every site of the last round had run its ``total`` steps (adaptive pace: its rounds)."""
        ...

    def fastest_seconds(self) -> float:
        """Adaptive pace: the fastest site's seconds per inner step claimed in the last round (0: none)."""
        ...

    def link_claims(self) -> list[str]:
        """sync.adapt: what each admitted site of the last round claimed to have measured."""
        ...

    def weight(self, steps: int) -> float:
        """This site's weight in a round of ``steps`` inner steps: its tokens where the sites differ
        in size or pace, else 1 (equal sites: a plain mean)."""
        ...

    def note(self, outcome: str, reason: str, global_hash: str, committed: int, step: int) -> None:
        """Record the round's outcome after the caller applied or rolled it back."""
        ...

    def affords(self) -> bool:
        """Whether this site's ε budget (site-level DP) allows one more round."""
        ...


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: its shard of an FSDP2 (DTensor) parameter or gradient, a view
    of the storage FSDP all-gathers from (writes to it are what the next forward sees); else ``t``."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
    locals_ = [local_tensor(p) for p in params]
    return torch.cat(
        [
            (local_tensor(p.grad) if p.grad is not None else torch.zeros_like(t)).reshape(-1)
            for p, t in zip(params, locals_, strict=True)
        ]
    )


def views_like(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views into ``flat`` shaped like each tensor of ``like``, in order (the inverse of a cat)."""
    return [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in like]), like, strict=True)]


def write_grads(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    for p, v in zip(params, views_like(flat, [local_tensor(p) for p in params]), strict=True):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        local_tensor(p.grad).copy_(v)


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


class SyncAlgorithm:
    """Base class: owns the optimizer hooks. Use as a context manager or call :meth:`close`."""

    name = "base"
    F = 1  # fragments synced separately (Streaming DiLoCo: its F)
    lost_sites: Sequence[int] = ()  # sites that died and the run went on without (asynchronous quorum rounds)

    @property
    def world_broken(self) -> bool:
        """A site died since the start, so the world group holds dead ranks and must not be used."""
        return bool(self.lost_sites)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Collectives, grad_clip: float) -> None:
        self.model = model
        self.optimizer = optimizer
        self.comm = comm
        self.grad_clip = grad_clip
        self.params = [p for p in model.parameters() if p.requires_grad]
        # sync.within_site=fsdp: each rank holds a shard of every parameter (DTensors on the site's
        # mesh), FSDP averages gradients inside the site, and pseudo-gradients, outer state and
        # cross-site exchanges are per shard (local rank i holds the same part in every site)
        self.sharded = any(is_dtensor(p) for p in self.params)
        self.resharded = False  # FSDP over sites of different sizes (:class:`~geotrain.round.outer.OuterSync`)
        self.local_steps = 0
        self.rounds = 0
        self.checkpoint_every = 0  # checkpoint.every (asynchronous quorum rounds plan a barrier round before each)
        self.region_rounds = 0  # multi-tier sync: rounds inside the region (rounds counts the world tier's)
        self.rounds_rolled_back = 0
        self.example_dp: GradientPrivatizer | None = None  # DP-SGD on the inner steps (privacy.dp.unit=example)
        self.guard: UpdateGuard | None = None  # leaves non-finite / outlier pseudo-gradients out (DiLoCo, streaming)
        self.faults = FaultPlan()  # failure injection (nothing, unless a test or a soak plans it)
        self._handles = [
            optimizer.register_step_pre_hook(lambda *_: self.sync_gradients()),
            optimizer.register_step_post_hook(lambda *_: self.after_step()),
        ]

    def sync_gradients(self) -> None:
        """Average gradients as the algorithm requires. Called by the optimizer before each step."""
        raise NotImplementedError

    def local_params(self) -> list[torch.Tensor]:
        """This rank's part of each trainable parameter: the whole tensor, or its FSDP shard."""
        return [local_tensor(p) for p in self.params]

    def full_tensors(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Whole tensors from ``tensors`` laid out like :meth:`local_params` (sharded: an all-gather
        in the site, so every rank of the site calls it together)."""
        if not self.sharded:
            return tensors
        from torch.distributed.tensor import DTensor

        return [
            DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
            if isinstance(p, DTensor)
            else t
            for t, p in zip(tensors, self.params, strict=True)
        ]

    def shards_out(self, x: torch.Tensor | Sequence[torch.Tensor] | None, which: Sequence[int] | None = None) -> Any:
        """For a checkpoint: state laid out like the local parts of parameters ``which`` (all when
        None), given as a list of tensors or their flat concatenation, as DTensors placed like those
        parameters, so DCP can reshard it (docs/SCALE.md). Unchanged when not sharded."""
        if not self.sharded or x is None:
            return x
        params = [self.params[i] for i in (range(len(self.params)) if which is None else which)]
        pieces = views_like(x, [local_tensor(p) for p in params]) if isinstance(x, torch.Tensor) else list(x)
        from torch.distributed.tensor import DTensor

        return [
            DTensor.from_local(t.clone(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)
            if isinstance(p, DTensor)
            else t.clone()
            for t, p in zip(pieces, params, strict=True)
        ]

    def _whole(self, delta: torch.Tensor, which: Sequence[int]) -> torch.Tensor:
        """Values laid out like this rank's parts of the parameters ``which``, whole: under FSDP
        gathered in the site (every rank together); else ``delta`` itself."""
        if not self.sharded:
            return delta
        from torch.distributed.tensor import DTensor

        local = [self.local_params()[i] for i in which]
        params = [self.params[i] for i in which]
        whole = [
            DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
            if isinstance(p, DTensor)
            else t
            for t, p in zip(views_like(delta, local), params, strict=True)
        ]
        return torch.cat([w.reshape(-1) for w in whole])

    def _own_values(self, wire: torch.Tensor, which: Sequence[int]) -> list[torch.Tensor]:
        """This rank's part of each of the parameters ``which`` in the whole flat ``wire`` (FSDP:
        its shards, cut where FSDP cuts them, without communication)."""
        params = [self.params[i] for i in which]
        if not self.sharded:
            return views_like(wire, params)
        from torch.distributed.tensor import DTensor, distribute_tensor

        return [
            distribute_tensor(w, p.device_mesh, p.placements, src_data_rank=None).to_local() if isinstance(p, DTensor) else w
            for w, p in zip(views_like(wire, params), params, strict=True)
        ]

    @staticmethod
    def shards_in(saved: Any, flat: bool = False) -> Any:
        """The inverse of :meth:`shards_out` on what a checkpoint gave back (resharded by DCP to this
        rank's parts): the local tensors, or their flat concatenation when ``flat``."""
        if not isinstance(saved, list) or not saved:
            return saved
        if not any(is_dtensor(t) for t in saved):  # (a heal's shards arrive as local tensors)
            return torch.cat([t.reshape(-1) for t in saved]) if flat else saved
        local = [local_tensor(t) for t in saved]
        return torch.cat([t.reshape(-1) for t in local]) if flat else local

    def optim_out(self, state: dict[str, Any], which: Sequence[int] | None = None) -> dict[str, Any]:
        """An outer optimizer's ``state_dict`` over the parameters ``which`` with its per-parameter
        tensors as DTensors (:meth:`shards_out`)."""
        if not self.sharded:
            return state
        idx = list(range(len(self.params)) if which is None else which)
        per_param = {
            k: {
                n: self.shards_out([v], [idx[int(k)]])[0] if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                for n, v in s.items()
            }
            for k, s in state["state"].items()
        }
        return {**state, "state": per_param}

    @staticmethod
    def optim_in(state: dict[str, Any]) -> dict[str, Any]:
        per_param = {k: {n: local_tensor(v) for n, v in s.items()} for k, s in state["state"].items()}
        return {**state, "state": per_param}

    def reducer_out(self, reducer: Any, which: Sequence[int] | None = None) -> dict[str, Any] | None:
        """A :class:`SiteReducer`'s state with its error-feedback residual as per-parameter DTensors."""
        if reducer is None:
            return None
        state: dict[str, Any] = reducer.state_dict()
        if self.resharded:  # (its residual is a part of the whole vector, as with replicated sites)
            return state
        return {**state, "residual": self.shards_out(state["residual"], which)}

    @classmethod
    def reducer_in(cls, state: Any) -> Any:
        return None if state is None else {**state, "residual": cls.shards_in(state["residual"], flat=True)}

    def _noise_shards(self) -> None:
        """DP-SGD on a sharded model: FSDP's reduce-scatter has averaged the per-example clipped
        gradients over the site; each rank adds its noise to its own shards."""
        if self.example_dp is not None:
            self.example_dp.noise_shards([local_tensor(p.grad) for p in self.params if p.grad is not None])

    def _clip_sharded(self) -> None:
        """Clip the (already averaged) gradients by their global norm; FSDP's DTensor gradients
        make ``clip_grad_norm_`` sum the squared norms over the site. (Not under DP-SGD, which
        clips each example's gradient, as with whole tensors.)"""
        if self.grad_clip > 0 and self.example_dp is None:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)

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

    def add_compute(self, seconds: float) -> None:
        """Account one inner step's compute time on this rank (the loop calls it after backward):
        what adaptive rounds measure step rates from."""

    def set_limits(self, steps: int, max_seconds: float) -> None:
        """The run's length: ``steps`` inner steps, or ``max_seconds`` of training (0: none)."""

    @property
    def done(self) -> bool:
        """Whether the run ended at the last step's round boundary (the same on every rank)."""
        return False

    def step_limit(self, steps: int) -> int:
        """How many steps the loop may run at most (adaptive rounds end it through :attr:`done`)."""
        return steps

    def eval_due(self, step: int, every: int) -> bool:
        """Whether to evaluate after ``step`` (collective: every rank must answer the same)."""
        return step % every == 0

    def checkpoint_due(self, step: int, every: int) -> int | None:
        """Whether to checkpoint after ``step`` (every rank answers alike): the checkpoint's label
        (the step its folder is named by, the same on every rank), else None."""
        return step if step % every == 0 else None

    def pace_log(self) -> list[dict[str, Any]]:
        """Each round boundary's measured step rates and the inner steps chosen for the next round."""
        return []

    def gather_records(self, record: Any) -> list[Any]:
        """Every rank's ``record`` (JSON: the world group crosses sites, so never a pickle), on every
        rank (control plane, the world group)."""
        return all_gather_json(record, self.comm.groups.world)

    def adapt_log(self) -> list[dict[str, Any]]:
        """``sync.adapt``: each round's measured link and the H and codec chosen for the next round."""
        return []

    def world_steps(self, step: int) -> int:
        """Inner steps run by all ranks together when this rank has run ``step`` (for token counts)."""
        return step * self.comm.groups.topology.world_size

    def budget_exhausted(self) -> bool:
        """True when the next step would start a round the privacy budget cannot pay for (then the
        training loop stops; the answer is the same on every rank)."""
        return False

    def global_parameters(self) -> list[torch.Tensor]:
        """The parameters every site agrees on (the model to evaluate and save), laid out like
        :meth:`local_params`."""
        return [p.detach() for p in self.local_params()]

    def global_hash(self) -> str:
        """sha256 of the whole global model (sharded: gathered in the site; every rank calls it)."""
        return params_hash(self.full_tensors(self.global_parameters()))

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
