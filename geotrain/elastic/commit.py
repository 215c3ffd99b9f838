"""The end of an elastic round on one site: its ranks agree, vote and take the result.

What this module holds, all called by every rank of the site:

* :class:`Contribution`: what a site puts into a round (its update's weight, the codec and this
  rank's error feedback);
* :func:`span`: which values of the pseudo-gradient a local rank carries across sites (the first
  ``carriers`` ranks, a contiguous part each, so the same local rank exists at every site);
* :func:`share_in_site`: the healing state, received once per site by local rank 0, handed to
  the site's other ranks;
* :func:`gather_site`: the carried parts of the round's sum, gathered back into the whole vector
  on every rank of the site;
* :func:`vote`: local rank 0 writes the site's signed vote and reads everyone's; the round
  commits only if every admitted site said yes; then each site says what it decided, and
  learns whether another decided otherwise.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from geotrain.comm.identity import Identity
from geotrain.elastic.auth import SealedStore
from geotrain.elastic.meeting import ballot, said_yes
from geotrain.elastic.roundstore import Monitor, wait_keys
from geotrain.elastic.view import RoundView
from geotrain.errors import RoundFailed

TRAILER = 2  # a carried part ends with the site's weight and its contributor count (fp32, never encoded)


class Encoder(Protocol):
    """A byte codec (:class:`geotrain.codecs.Codec`), as the exchange uses it."""

    @property
    def reduce(self) -> str:
        """'scatter' (the owner of a chunk re-encodes its sum) or 'gather' (every site sends its own)."""
        ...

    @property
    def sender_mean(self) -> bool:
        """Whether a round averages each coordinate over the sites that sent it (SparseLoCo)."""
        ...

    def encoded_nbytes(self, n: int) -> int: ...

    def encode(self, x: torch.Tensor) -> torch.Tensor: ...

    def decode(self, buf: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor: ...


class Feedback(Protocol):
    """A rank's error-feedback state (:class:`geotrain.codecs.Residual`)."""

    tensor: torch.Tensor | None

    def keep(self, left_out: torch.Tensor | None) -> None:
        """Keep what a round's encoding left out for the next (decayed; None: nothing)."""


