"""Secure aggregation of pseudo-gradients across sites (Bonawitz et al. 2017; SecAgg+ graph of
Bell et al. 2020), over geotrain's own inter-site transport.

What it guarantees: the sum over the surviving sites of their (clipped, fixed-point encoded)
vectors is what every site ends up with; no participant — including the one that adds up a
chunk — sees any single site's vector, only values masked by one-time pads that cancel in the
sum. Masks of sites that drop out after key agreement are removed with Shamir shares held by
the survivors, so the round completes with the survivors; below the threshold it fails cleanly
(:class:`SecAggAborted`) and the caller rolls the round back.

Threat model: honest-but-curious sites (they follow the protocol but may look at what they
receive), at most ``threshold - 1`` of them colluding. Not covered: a malicious site that lies
about who dropped (needs the signed variant of the paper), or traffic analysis. Tensors on the
wire are masked; key shares are encrypted (AES-GCM) between the two sites that hold them.

One round, per local rank ``i`` (every local rank runs it on its 1/G shard of the vector with
local rank ``i`` of the other sites; N participants, neighbours from :func:`neighbours`):

0. *advertise keys*: two fresh X25519 key pairs (c for encrypting shares, s for masks); the
   public keys go to every participant.
1. *share keys*: a fresh 32-byte self-mask seed b_u and the mask private key s_u are each
   Shamir-shared (threshold t, prime field 2^521 - 1) among u and its neighbours; each share is
   encrypted for its holder with AES-GCM under HKDF(X25519(c_u, c_v)).
2. *masked input*: y_u = q(x_u) + PRG(b_u) + Σ_{v∈nb(u)} ±PRG(HKDF(X25519(s_u, s_v))) mod 2^32,
   where q is fixed point with ``frac_bits`` fractional bits; PRG is AES-256-CTR. y_u is cut into
   N chunks and chunk j goes to participant j in a framed message (magic, round, length, ring
   bits, flags); a frame that does not match is *malformed* and its sender is excluded.
3. *consistency*: every participant tells every other whose chunk it accepted; the survivors U
   are the senders everyone accepted. |U| < t: abort. Only then does each chunk owner add up
   its chunk, over U alone: a sender some peer rejected is left out everywhere (summing what
   was accepted locally would keep a site whose masks are then treated as a dropped one's).
4. *unmasking*: each survivor reveals, for every u ∈ U it holds a share of, the share of b_u, and
   for every dropped v, the share of s_v (never both for one site). Everyone reconstructs and
   each chunk owner removes Σ_U PRG(b_u) and the dropped sites' pair masks from its chunk.
5. *all-gather* the unmasked chunks; decode.

Bytes: the masked vectors travel like a reduce-scatter + all-gather of 4-byte values — the same
as geotrain's fp32 ring — plus keys, encrypted shares and frame headers (a few hundred bytes
per peer).
"""

from __future__ import annotations

import hashlib
import struct
import time
from dataclasses import dataclass, field

import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from geotrain.comm.collectives import Collectives
from geotrain.config.privacy import sparse_degree
from geotrain.errors import SecAggAborted
from geotrain.privacy.masking import (
    FLAG_DROPPED,
    HEADER,
    MAGIC,
    MIN_SURVIVORS,
    PUBLIC_RAW,
    RAW,
    RING_BITS,
    SHARE_BYTES,
    Participant,
    decode_fixed,
    default_threshold,
    encode_fixed,
    frac_bits_for,
    neighbours,
    ring_add_,
    round_seed,
    shamir_reconstruct,
    unmask_chunk,
)


@dataclass
class RoundReport:
    """What happened in one round (for the audit log)."""

    round: int
    participants: list[int]
    survivors: list[int]
    dropped: list[int]
    malformed: list[int]
    masks_recovered: list[int]  # dropped sites whose pair masks were removed via shares
    threshold: int
    graph: str
    degree: int
    frac_bits: int
    key_agreement_seconds: float = 0.0
    masking_seconds: float = 0.0
    unmasking_seconds: float = 0.0
    extra_bytes: int = 0  # keys, shares, headers, flags
    notes: list[str] = field(default_factory=list)


