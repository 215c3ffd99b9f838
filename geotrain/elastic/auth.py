"""Who may take part in a round, and every control message authenticated: the run secret.

Every key is derived from the shared secret with HKDF-SHA256 (:class:`RunKeys`), each under its
own label, so no key is ever the secret itself and no two uses share a key:

* a **store key**: the round stores (:mod:`geotrain.comm.authstore`) serve only clients that prove
  it, and seal every message under keys derived from it and the connection's two nonces;
* a **namespace** and a **control key**: every value a site writes there lives under the
  namespace and is sealed (:class:`SealedStore`) with an HMAC over the key's full name
  (namespace, round, writer site) and the value, so a value altered, or replayed from another
  round or under another site's name, is refused;
* a **payload key**: the pseudo-gradient frames and the healing state are encrypted and
  authenticated (AES-256-GCM) under a key derived from it for each round, bound to the round,
  sender, receiver and position (:class:`FrameCipher`);
* a **member key**: each site's quorum request to the Lighthouse carries a member tag, an HMAC
  over what it claims (name, store address, committed rounds, hash, step, joining, incarnation,
  session). The Lighthouse hands these to anyone, so they are only *hints*: who to meet and where.

Decisions are made inside the round (:func:`authenticate`): every site writes a fresh nonce and
its current claims in the meeting store, and proves the secret to every other by an HMAC over
the other's nonce, the round and its own claims. A claim replayed from an earlier round or run
meets a nonce it was never bound to. The round's identity is the digest of the admitted sites'
nonces and claims (:func:`round_digest`): everything after (votes, heartbeats, the round group's
rendezvous, frames) lives under it, so nothing from another round, whatever the Lighthouse says
the round is called, is accepted in this one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from geotrain.comm.identity import Identity
from geotrain.config import ElasticConfig
from geotrain.elastic.roundstore import wait_keys
from geotrain.errors import MembershipRefused


def load_secret(cfg: ElasticConfig) -> bytes:
    """The shared secret from ``secret_file`` or the ``secret_env`` variable.

    Raises:
        MembershipRefused: neither holds a secret.
    """
    if cfg.secret_file:
        path = Path(cfg.secret_file).expanduser()
        try:
            st = path.stat()
            data = path.read_bytes().strip()
        except OSError as exc:
            raise MembershipRefused(f"elastic.secret_file: cannot read {cfg.secret_file} ({exc.strerror})") from None
        if st.st_mode & 0o077 or st.st_uid != os.geteuid():
            raise MembershipRefused(
                f"elastic.secret_file: {cfg.secret_file} is open to other users (mode {st.st_mode & 0o777:o}, owner uid "
                f"{st.st_uid}): make it this user's alone (chmod 600)"
            )
    else:
        data = os.environ.get(cfg.secret_env, "").encode()
    if len(data) < 16:
        where = f"elastic.secret_file ({cfg.secret_file})" if cfg.secret_file else f"environment variable {cfg.secret_env}"
        raise MembershipRefused(f"no membership secret of at least 16 bytes in {where}")
    return data


def optional_secret(cfg: ElasticConfig) -> bytes | None:
    """The run secret when one is set: always in elastic mode (:func:`load_secret`, required),
    otherwise from ``secret_file`` or ``secret_env`` if either holds one."""
    if cfg.enabled or cfg.secret_file:
        return load_secret(cfg)
    data = os.environ.get(cfg.secret_env, "").encode()
    return data if len(data) >= 16 else None


class RunKeys:
    """The keys one run derives from its secret (see the module docstring)."""

    def __init__(self, secret: bytes) -> None:
        self.namespace = self._derive(secret, "namespace").hex()[:32]
        self.control = self._derive(secret, "control")
        self.payload = self._derive(secret, "payload")
        self.member = self._derive(secret, "member")
        self.store = self._derive(secret, "store")
        self.join = self._derive(secret, "join")
        self.checkpoint = self._derive(secret, "checkpoint")
        self.run_id = self._derive(secret, "run-id").hex()[:32]  # public: names the run in what it writes

    @staticmethod
    def _derive(secret: bytes, label: str) -> bytes:
        """HKDF-SHA256 (RFC 5869) of the secret, one key per ``label``."""
        kdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"geotrain-run-keys-v2", info=label.encode())
        return kdf.derive(secret)

    def member_tag(self, site: str, claims: dict[str, object]) -> str:
        """HMAC over a site's quorum claims (what the Lighthouse passes on to the others)."""
        msg = json.dumps({"site": site, **claims}, sort_keys=True).encode()
        return hmac.new(self.member, msg, hashlib.sha256).hexdigest()

    def member_ok(self, site: str, data: dict[str, object]) -> bool:
        """Whether ``data`` carries ``site``'s valid member tag. Never raises: a participant with
        a tag that is not 64 hex characters, a name or claims of any other shape is just not
        authentic (``hmac.compare_digest`` raises on non-ASCII strings: it compares bytes here)."""
        tag = data.get("tag")
        if not isinstance(site, str) or not isinstance(tag, str) or len(tag) != 64:
            return False
        try:
            expected = self.member_tag(site, {k: v for k, v in data.items() if k != "tag"})
        except (TypeError, ValueError, RecursionError):  # claims JSON cannot write
            return False
        return hmac.compare_digest(tag.encode("utf-8", "surrogatepass"), expected.encode())


