"""What the engine's parts share: the state of one site's rounds, declared once.

:class:`~geotrain.round.engine.RoundEngine` is assembled from parts that each own one
responsibility (the fixed world's exchange, a healing membership's rounds, a hub's, network
adaptation, the eager variant, checkpoints); they read and write this state, which the engine
creates. The methods declared here for the type checker are the engine's.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from geotrain.comm.faults import FaultPlan
from geotrain.comm.threads import DaemonPool
from geotrain.config import SyncConfig
from geotrain.round.adapt import NetworkAdapter
from geotrain.round.fixed import FixedWorld
from geotrain.round.hub import Hub
from geotrain.round.outer import Globals
from geotrain.round.pace import RoundClock
from geotrain.round.parts import WORLD, InFlight
from geotrain.round.schedule import Schedule
from geotrain.sync.base import PrivateAverage, RoundMembership, SyncAlgorithm
from geotrain.sync.guard import UpdateGuard
from geotrain.sync.reducer import SiteReducer

T = TypeVar("T")


class EngineCore(SyncAlgorithm):
    """The state of one site's rounds (see the module docstring)."""

    cfg: SyncConfig
    members: FixedWorld
    private: PrivateAverage | None
    guard: UpdateGuard | None
    faults: FaultPlan
    elastic: RoundMembership | None = None  # a healing membership, attached when the site joins
    schedule: Schedule
    globals: Globals
    global_params: list[torch.Tensor]
    clock: RoundClock
    adapter: NetworkAdapter | None
    inflight: dict[int, InFlight]
    previous: dict[int, tuple[torch.Tensor, torch.Tensor]]
    _reducers: dict[tuple[str, int, int, str], SiteReducer]
    _network: DaemonPool
    num_sites: int
    me: int
    site_workers: int
    region_name: str
    tiers: bool
    streaming: bool
    eager: bool
    overlaps: bool
    resharded: bool
    heals: bool  # the membership may replace this site's state in a round (elastic rounds)
    every: int
    tau: int
    alpha: float
    codec: str
    in_slot: int
    slots: int
    contributors: int
    rollback_reasons: list[str]
    region_syncs: list[int]
    _since: list[list[int]]
    _since_world: list[list[int]]
    _finishing: bool
    _decision: tuple[int, Future[bool]] | None
    _exchanges: list[tuple[int, float]]
    _lap_step: int
    _total_steps: int
    hub: Hub | None = None  # asynchronous quorum rounds: this site's side of the hub

    if TYPE_CHECKING:  # the engine's methods its parts call

        @property
        def H(self) -> int: ...
        @property
        def F(self) -> int: ...  # type: ignore[override]
        def reducer(self, f: int, tier: str = WORLD) -> SiteReducer: ...
        def _settle(self, f: int) -> None: ...
        def _wait(self, fut: Future[T]) -> T: ...
        def _control(self, fn: Any, *args: Any) -> Any: ...
        def _key(self, f: int) -> int: ...
        def _per(self, steps: int) -> int: ...
        def _note_rollback(self, why: str) -> None: ...
        def _privacy_allows_round(self) -> bool: ...
        def _rebuild(self, H: int, F: int, t: int) -> None: ...
        def _flat_job(self, f: int, delta: torch.Tensor, counts: list[int], steps: int, round_id: int) -> Any: ...
        def _wire(self, delta: torch.Tensor, f: int) -> torch.Tensor: ...