class Masker(Protocol):
    """Secure aggregation inside a round (:class:`geotrain.privacy.masking.PairMasks`)."""

    def encode(self, x: torch.Tensor, start: int, me: str, pair_keys: dict[str, bytes], context: bytes) -> torch.Tensor:
        """Fixed point plus the pair masks with every peer (int32)."""
        ...

    def decode(self, q: torch.Tensor) -> torch.Tensor: ...

    def add_(self, acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """acc ← acc + x mod 2^32."""
        ...


class Noise(Protocol):
    """Site-level DP inside a round (:class:`geotrain.privacy.dp.RoundNoise`)."""

    def clip_scale(self, norm: float) -> float: ...

    def privatize_(self, part: torch.Tensor, scale: float) -> None: ...

    def spend(self) -> None: ...

    def at_least(self, rounds: int) -> None: ...

    def affords(self) -> bool: ...


def site_dp(
    noise: Noise | None, delta: torch.Tensor, sends: bool, sharded: bool, intra: Any
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Site-level DP for one round, on every rank of the site: the site's whole update is clipped
    (its norm, under FSDP, a sum over the site's shards) and each carried part noised once; the
    round is counted if the site ``sends`` an update. Returns what to apply to this rank's part."""
    if noise is None:
        return lambda part: part
    sq = delta.detach().to("cpu", torch.float64).pow(2).sum().reshape(1)
    if sharded:
        dist.all_reduce(sq, group=intra)
    scale = noise.clip_scale(float(sq.sqrt()))
    if not sends:
        return lambda part: part
    noise.spend()

    def apply(part: torch.Tensor) -> torch.Tensor:
        noise.privatize_(part, scale)
        return part

    return apply


WEIGHT_UNIT = 1 << 16  # a masked round's weights travel as integers of this many parts


def carried(
    part: torch.Tensor,
    weight: float,
    contributes: bool,
    masker: Masker | None,
    factor: float,
    where: tuple[int, str, Any, int, list[str]],
) -> torch.Tensor:
    """What a carrying rank sends: its ``part`` of the pseudo-gradient times ``weight``, then the
    weight and 1 (zeros if it does not contribute), fp32. With a ``masker`` (secure aggregation):
    the part times ``factor`` (rounded to 1/WEIGHT_UNIT), masked with every admitted peer of the
    round's ring, zeros masked all the same if it does not contribute (the masks cancel only if
    every site adds its own), then the weight and count as plain int32. ``where``: the part's
    first value, this site, the round's view, this local rank and the sites the round sums over."""
    if masker is None:
        carry = torch.zeros(part.numel() + TRAILER)
        if contributes:
            carry[:-TRAILER] = part if weight == 1.0 else part * weight
            carry[-TRAILER:] = torch.tensor([weight, 1.0])
        return carry
    start, me, view, local, ring = where
    on = contributes and weight > 0
    w = round(factor * WEIGHT_UNIT) if on else 0
    x = part * (w / WEIGHT_UNIT) if on else torch.zeros_like(part)
    keys = {s: k for s, k in view.frame_keys.items() if s in ring}
    masked = masker.encode(x, start, me, keys, f"{view.round_id}|{local}".encode())
    return torch.cat([masked, torch.tensor([w, int(on)], dtype=torch.int32)])


def unmasked(masker: Masker, carry: torch.Tensor) -> torch.Tensor:
    """A secure round's summed carry as fp32: the decoded values, then the weights and count."""
    total = carry[-TRAILER:].to(torch.float32) / torch.tensor([WEIGHT_UNIT, 1.0])
    return torch.cat([masker.decode(carry[:-TRAILER]), total])


@dataclass
class Contribution:
    """What this site puts into a round: whether it contributes, its weight, the codec and this
    rank's error feedback."""

    contribute: bool = True
    weight: float = 1.0
    codec: Encoder | None = None
    residual: Feedback | None = None


def span(n: int, local: int, carriers: int) -> tuple[int, int]:
    """The values ``[lo, hi)`` of a vector of ``n`` that local rank ``local`` carries across
    sites: a contiguous, ceil-sized 1/carriers of it; empty beyond the carriers."""
    c = -(-n // carriers)
    return (min(n, local * c), min(n, (local + 1) * c)) if local < carriers else (n, n)


def share_in_site(blob: bytes | None, local: int, workers: int, intra: Any, own: bool = False) -> bytes | None:
    """Local rank 0's healing bytes (complete, or None) to every rank of the site: the state
    crosses sites once per site, not once per rank. ``own`` (sharded): each rank received its own
    shards; they are kept only if every rank of the site has its own (else None everywhere)."""
    if workers == 1:
        return blob
    if own:
        have = torch.tensor([0.0 if blob is None else 1.0])
        dist.all_reduce(have, op=dist.ReduceOp.MIN, group=intra)
        return blob if have.item() else None
    size = torch.tensor([len(blob) if blob is not None and local == 0 else 0], dtype=torch.int64)
    dist.broadcast(size, src=0, group=intra)
    n = int(size.item())
    if not n:
        return None
    if local == 0:
        assert blob is not None
        dist.broadcast(torch.frombuffer(bytearray(blob), dtype=torch.uint8), src=0, group=intra)
        return blob
    data = torch.empty(n, dtype=torch.uint8)
    dist.broadcast(data, src=0, group=intra)
    return data.numpy().tobytes()


def gather_site(carry: torch.Tensor, n: int, carriers: int, workers: int, intra: Any) -> torch.Tensor:
    """The whole summed vector of ``n`` values followed by the :data:`TRAILER`, on every rank of
    the site, from each carrier's ``carry`` (its part, then the trailer). Gloo's all-gather wants
    equal parts: each is padded to the largest."""
    c = -(-n // carriers) + TRAILER
    mine = torch.zeros(c)
    mine[: carry.numel() - TRAILER] = carry[:-TRAILER]
    mine[-TRAILER:] = carry[-TRAILER:]
    gathered = [torch.empty(c) for _ in range(workers)]
    dist.all_gather(gathered, mine, group=intra)
    parts = [gathered[j][: hi - lo] for j, (lo, hi) in enumerate(span(n, j, carriers) for j in range(carriers))]
    return torch.cat([*parts, gathered[0][-TRAILER:]])


def vote(
    prefix: SealedStore,
    view: RoundView,
    monitor: Monitor | None,
    ok: bool,
    *,
    site: str,
    local: int,
    identity: Identity | None,
    intra: Any,
    timeout_s: float,
    log: Callable[[str], None],
    deaf: bool = False,
) -> tuple[bool, bool]:
    """Local rank 0 writes this site's vote and reads everyone's; the round commits only if every
    admitted site voted yes. Then it writes what it decided and, if it voted yes, waits, its
    heartbeats still going, until every admitted site has decided too (a peer that goes silent
    ends the wait).
    Returns whether the round commits here and whether a site decided otherwise (a *split*: the
    round committed on some sites only; the next round heals them, and a run's last round is
    followed by one more). The site's ranks agree on both. ``deaf``: failure injection
    (``fault.split``): this site misses the others' votes after its own."""
    decision = torch.zeros(2)
    refused = not ok  # a no was cast (ours, or one read): no site can commit this round
    if local == 0:
        try:
            prefix.set(f"vote/{site}", ballot(identity, view.round_id, site, ok))
            assert monitor is not None  # local rank 0 always carries a part, so it watches its peers
            if deaf:
                raise RoundFailed("fault.split: this site missed the others' votes")
            if ok:  # a no (ours, or any seen) settles it at once; a yes needs every vote
                keys = [f"vote/{s}" for s in view.admitted]
                yes: dict[str, bool] = {}

                def said_no(k: str) -> bool:
                    yes[k] = said_yes(identity, view.round_id, k.split("/", 1)[1], prefix.get(k))
                    return not yes[k]

                wait_keys(prefix, keys, time.monotonic() + timeout_s, monitor, stop_if=said_no)
                decision[0] = float(all(yes.get(k, False) for k in keys))
                refused = not all(yes.values())
        except RoundFailed as exc:  # a peer went silent while the votes were read: no commit
            log(f"round {view.key}: the vote ended without a decision ({exc}): no commit")
        except Exception as exc:  # noqa: BLE001 - the store failed: no commit, and the reason is in the log
            first = str(exc).splitlines()[0][:160] if str(exc) else ""
            log(f"round {view.key}: the vote failed ({type(exc).__name__}: {first}; round store {view.meeting}): no commit")
        decision[1] = float(_decided_otherwise(prefix, view, monitor, refused, bool(decision[0]), site, identity, timeout_s))
    dist.broadcast(decision, src=0, group=intra)
    return bool(decision[0].item()), bool(decision[1].item())


def _decided_otherwise(
    prefix: SealedStore,
    view: RoundView,
    monitor: Monitor | None,
    refused: bool,
    mine: bool,
    site: str,
    identity: Identity | None,
    timeout_s: float,
) -> bool:
    """Whether an admitted site decided the round otherwise than this one, which decided ``mine``.
    Without this wait a site that decided first stopped its heartbeats, and a peer still reading
    the votes could take that silence for a failure and roll back a round the first had committed;
    after the run's last round nothing healed that. A site that voted no, or read a no
    (``refused``), waits for nobody: no site can commit without every yes, and every site reads
    the same votes. (In two tiers a region whose own sum went well votes yes while the site that
    failed is in another region: it reads that region's no and rolls back at once, instead of
    waiting out the dead site's silence.) A peer whose decision cannot be read (silent, or the
    store gone) counts as agreeing: it failed, and a site that comes back heals."""
    try:
        prefix.set(f"decided/{site}", ballot(identity, view.round_id, site, mine, "decided"))
        keys = [f"decided/{s}" for s in view.admitted if s != site]
        if refused or monitor is None:
            return False
        got = None
        if monitor.failed is None:
            with contextlib.suppress(RoundFailed):
                got = wait_keys(prefix, keys, time.monotonic() + timeout_s, monitor)
        if got is None:  # a peer fell silent (before or during this wait): it may have stalled and decided, read once more
            got = wait_keys(prefix, keys, time.monotonic() + monitor.timeout)
        return any(said_yes(identity, view.round_id, k.split("/", 1)[1], prefix.get(k), "decided") != mine for k in got)
    except Exception:  # noqa: BLE001 - the store's host is gone: nothing more can be learnt
        return False
