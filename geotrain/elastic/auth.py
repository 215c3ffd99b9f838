"""Who may take part in a round, and every control message authenticated: the run secret.

Three keys are derived from the shared secret (HMAC-SHA256 as a PRF, :class:`RunKeys`):

* a **namespace**: every key geotrain writes in a round store lives under it, so a process
  without the secret cannot name (write, overwrite or pre-empt) any key the sites read, Gloo's
  rendezvous keys of the round groups included;
* a **control key**: every value is sealed (:class:`SealedStore`) with an HMAC over the key's full
  name — namespace, round, writer site — and the value, so a value altered in transit, or
  replayed from another round or under another site's name, is refused;
* a **payload key**: the pseudo-gradient frames and the healing state carry an HMAC bound to
  round, sender, receiver and position (:func:`frame_tag`).

Before any of that, each site's quorum request to the Lighthouse carries a **member tag**: an HMAC
over what it claims (name, store address, committed rounds, hash, step, joining, incarnation).
Sites ignore quorum participants whose tag fails: a process without the secret never becomes a
heal source, is never waited for and never dialled. Then, in the round store, every site proves
knowledge of the secret to every other by HMAC over the other's fresh nonce, bound to the round
(freshness: a replayed quorum request names a round store that answers no challenge).
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

import torch
import torch.distributed as dist

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
        self.checkpoint = self._derive(secret, "checkpoint")
        self.run_id = self._derive(secret, "run-id").hex()[:32]  # public: names the run in what it writes

    @staticmethod
    def _derive(secret: bytes, label: str) -> bytes:
        return hmac.new(secret, f"geotrain-key|{label}".encode(), hashlib.sha256).digest()

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


TAG_BYTES = 32


def frame_tag(key: bytes, context: bytes, data: torch.Tensor) -> bytes:
    """HMAC-SHA256 of a tensor's bytes (contiguous CPU) bound to ``context`` (round, sender,
    receiver, position)."""
    mac = hmac.new(key, context, hashlib.sha256)
    mac.update(data.detach().contiguous().view(torch.uint8).numpy().data)
    return mac.digest()


class SealedStore:
    """A round store seen through the run's keys: keys live under ``namespace/scope/``, values
    carry an HMAC over their full key name and bytes. :meth:`get` returns None for a value that
    fails it (forged, altered or replayed from another key), which callers treat as absent or
    negative; so a forgery can at worst fail a round, never decide one."""

    def __init__(self, store: dist.Store, keys: RunKeys, scope: str) -> None:
        self.raw, self.keys, self.scope = store, keys, scope
        self.prefix = f"{keys.namespace}/{scope}/"

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
        return value if hmac.compare_digest(blob[:TAG_BYTES], self._seal(name, value)) else None

    def check(self, keys: list[str]) -> bool:
        return bool(self.raw.check([self.prefix + k for k in keys]))

    def gloo_prefix(self, scope: str) -> dist.Store:
        """A plain (unsealed) store under the namespace for Gloo's own rendezvous keys."""
        return dist.PrefixStore(self.prefix + scope, self.raw)


def join_proof(secret: bytes, round_key: str, verifier_nonce: str, prover: str) -> str:
    """HMAC-SHA256 proof that ``prover`` holds ``secret``, bound to the round and the verifier's fresh nonce."""
    msg = f"geotrain-join|{round_key}|{verifier_nonce}|{prover}".encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def authenticate(
    store: SealedStore, key: str, site: str, members: list[str], secret: bytes, timeout: float, log: Callable[[str], None]
) -> list[str]:
    """HMAC challenge among ``members`` in ``store`` (sealed, namespaced) for round ``key``; the
    ones that proved the secret to ``site`` (and back), ``site`` included, sorted. A peer that does
    not answer within the bound is left out of this round (the round goes on without it)."""
    nonce = secrets.token_hex(16)
    store.set(f"nonce/{site}", nonce)
    others = [m for m in members if m != site]
    deadline = time.monotonic() + timeout * 2
    present = wait_keys(store, [f"nonce/{m}" for m in others], deadline)
    for k in present:
        peer = k.split("/", 1)[1]
        theirs = store.get(k)
        if theirs is not None:
            store.set(f"proof/{peer}/{site}", join_proof(secret, key, theirs.decode(), site))
    got = wait_keys(store, [f"proof/{site}/{m}" for m in others], deadline)
    ok = []
    for k in got:
        peer = k.rsplit("/", 1)[1]
        proof = store.get(k)
        if proof is not None and hmac.compare_digest(proof.decode(), join_proof(secret, key, nonce, peer)):
            ok.append(peer)
        else:
            log(f"site {peer!r} failed authentication in round {key}: left out")
    return sorted([site, *ok])
