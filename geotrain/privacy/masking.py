"""The cryptographic parts of secure aggregation, with no I/O: X25519/HKDF keys, AES-CTR mask
streams, arithmetic mod 2^32, fixed point, Shamir sharing over GF(2^521 - 1), the SecAgg+ graph,
and one participant's state in a round.

Every primitive comes from ``cryptography``; Shamir sharing is plain integer arithmetic (no
maintained package provides it). The tests and the key-agreement benchmark drive
:class:`Participant` directly; :mod:`geotrain.privacy.secagg` moves its messages between sites.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import struct

import torch
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from geotrain.config.privacy import sparse_degree

PRIME = (1 << 521) - 1  # Mersenne prime; secrets are 32 bytes < 2^256
SHARE_BYTES = 66  # a field element, big-endian
RING_BITS = 32
MAGIC = 0x47534131  # "GSA1"
HEADER = 4  # int32 words of a masked-chunk frame: magic, round, length, ring bits | flags << 8
FLAG_DROPPED = 1
RAW = serialization.Encoding.Raw
PUBLIC_RAW = serialization.PublicFormat.Raw


def hkdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def prg(seed: bytes, start: int, n: int) -> torch.Tensor:
    """Elements ``start .. start+n`` of the uint32 stream AES-256-CTR(seed) (as int32 bit patterns):
    any chunk of a mask can be expanded on its own."""
    first, skip = divmod(start, 4)  # four 32-bit words per AES block
    blocks = -(-(skip + n) // 4)
    enc = Cipher(algorithms.AES(seed), modes.CTR(first.to_bytes(16, "big"))).encryptor()
    stream = enc.update(bytes(16 * blocks)) + enc.finalize()
    return torch.frombuffer(bytearray(stream), dtype=torch.int32)[skip : skip + n]


def wrap(acc: torch.Tensor) -> torch.Tensor:
    """int64 values -> their residues mod 2^32 as int32 bit patterns."""
    return acc.add(1 << 31).remainder_(1 << 32).sub_(1 << 31).to(torch.int32)


def ring_add_(acc: torch.Tensor, x: torch.Tensor, sign: int = 1) -> torch.Tensor:
    """acc ← acc + sign·x mod 2^32 on int32 bit patterns (exact: the sum is formed in int64)."""
    s = acc.to(torch.int64)
    s.add_(x.to(torch.int64), alpha=sign)
    acc.copy_(wrap(s))
    return acc


def frac_bits_for(num_sites: int, bound: float) -> int:
    """Fractional bits of the fixed point such that a sum of ``num_sites`` values of magnitude at
    most ``bound`` cannot wrap around the signed 32-bit ring."""
    return max(0, math.floor(math.log2((2**31 - 1) / (num_sites * bound))) - 1)


def encode_fixed(x: torch.Tensor, frac_bits: int, bound: float) -> torch.Tensor:
    """Round-to-nearest fixed point in int32 (values clamped to ±bound first)."""
    return torch.round(x.to(torch.float64).clamp(-bound, bound) * (1 << frac_bits)).to(torch.int32)


def decode_fixed(q: torch.Tensor, frac_bits: int) -> torch.Tensor:
    return (q.to(torch.float64) / (1 << frac_bits)).to(torch.float32)


def error_bound(num_summed: int, frac_bits: int) -> float:
    """Largest per-element error of a decoded sum of ``num_summed`` encoded values."""
    return num_summed * 0.5 / (1 << frac_bits) + 1e-7 * num_summed  # + fp32 rounding of the decode


def shamir_share(secret: bytes, t: int, xs: list[int], rng: random.SystemRandom) -> dict[int, int]:
    """Shares f(x) for x in ``xs`` of a degree t-1 polynomial with f(0) = secret."""
    coeffs = [int.from_bytes(secret, "big")] + [rng.randrange(PRIME) for _ in range(t - 1)]
    out = {}
    for x in xs:
        y = 0
        for c in reversed(coeffs):
            y = (y * x + c) % PRIME
        out[x] = y
    return out


def shamir_reconstruct(points: dict[int, int], nbytes: int = 32) -> bytes:
    """f(0) by Lagrange interpolation from ``points`` {x: f(x)} (exactly t of them are used)."""
    xs = list(points)
    secret = 0
    for i in xs:
        num, den = 1, 1
        for j in xs:
            if j != i:
                num = num * (-j) % PRIME
                den = den * (i - j) % PRIME
        secret = (secret + points[i] * num * pow(den, -1, PRIME)) % PRIME
    return secret.to_bytes(nbytes, "big")


def neighbours(n: int, graph: str, degree: int, round_seed: bytes) -> list[list[int]]:
    """Who masks with whom. 'complete': everyone. 'sparse' (SecAgg+): a Harary graph of even
    ``degree`` over a permutation of the participants that every site derives from the public
    ``round_seed``, so it changes every round and no site chooses its neighbours."""
    if graph == "complete" or degree >= n - 1:
        return [[v for v in range(n) if v != u] for u in range(n)]
    order = list(range(n))
    random.Random(round_seed).shuffle(order)
    pos = {u: i for i, u in enumerate(order)}
    half = degree // 2
    out = []
    for u in range(n):
        i = pos[u]
        out.append(sorted({order[(i + d) % n] for d in range(-half, half + 1) if d}))
    return out


MIN_SURVIVORS = 3  # below this a sum gives a site away (with two, each learns the other's update)


def default_threshold(n: int, graph: str) -> int:
    """More than two thirds of the sharing set (a site and its neighbours: 2s/3 + 1), and never
    fewer than :data:`MIN_SURVIVORS`; at most the whole sharing set."""
    s = n if graph == "complete" else sparse_degree(n) + 1
    return min(s, max(MIN_SURVIVORS, 2 * s // 3 + 1))


class Participant:
    """The cryptographic state of one site's participant in one round (no I/O): the tests and the
    key-agreement benchmark drive it directly, :class:`SecureAggregator` moves its messages."""

    def __init__(self, me: int, n: int, round_id: int, nbrs: list[list[int]], threshold: int, context: bytes) -> None:
        self.me, self.n, self.round, self.t = me, n, round_id, threshold
        self.nbrs = nbrs
        self.context = context + struct.pack(">q", round_id)
        self.c_key = X25519PrivateKey.generate()
        self.s_key = X25519PrivateKey.generate()
        self.self_seed = os.urandom(32)
        self.c_pub: dict[int, bytes] = {}
        self.s_pub: dict[int, bytes] = {}
        self.shares_b: dict[int, int] = {}  # owner -> my share of their self-mask seed
        self.shares_s: dict[int, int] = {}  # owner -> my share of their mask key
        self._pair_seeds: dict[int, bytes] = {}
        self.invalid: set[int] = set()  # sites whose public keys are not valid X25519 keys (or low-order)

    # step 0
    def public_keys(self) -> bytes:
        return self.c_key.public_key().public_bytes(RAW, PUBLIC_RAW) + self.s_key.public_key().public_bytes(RAW, PUBLIC_RAW)

    def receive_keys(self, u: int, blob: bytes) -> None:
        """Site ``u``'s two public keys. A key that gives an all-zero shared secret (zero, or a
        low-order point) marks ``u`` invalid: no share or mask is derived with it, and the round
        drops ``u``, then aborts when its mask key cannot be rebuilt to match."""
        self.c_pub[u], self.s_pub[u] = blob[:32], blob[32:64]
        try:
            for mine, theirs in ((self.c_key, blob[:32]), (self.s_key, blob[32:64])):
                mine.exchange(X25519PublicKey.from_public_bytes(theirs))
        except ValueError:
            self.invalid.add(u)

    # step 1
    def sharing_set(self, u: int) -> list[int]:
        return sorted([u, *self.nbrs[u]])

    def _channel(self, v: int) -> AESGCM:
        shared = self.c_key.exchange(X25519PublicKey.from_public_bytes(self.c_pub[v]))
        lo, hi = sorted((self.me, v))
        return AESGCM(hkdf(shared, b"geotrain-secagg-channel" + self.context + struct.pack(">ii", lo, hi)))

    def _aad(self, src: int, dst: int) -> bytes:
        return self.context + struct.pack(">ii", src, dst)

    def make_shares(self) -> dict[int, bytes]:
        """Encrypted share messages for each neighbour; keeps its own shares."""
        rng = random.SystemRandom()
        xs = [v + 1 for v in self.sharing_set(self.me)]
        sb = shamir_share(self.self_seed, self.t, xs, rng)
        ss = shamir_share(self.s_key.private_bytes_raw(), self.t, xs, rng)
        self.shares_b[self.me], self.shares_s[self.me] = sb[self.me + 1], ss[self.me + 1]
        out = {}
        for v in self.nbrs[self.me]:
            if v in self.invalid:  # no channel to it: random bytes of the size it waits for
                out[v] = os.urandom(self.share_message_bytes())
                continue
            plain = sb[v + 1].to_bytes(SHARE_BYTES, "big") + ss[v + 1].to_bytes(SHARE_BYTES, "big")
            nonce = os.urandom(12)
            out[v] = nonce + self._channel(v).encrypt(nonce, plain, self._aad(self.me, v))
        return out

    def receive_shares(self, u: int, blob: bytes) -> None:
        """Raises ``InvalidTag`` for a tampered share, ``ValueError`` for a site with invalid keys."""
        if u in self.invalid:
            raise ValueError(f"site {u} sent invalid public keys")
        plain = self._channel(u).decrypt(blob[:12], blob[12:], self._aad(u, self.me))  # raises on tampering
        self.shares_b[u] = int.from_bytes(plain[:SHARE_BYTES], "big")
        self.shares_s[u] = int.from_bytes(plain[SHARE_BYTES:], "big")

    @staticmethod
    def share_message_bytes() -> int:
        return 12 + 2 * SHARE_BYTES + 16

    # step 2
    def pair_seed(self, v: int) -> bytes:
        if v not in self._pair_seeds:
            shared = self.s_key.exchange(X25519PublicKey.from_public_bytes(self.s_pub[v]))
            lo, hi = sorted((self.me, v))
            self._pair_seeds[v] = hkdf(shared, b"geotrain-secagg-mask" + self.context + struct.pack(">ii", lo, hi))
        return self._pair_seeds[v]

    def mask(self, q: torch.Tensor, start: int = 0) -> torch.Tensor:
        """y = q + PRG(b) + Σ_v ±PRG(s_uv) mod 2^32 over elements ``start .. start+len(q)``."""
        acc = q.to(torch.int64)  # at most 2^31 per term, a few thousand terms: no int64 overflow
        acc.add_(prg(self.self_seed, start, q.numel()))
        for v in self.nbrs[self.me]:
            if v not in self.invalid:
                acc.add_(prg(self.pair_seed(v), start, q.numel()), alpha=1 if self.me < v else -1)
        return wrap(acc)

    # step 4
    def reveal(self, survivors: list[int], dropped: list[int]) -> dict[int, int]:
        """Shares to reveal: of b_u for survivors, of s_v for dropped sites; never both for one site."""
        assert not set(survivors) & set(dropped)
        out = {u: self.shares_b[u] for u in survivors if u in self.shares_b}
        out.update({v: self.shares_s[v] for v in dropped if v in self.shares_s})
        return out


def unmask_chunk(
    chunk: torch.Tensor,
    start: int,
    survivors: list[int],
    dropped: list[int],
    nbrs: list[list[int]],
    self_seeds: dict[int, bytes],
    dropped_keys: dict[int, bytes],
    s_pub: dict[int, bytes],
    context: bytes,
) -> None:
    """Remove the survivors' self masks and the pair masks between survivors and dropped sites from
    ``chunk`` (the mod 2^32 sum of the survivors' masked vectors over ``start .. start+len``)."""
    n = chunk.numel()
    acc = chunk.to(torch.int64)
    for u in survivors:
        acc.sub_(prg(self_seeds[u], start, n))
    for v in dropped:
        key = X25519PrivateKey.from_private_bytes(dropped_keys[v])
        for u in nbrs[v]:
            if u not in survivors:
                continue
            shared = key.exchange(X25519PublicKey.from_public_bytes(s_pub[u]))
            lo, hi = sorted((u, v))
            seed = hkdf(shared, b"geotrain-secagg-mask" + context + struct.pack(">ii", lo, hi))
            # y_u carried +PRG if u < v, -PRG otherwise: take it back out
            acc.add_(prg(seed, start, n), alpha=-1 if u < v else 1)
    chunk.copy_(wrap(acc))


def round_seed(run_seed: int, round_id: int) -> bytes:
    return hashlib.sha256(b"geotrain-secagg-graph" + struct.pack(">qq", run_seed, round_id)).digest()


class PairMasks:
    """Secure aggregation inside an elastic round (:mod:`geotrain.elastic`): each site's part is
    fixed point mod 2^32 plus, for every other admitted site, +PRG or -PRG of a seed only the two
    of them hold (HKDF of the pair's key of this round, which comes from their fresh X25519 keys;
    the sign by the order of their names). Summed over every admitted site the pair masks cancel,
    so the sum is exact and no single update is seen. A site that drops out fails the round's vote
    and the round rolls back everywhere, so no mask is ever recovered (no Shamir shares).

    Args:
        bound: every value is clamped to ±bound (``privacy.update_bound``).
        sites: the run's sites (the fixed point keeps a sum of that many in the ring).
    """

    def __init__(self, bound: float, sites: int) -> None:
        self.bound = bound
        self.frac_bits = frac_bits_for(sites, bound)

    def encode(self, x: torch.Tensor, start: int, me: str, pair_keys: dict[str, bytes], context: bytes) -> torch.Tensor:
        """``x`` (fp32, values ``start ..`` of this rank's part) in fixed point, masked with every
        peer in ``pair_keys`` (site name -> the pair's key of this round); int32 bit patterns."""
        acc = encode_fixed(x, self.frac_bits, self.bound).to(torch.int64)
        for peer, key in sorted(pair_keys.items()):
            lo, hi = sorted((me, peer))
            seed = hkdf(key, b"geotrain-elastic-mask|" + context + f"|{lo}|{hi}".encode())
            acc.add_(prg(seed, start, x.numel()), alpha=1 if me < peer else -1)
        return wrap(acc)

    def decode(self, q: torch.Tensor) -> torch.Tensor:
        """The fp32 values of a sum in which every mask has cancelled."""
        return decode_fixed(q, self.frac_bits)

    @staticmethod
    def add_(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """acc ← acc + x mod 2^32 (the ring the exchange sums in)."""
        return ring_add_(acc, x)