class SecureAggregator:
    """Runs the protocol for one rank over its cross-site group (lane 0), on its shard of a vector.

    Args:
        comm: this rank's collectives (bytes are counted and links emulated as for any exchange).
        graph: 'complete' or 'sparse' (SecAgg+).
        threshold: shares needed to reconstruct a secret (None: a majority of each sharing set).
        bound: every encoded value is clamped to ±bound (the caller clips the vector's norm to it).
        run_seed: public seed of the run (the sparse graph of a round derives from it).
        region: over the sites of this rank's region only (participants are their indices in it).
    """

    def __init__(
        self,
        comm: Collectives,
        graph: str = "complete",
        threshold: int | None = None,
        bound: float = 100.0,
        run_seed: int = 0,
        region: bool = False,
    ) -> None:
        g = comm.groups
        self.comm = comm
        # region: over the sites of this rank's region (multi-tier DiLoCo's region rounds)
        self.ranks = list(g.region_inter_ranks if region else g.inter_ranks)
        self.me = self.ranks.index(g.me.rank)
        self.n = len(self.ranks)
        group = comm.lanes[0].region if region else comm.lanes[0].inter
        assert group is not None, "secure aggregation runs on equal sites (config-checked): every rank carries"
        self.group = group
        self.graph = graph
        self.degree = self.n - 1 if graph == "complete" else sparse_degree(self.n)
        self.t = threshold if threshold is not None else default_threshold(self.n, graph)
        if self.n < MIN_SURVIVORS or self.t < MIN_SURVIVORS:
            raise ValueError(
                f"privacy.secure_aggregation: needs at least {MIN_SURVIVORS} sites and privacy.threshold >= {MIN_SURVIVORS} "
                f"(with two, each site learns the other's update from the sum)"
            )
        if self.t > self.degree + 1:
            raise ValueError(
                f"privacy.threshold: {self.t} is more than a site and its {self.degree} neighbours can hold "
                f"(at most {self.degree + 1} with graph={graph} and {self.n} sites)"
            )
        self.set_range(bound)
        self.run_seed = run_seed
        self.context = (b"geotrain-secagg-region" if region else b"geotrain-secagg") + struct.pack(">q", run_seed)

    def set_range(self, bound: float) -> None:
        """Values are clamped to ±``bound``; the fixed point keeps the sum of n of them in the ring."""
        self.bound = bound
        self.frac_bits = frac_bits_for(self.n, bound)

    # -- messages: fixed-size byte strings between participants (indices, not ranks)
    def _exchange(self, out: dict[int, bytes], sizes: dict[int, int]) -> dict[int, bytes]:
        # protocol messages stand for no fp32 payload: they count as bytes, not as raw bytes
        sends = {self.ranks[v]: (torch.frombuffer(bytearray(b), dtype=torch.uint8), 0) for v, b in out.items()}
        recvs = {self.ranks[v]: torch.empty(n, dtype=torch.uint8) for v, n in sizes.items()}
        self.comm._peer_exchange(sends, recvs, self.group)
        return {v: recvs[self.ranks[v]].numpy().tobytes() for v in sizes}

    def _tensors(self, out: dict[int, torch.Tensor], recv: dict[int, torch.Tensor]) -> None:
        sends = {self.ranks[v]: (t, 4 * max(0, t.numel() - HEADER)) for v, t in out.items()}
        self.comm._peer_exchange(sends, {self.ranks[v]: t for v, t in recv.items()}, self.group)

    def aggregate(self, x: torch.Tensor, round_id: int, inject: str | None = None) -> tuple[torch.Tensor, RoundReport]:
        """The sum over surviving sites of ``x`` (this rank's fp32 shard; same length everywhere).

        ``inject`` tests failure handling on this site: 'drop' withdraws its input after key
        agreement, 'malformed' sends frames with the wrong ring size, 'bad-share:J' corrupts only
        the key share sent to participant J (so J rejects this site and the others accept it),
        'bad-key' advertises all-zero public keys.
        Raises SecAggAborted when fewer than ``threshold`` sites survive.
        """
        n, me = self.n, self.me
        others = [v for v in range(n) if v != me]
        nb = neighbours(n, self.graph, self.degree, round_seed(self.run_seed, round_id))
        rep = RoundReport(round_id, list(range(n)), [], [], [], [], self.t, self.graph, len(nb[me]), self.frac_bits)
        t0 = time.perf_counter()
        p = Participant(me, n, round_id, nb, self.t, self.context)
        commit = hashlib.sha256(p.self_seed).digest()
        # 0. public keys and a commitment to the self-mask seed, to everyone
        mine = (bytes(64) if inject == "bad-key" else p.public_keys()) + commit
        keys = self._exchange({v: mine for v in others}, {v: 96 for v in others})
        keys[me] = mine
        for v, blob in keys.items():
            p.receive_keys(v, blob)
        commits = {v: blob[64:] for v, blob in keys.items()}
        # 1. encrypted Shamir shares, to neighbours
        size = Participant.share_message_bytes()
        reasons: dict[int, str] = {}
        share_msgs = p.make_shares()
        if inject and inject.startswith("bad-share:"):
            j = int(inject.split(":")[1])
            if j in share_msgs:
                share_msgs[j] = share_msgs[j][:-1] + bytes([share_msgs[j][-1] ^ 1])
        for v, blob in self._exchange(share_msgs, {v: size for v in nb[me]}).items():
            try:
                p.receive_shares(v, blob)
            except InvalidTag:  # excluded like a malformed update, through the agreed flags below
                reasons[v] = "malformed: its key share failed authentication"
            except ValueError:
                reasons[v] = "malformed: its public keys are not valid X25519 keys"
        for v in p.invalid - set(reasons):
            reasons[v] = "malformed: its public keys are not valid X25519 keys"
        rep.extra_bytes += 96 * len(others) + size * len(nb[me])
        rep.key_agreement_seconds = time.perf_counter() - t0
        # 2. masked input, chunk j framed to participant j
        t1 = time.perf_counter()
        y = p.mask(encode_fixed(x, self.frac_bits, self.bound))
        chunks = list(y.tensor_split(n))
        starts = [0]
        for c in chunks[:-1]:
            starts.append(starts[-1] + c.numel())
        flags = FLAG_DROPPED if inject == "drop" else 0
        ring = 64 if inject == "malformed" else RING_BITS
        frames = {}
        for j in range(n):
            f = torch.empty(HEADER + chunks[j].numel(), dtype=torch.int32)
            f[:HEADER] = torch.tensor([MAGIC, round_id, chunks[j].numel(), ring | (flags << 8)], dtype=torch.int32)
            f[HEADER:] = 0 if flags else chunks[j]
            frames[j] = f
        got = {v: torch.empty(HEADER + chunks[me].numel(), dtype=torch.int32) for v in others}
        self._tensors({v: frames[v] for v in others}, got)
        got[me] = frames[me]
        rep.extra_bytes += 4 * HEADER * len(others)
        accepted = [False] * n
        for v in range(n):
            h = got[v][:HEADER].tolist()
            if v in reasons:
                pass
            elif h[3] >> 8 & FLAG_DROPPED:
                reasons[v] = "dropped"
            elif h[0] != MAGIC or h[1] != round_id or h[2] != chunks[me].numel() or h[3] & 0xFF != RING_BITS:
                reasons[v] = f"malformed frame (magic {h[0]:#x}, round {h[1]}, length {h[2]}, ring bits {h[3] & 0xFF})"
            else:
                accepted[v] = True
        rep.masking_seconds = time.perf_counter() - t1
        # 3. who was accepted by everyone
        flag_blob = bytes(accepted)
        views = self._exchange({v: flag_blob for v in others}, {v: n for v in others})
        views[me] = flag_blob
        rep.extra_bytes += n * len(others)
        survivors = [u for u in range(n) if all(views[w][u] for w in range(n))]
        dropped = [u for u in range(n) if u not in survivors]
        rep.survivors, rep.dropped = survivors, dropped
        rep.malformed = [u for u in dropped if reasons.get(u, "").startswith("malformed")]
        rep.notes = [f"site {u}: {r}" for u, r in sorted(reasons.items())]
        if len(survivors) < max(self.t, MIN_SURVIVORS):  # a sum of fewer than 3 gives a site away
            raise SecAggAborted(f"round {round_id}: {len(survivors)} of {n} sites survived, threshold is {self.t}")
        # only the agreed survivors' frames enter the sum: a site accepted here but rejected by a
        # peer is dropped everywhere, and its masks are not removed, so its frame must not count
        acc = torch.zeros(chunks[me].numel(), dtype=torch.int32)
        for u in survivors:
            ring_add_(acc, got[u][HEADER:])
        # 4. reveal shares; reconstruct the survivors' self seeds and the dropped sites' mask keys
        t2 = time.perf_counter()
        revealed = p.reveal(survivors, dropped) if me in survivors else {}
        blob = b"".join(
            (b"\x01" + revealed[u].to_bytes(SHARE_BYTES, "big")) if u in revealed else bytes(1 + SHARE_BYTES) for u in range(n)
        )
        shares = self._exchange({v: blob for v in others}, {v: len(blob) for v in others})
        shares[me] = blob
        rep.extra_bytes += len(blob) * len(others)
        seeds: dict[int, bytes] = {}
        keys_of_dropped: dict[int, bytes] = {}
        for u in range(n):
            points = {}
            for w in survivors:
                rec = shares[w][u * (1 + SHARE_BYTES) : (u + 1) * (1 + SHARE_BYTES)]
                if rec[0]:
                    points[w + 1] = int.from_bytes(rec[1:], "big")
            if u in survivors or (u in dropped and any(u in nb[s] for s in survivors)):
                if len(points) < self.t:
                    raise SecAggAborted(f"round {round_id}: only {len(points)} shares for site {u}, threshold is {self.t}")
                try:
                    secret = shamir_reconstruct(dict(list(points.items())[: self.t]))
                    rebuilt = X25519PrivateKey.from_private_bytes(secret) if u not in survivors else None
                except (ValueError, OverflowError):  # a malformed share: the round rolls back, the run goes on
                    raise SecAggAborted(f"round {round_id}: the shares revealed for site {u} are malformed") from None
                if u in survivors:
                    if hashlib.sha256(secret).digest() != commits[u]:
                        raise SecAggAborted(
                            f"round {round_id}: the reconstructed self-mask seed of site {u} fails its commitment"
                        )
                    seeds[u] = secret
                else:
                    assert rebuilt is not None
                    if rebuilt.public_key().public_bytes(RAW, PUBLIC_RAW) != p.s_pub[u]:
                        raise SecAggAborted(
                            f"round {round_id}: the reconstructed mask key of site {u} does not match its public key"
                        )
                    keys_of_dropped[u] = secret
        rep.masks_recovered = sorted(keys_of_dropped)
        unmask_chunk(acc, starts[me], survivors, sorted(keys_of_dropped), nb, seeds, keys_of_dropped, p.s_pub, p.context)
        rep.unmasking_seconds = time.perf_counter() - t2
        # 5. all-gather the unmasked chunks
        out = torch.empty(y.numel(), dtype=torch.int32)
        parts = list(out.tensor_split(n))
        parts[me].copy_(acc)
        sends = {self.ranks[v]: (acc, 4 * acc.numel()) for v in others}
        self.comm._peer_exchange(sends, {self.ranks[v]: parts[v] for v in others}, self.group)
        return decode_fixed(out, self.frac_bits), rep
