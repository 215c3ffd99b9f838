"""One elastic round after its meeting: what a site sends, the exchange, and the end of the round.

:meth:`RunningRound.start` (training thread) prepares everything the exchange thread reads (this
site's weighted, maybe masked and noised part; the healing state it sends as a source) and starts
the exchange (:class:`geotrain.elastic.exchange.Exchange`). :meth:`RunningRound.finish` (training
thread) waits for it while the peers' heartbeats are watched, loads a healer's state, agrees in
the site, gathers the carried parts, votes, and returns the contributors or raises RoundFailed.

Between the two the training thread may run inner steps: a round in which no site heals can be
finished τ steps later (Streaming DiLoCo's overlap), its exchange then running beside compute.
A round that heals anyone finishes at once: a heal replaces the healer's state at the round's
start, before any further step. The caller finishes one round before it opens the next.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from geotrain.elastic import commit
from geotrain.elastic import view as views
from geotrain.elastic.auth import SealedStore
from geotrain.elastic.commit import TRAILER, Contribution
from geotrain.elastic.exchange import Exchange, backstop
from geotrain.elastic.records import append_record
from geotrain.elastic.view import RoundView, group_key
from geotrain.errors import ROUND_FAILURES, MembershipRefused, RoundFailed

if TYPE_CHECKING:
    from geotrain.comm.authstore import AuthStore
    from geotrain.elastic.roundstore import Monitor


@dataclass
class RunningRound:
    """A round between its meeting and its vote (see the module docstring)."""

    member: Any  # the site's :class:`geotrain.elastic.member.SiteMember`
    delta: torch.Tensor
    view: RoundView
    store: AuthStore
    monitor: Monitor | None
    close: Any  # stops the heartbeat watch
    what: Contribution
    counters: tuple[float, int, int, int]  # (start, bytes, fp32 bytes, bytes across regions) at the round's start
    x: Exchange | None = None
    late: int = 0
    round_store: SealedStore | None = None
    carry: torch.Tensor | None = None
    blocked: float = 0.0  # seconds the training thread waited on this round
    step: int = 0  # this site's step when the round opened (what failure injection names)

    def start(self) -> None:
        m, view, delta, what = self.member, self.view, self.delta, self.what
        self.step = m.hooks.step()
        finite = what.contribute and bool(torch.isfinite(delta).all())
        if not finite and what.weight == 0:
            m.log("this site takes part in the round without an update (its steps are run, or synced in another tier)")
        elif not finite:
            m.log("pseudo-gradient withdrawn from this round (" + ("not finite)" if what.contribute else "update guard)"))
        self.late = views.late_by(view, m.site) if m.stale_power is not None else 0  # quorum rounds: its update counts
        contributes = finite and (m.site not in view.healers or self.late > 0)
        what.weight *= (1.0 + self.late) ** -(m.stale_power or 0.0) if contributes else 1.0
        lo, hi = (0, delta.numel()) if m.sharded else commit.span(delta.numel(), m.local, m.carriers)
        ring = views.tier_ring(view, m.site, m.region_of, m.order)  # the round's sites in exchange order
        carry = torch.zeros(hi - lo + TRAILER)  # Gloo: CPU, also under NCCL; then this site's weight and count
        dp = commit.site_dp(m.noise, delta, contributes and what.weight > 0, m.sharded, m.intra)  # every rank
        if m.carries:  # secure: a masked part's weight is its share of the largest site's tokens (at most 1)
            factor = 1.0 if what.weight == 1.0 else m.workers[m.site_index] / max(m.workers)
            part = dp(delta.detach().reshape(-1)[lo:hi].to("cpu", torch.float32))
            where = (lo, m.site, view, m.local, ring)  # masks cancel over the sites summed
            carry = commit.carried(part, what.weight, contributes, m.masker, factor, where)
        self.carry = carry
        outgoing = None
        if view.healed_by(m.site) and (m.local == 0 or m.collective):
            only_late = m.hooks.global_state is not None and views.all_late(view, m.site)  # quorum rounds: the global part
            state = m.hooks.global_state() if only_late else m.hooks.state()
            if m.local == 0 or m.sharded:
                buf = io.BytesIO()
                torch.save(state, buf)
                outgoing = buf.getvalue()
        self.round_store = SealedStore(self.store, m.keys, f"round/{view.round_id}", m.log)  # rendezvous and votes
        if self.monitor is not None:
            self.x = self._exchange(carry, outgoing, ring)
            self.x.start()

    def _exchange(self, carry: torch.Tensor, outgoing: bytes | None, ring: list[str]) -> Exchange:
        m, view, what = self.member, self.view, self.what
        if m._pg is not None and m._pg[0] != group_key(view):
            m._drop_group()  # a new membership gets a new group (a restarted site has a new store address)
        residual = what.residual.tensor if what.residual is not None else None
        if residual is not None and residual.numel() != carry.numel() - TRAILER:
            raise ValueError(f"error-feedback residual of {residual.numel()} values for a part of {carry.numel() - TRAILER}")
        assert self.monitor is not None and self.round_store is not None
        return Exchange(
            view, m.site, m.local, m.names, m.wan, self.monitor, self.round_store,
            m._pg[1] if m._pg is not None else None, carry, outgoing,
            lambda nbytes: backstop(m.slowest_link, m.live, nbytes, len(view.admitted)), m.live.collective_timeout_s, m._count,
            m.on_mid_round, tamper=m.faults.tampers(self.step), heals=m.local == 0 or m.sharded,
            codec=what.codec, error_feedback=what.residual is not None, residual=residual,
            add=m.masker.add_ if m.masker is not None else None, ping=m.ping, ring=ring,
        )  # fmt: skip

    def finish(self) -> int:
        """Wait for the exchange, heal, agree in the site, vote; the contributors (the average in
        ``member.average``), or RoundFailed on every site alike."""
        t0 = time.monotonic()
        try:
            return self._finish()
        finally:
            self.close()
            self.blocked += time.monotonic() - t0
            self.member._account(self)

    def _finish(self) -> int:
        m, view, what, x = self.member, self.view, self.what, self.x
        assert self.carry is not None and self.round_store is not None
        carry, ok, why, heal_blob = self.carry, torch.ones(1), "", None
        if x is not None and self.monitor is not None:
            finished = x.wait()
            m._current.update(exchange_s=x.seconds, seal_s=x.seal_seconds, open_s=x.open_seconds, ping_s=x.ping_s)
            m.raw_bytes += x.raw_bytes
            if not finished:
                ok.zero_()
                why = self.monitor.failed or "aborted"
                m._drop_group()
            else:
                carry = commit.unmasked(m.masker, carry) if m.masker is not None and x.error is None else carry.float()
                m._pg = (group_key(view, 1), x.group) if x.group is not None else None  # (for the next round)
                if x.error is not None:
                    ok.zero_()
                    if isinstance(x.error, MembershipRefused) or not isinstance(x.error, ROUND_FAILURES):
                        raise x.error  # refused, or a bug in the exchange: stop, do not roll back as if a peer failed
                    first = str(x.error).splitlines()[0][:100] if str(x.error) else type(x.error).__name__
                    why = str(x.error) if isinstance(x.error, RoundFailed) else f"collective failed ({first})"
            heal_blob = x.heal_blob
        if m.site in view.healers:  # complete: the source's state at the start of this round
            heal_blob = commit.share_in_site(heal_blob, m.local, m.G, m.intra, own=m.sharded)
            if heal_blob is not None:
                load_healing(m, heal_blob, view.source_of(m.site), whole=not self.late)
                if what.residual is not None and not self.late:  # a healed site starts its error feedback afresh
                    what.residual.tensor = None
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=m.intra)
        if ok.item() and m.G > 1 and not m.sharded:  # the site's ranks gather the carried parts
            carry = commit.gather_site(carry, self.delta.numel(), m.carriers, m.G, m.intra)
        committed, m.split = commit.vote(
            self.round_store, view, self.monitor, bool(ok.item()), site=m.site, local=m.local, identity=m.identity,
            intra=m.intra, timeout_s=m.live.collective_timeout_s, log=m.log, deaf=m.faults.splits(self.step),
        )  # fmt: skip
        if not committed or m.split:  # on every site of the round alike (split: some committed): a new group next round
            m._drop_group()
        if not committed:
            m._stores.forget(view.meeting)
            reason = (
                why or (self.monitor.failed if self.monitor is not None else None) or "a participant did not confirm the round"
            )
            if m.local == 0:
                m.log(f"round {view.key} rolled back: {reason} (round store {view.meeting})")
            raise RoundFailed(reason)
        if x is not None and what.residual is not None and (m.site not in view.healers or self.late):
            what.residual.keep(x.residual)  # the round committed: keep what its encoding left out
        total, count = (float(v) for v in carry[-TRAILER:].tolist())
        if (count < 0.5 or total <= 0) and not views.region_round(view, m.region_of):
            raise RoundFailed("no site contributed to the round")  # (tiers: a region of sites that healed or sat out sums 0)
        divisor = m.world_weight or (total if total > 0 else 1.0)  # quorum rounds: a whole world round's weight
        m.average = self.delta.copy_(carry[:-TRAILER].to(self.delta.device).view_as(self.delta)).div_(divisor)
        m._current.update(contributors=int(round(count)), weight=total, **({"late": self.late} if self.late else {}))
        return int(m._current["contributors"])


def load_healing(m: Any, blob: bytes, source: str, whole: bool = True) -> None:
    """Training thread: load the state a source sent. From now on the site holds a valid state (the
    source's at the round's start, which a rollback returns to), so it is no longer joining: it can
    be a heal source for others even if this round fails. Not ``whole`` (a late site of quorum
    rounds): only the global part (``hooks.load_global``); its own steps go on."""
    state = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    if whole or m.hooks.load_global is None:
        m.hooks.load(state)
        m.healed_at_step = int(state["step"])
    else:
        m.hooks.load_global(state)
    m.joining = False
    if m.local == 0:
        what = "" if whole else " (its global model only: this site's update was late)"
        m.log(f"healed from {source}: {state['committed']} committed rounds, step {state['step']}{what}")


def record(m: Any, outcome: str, reason: str, global_hash: str, committed: int, step: int) -> None:
    """The round's outcome (after the caller applied or rolled it back): one JSON line."""
    rec = {**m._current, "end": time.monotonic(), "wall_end": time.time(), "outcome": outcome, "reason": reason}
    rec.update(site=m.site, hash=global_hash, committed=committed, step=step)
    m._current = {}
    if m.record_file is not None:
        append_record(m.record_file, rec)