TAG_BYTES = 32  # a sealed store value's HMAC-SHA256
AEAD_TAG = 16  # AES-GCM's tag per chunk of a frame
CHUNK = 1 << 20  # frames are sealed in chunks of 1 MiB (AES-GCM runs fastest on pieces of about this size)


def sealed_size(nbytes: int) -> int:
    """Bytes on the wire for a frame of ``nbytes``: the data plus one tag per chunk."""
    return nbytes + AEAD_TAG * max(1, -(-nbytes // CHUNK))


def pair_key(payload_key: bytes, shared: bytes, round_id: str, a: str, b: str) -> bytes:
    """The key of the frames between sites ``a`` and ``b`` in one round: HKDF of the run's payload
    key and the two sites' X25519 shared secret of this round (:func:`ephemeral_shared`), bound
    to the round and the pair. Without the shared secret a site holding the run's key cannot
    read or forge the frames of two other sites; a new one every round (forward secrecy)."""
    lo, hi = sorted((a, b))
    info = f"geotrain-pair|{round_id}|{lo}|{hi}".encode()
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"geotrain-pair-key", info=info).derive(payload_key + shared)


def ephemeral() -> tuple[X25519PrivateKey, str]:
    """A fresh X25519 key for one round, and its public half (hex), which goes in the claims."""
    key = X25519PrivateKey.generate()
    return key, key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def ephemeral_shared(mine: X25519PrivateKey, theirs: str) -> bytes | None:
    """The X25519 shared secret with a peer's public key (hex); None for a key that is not 32
    bytes, or a low-order point (an all-zero result, which ``cryptography`` refuses)."""
    try:
        return mine.exchange(X25519PublicKey.from_public_bytes(bytes.fromhex(theirs)))
    except ValueError:
        return None


class FrameCipher:
    """Encrypts and authenticates the frames between two sites in one round: AES-256-GCM
    (``cryptography``, AES-NI) under the pair's key of this round (:func:`pair_key`). Each frame
    is sealed in chunks; a chunk's nonce and associated data are its frame's context (round,
    sender, receiver, local rank, position) and its index, so a frame replayed from another
    position, sender or round, cut, reordered or altered fails to open."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    @staticmethod
    def _nonce(context: bytes, index: int) -> bytes:
        return hashlib.sha256(context + b"|" + str(index).encode()).digest()[:12]

    def seal(self, context: bytes, data: torch.Tensor) -> torch.Tensor:
        """The ciphertext of ``data``'s bytes (CPU) as a uint8 tensor of :func:`sealed_size` bytes."""
        raw = data.detach().contiguous().view(torch.uint8).numpy().data.cast("B")
        out = torch.empty(sealed_size(len(raw)), dtype=torch.uint8)
        dst = out.numpy().data.cast("B")
        pos = 0
        for i, k in enumerate(range(0, max(1, len(raw)), CHUNK)):
            size = min(CHUNK, len(raw) - k) + AEAD_TAG
            self._aead.encrypt_into(self._nonce(context, i), raw[k : k + CHUNK], context, dst[pos : pos + size])
            pos += size
        return out

    def open(self, context: bytes, sealed: torch.Tensor, into: torch.Tensor) -> bool:
        """Decrypt ``sealed`` into ``into``'s bytes (contiguous CPU); False if its size is not the
        sealed size of ``into`` or any chunk fails its tag (``into`` is then not to be used)."""
        dst = into.view(torch.uint8).numpy().data.cast("B")
        src = sealed.numpy().data.cast("B")
        if len(src) != sealed_size(len(dst)):
            return False
        pos = 0
        for i, k in enumerate(range(0, max(1, len(dst)), CHUNK)):
            size = min(CHUNK, len(dst) - k) + AEAD_TAG
            try:
                self._aead.decrypt_into(self._nonce(context, i), src[pos : pos + size], context, dst[k : k + size - AEAD_TAG])
            except InvalidTag:
                return False
            pos += size
        return True


class SealedStore:
    """A round store seen through the run's keys: keys live under ``namespace/scope/``, values
    carry an HMAC over their full key name and bytes. :meth:`get` returns None for a value that
    fails it (forged, altered or replayed from another key), which callers treat as absent or
    negative; so a forgery can at worst fail a round, never decide one. Each such value is logged
    once, naming the store (``log``)."""

    def __init__(self, store: dist.Store, keys: RunKeys, scope: str, log: Callable[[str], None] | None = None) -> None:
        self.raw, self.keys, self.scope, self.log = store, keys, scope, log
        self.prefix = f"{keys.namespace}/{scope}/"
        self._logged: set[str] = set()

    def _seal(self, name: str, value: bytes) -> bytes:
        return hmac.new(self.keys.control, name.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value: str | bytes) -> None:
        v = value.encode() if isinstance(value, str) else value
        name = self.prefix + key
        self.raw.set(name, self._seal(name, v) + v)  # type: ignore[arg-type]  # the store takes bytes

    def get(self, key: str) -> bytes | None:
        name = self.prefix + key
        blob = self.raw.get(name)
        value = blob[TAG_BYTES:]
        if hmac.compare_digest(blob[:TAG_BYTES], self._seal(name, value)):
            return value
        if self.log is not None and key not in self._logged and len(self._logged) < 16:
            self._logged.add(key)
            where = getattr(self.raw, "address", "?")
            self.log(f"round store {where}: the value of {self.scope}/{key} failed its seal (altered or forged): ignored")
        return None

    def check(self, keys: list[str]) -> bool:
        return bool(self.raw.check([self.prefix + k for k in keys]))

    def peek(self, key: str) -> bytes | None:
        """:meth:`get` if ``key`` is set now, else None (never waits for it)."""
        return self.get(key) if self.check([key]) else None

    def present(self, keys: list[str], wait_s: float = 0.0) -> list[bool]:
        """Which of ``keys`` are set (one request; the store may wait ``wait_s`` for one)."""
        return list(self.raw.present([self.prefix + k for k in keys], wait_s))  # type: ignore[attr-defined]

    def gloo_prefix(self, scope: str) -> dist.Store:
        """A store under the namespace for Gloo's own rendezvous keys: its values are not sealed
        (Gloo reads them itself), so the store under it must be an authenticated one
        (:class:`geotrain.comm.authstore.AuthStore`): only holders of the run's key reach it."""
        return dist.PrefixStore(self.prefix + scope, self.raw)


def _proof_message(round_key: str, verifier_nonce: str, prover: str, claims: bytes) -> bytes:
    return b"geotrain-join|" + f"{round_key}|{verifier_nonce}|{prover}|".encode() + hashlib.sha256(claims).digest()


def join_proof(key: bytes, round_key: str, verifier_nonce: str, prover: str, claims: bytes) -> str:
    """HMAC-SHA256 proof that ``prover`` holds the run's key, bound to the round, the verifier's fresh
    nonce and the prover's claims (so its claims are as fresh as the nonce)."""
    return hmac.new(key, _proof_message(round_key, verifier_nonce, prover, claims), hashlib.sha256).hexdigest()


MAX_CLAIMS = 4096  # bytes: a site's claims are a few hundred


def authenticate(
    store: SealedStore,
    key: str,
    site: str,
    members: list[str],
    join_key: bytes,
    claims: dict[str, Any],
    timeout: float,
    log: Callable[[str], None],
    identity: Identity | None = None,
) -> dict[str, tuple[dict[str, Any], str]]:
    """HMAC challenge among ``members`` in ``store`` (sealed, namespaced) for round ``key``: each
    site publishes a fresh nonce and its ``claims``, and proves the key to every other over the
    other's nonce and its claims; with an ``identity`` it also signs that with its own key, and a
    peer must sign with the key pinned for it. Returns, for the sites that proved themselves to
    ``site`` (and ``site`` itself), their claims as of this round and their nonce. A peer that
    does not answer within the bound is left out of this round (the round goes on without it)."""
    nonce = secrets.token_hex(16)
    mine = json.dumps(claims, sort_keys=True).encode()
    store.set(f"claims/{site}", mine)
    store.set(f"nonce/{site}", nonce)
    others = [m for m in members if m != site]
    deadline = time.monotonic() + timeout * 2
    present = wait_keys(store, [f"nonce/{m}" for m in others], deadline)
    nonces: dict[str, str] = {site: nonce}
    for k in present:
        peer = k.split("/", 1)[1]
        theirs = store.get(k)
        if theirs is not None and len(theirs) == 32:
            nonces[peer] = theirs.decode(errors="replace")
            if identity is not None:  # before the proof: a peer reads it once the proof is there
                store.set(f"sig/{peer}/{site}", identity.sign(_proof_message(key, nonces[peer], site, mine)))
            store.set(f"proof/{peer}/{site}", join_proof(join_key, key, nonces[peer], site, mine))
    got = wait_keys(store, [f"proof/{site}/{m}" for m in others], deadline)
    ok: dict[str, tuple[dict[str, Any], str]] = {site: (claims, nonce)}
    for k in got:
        peer = k.rsplit("/", 1)[1]
        proof = store.get(k)
        raw = store.peek(f"claims/{peer}")
        theirs_claims = parse_claims(raw) if raw is not None and len(raw) <= MAX_CLAIMS else None
        valid = proof is not None and raw is not None and peer in nonces and theirs_claims is not None
        if valid and hmac.compare_digest(proof.decode(errors="replace"), join_proof(join_key, key, nonce, peer, raw)):  # type: ignore[union-attr,arg-type]
            if identity is not None:
                sig = store.peek(f"sig/{site}/{peer}")
                signed = sig.decode(errors="replace") if sig is not None else None
                if not identity.verify(peer, _proof_message(key, nonce, peer, raw), signed):  # type: ignore[arg-type]
                    log(f"site {peer!r} did not sign its claims with its pinned key (elastic.site_keys) in round {key}: left out")
                    continue
            ok[peer] = (theirs_claims, nonces[peer])  # type: ignore[assignment]
        else:
            log(f"site {peer!r} failed authentication in round {key}: left out")
    return dict(sorted(ok.items()))


CLAIM_TYPES: dict[str, type] = {
    "hash": str,
    "step": int,
    "joining": bool,
    "committed": int,
    "store": str,
    "incarnation": int,
    "session": str,
    "part": int,  # the part of the model it syncs, plus one (0: the whole model, or none)
    "rest": int,  # rounds it still owes after this one once its steps are run
    "pace": int,  # adaptive pace: its measured compute microseconds per inner step (0: none)
    "link": str,  # sync.adapt: "CODEC|MEASURED": its codec this round, its last committed round (adapt.LINK_FIELDS; "": none)
    "done": bool,  # it has run its steps and takes part in the others' rounds only (quorum rounds: see view.nothing_to_do)
    "eph": str,  # this round's X25519 public key (hex): the frame keys between sites come from it
}


def parse_claims(raw: bytes) -> dict[str, Any] | None:
    """A site's claims as written in the round store, or None if they are not exactly the claims
    geotrain writes (every field present, of its type, strings under 256 characters)."""
    try:
        c = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(c, dict) or set(c) != set(CLAIM_TYPES):
        return None
    for name, kind in CLAIM_TYPES.items():
        v = c[name]
        if type(v) is not kind or (isinstance(v, str) and len(v) > 256) or (isinstance(v, int) and not 0 <= v < 2**62):
            return None
    return c


def round_digest(key: str, proved: dict[str, tuple[dict[str, Any], str]]) -> str:
    """The round's identity, the same on every site that admitted the same sites with the same
    nonces and claims: SHA-256 over them (hex)."""
    body = json.dumps({"key": key, "sites": {s: [c, n] for s, (c, n) in sorted(proved.items())}}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()
