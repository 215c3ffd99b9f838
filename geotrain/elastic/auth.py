"""Who may take part in a round: the shared membership secret and the HMAC challenge.

Every site proves knowledge of the secret to every other by HMAC-SHA256 over the other's fresh
nonce, bound to the round; the secret never crosses the wire. A site whose proof fails is told
so (``refused/<site>`` in the round store) and left out of the round's process group.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

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
        try:
            data = Path(cfg.secret_file).expanduser().read_bytes().strip()
        except OSError as exc:
            raise MembershipRefused(f"elastic.secret_file: cannot read {cfg.secret_file} ({exc.strerror})") from None
    else:
        data = os.environ.get(cfg.secret_env, "").encode()
    if len(data) < 16:
        where = f"elastic.secret_file ({cfg.secret_file})" if cfg.secret_file else f"environment variable {cfg.secret_env}"
        raise MembershipRefused(f"no membership secret of at least 16 bytes in {where}")
    return data


def join_proof(secret: bytes, round_key: str, verifier_nonce: str, prover: str) -> str:
    """HMAC-SHA256 proof that ``prover`` holds ``secret``, bound to the round and the verifier's fresh nonce."""
    msg = f"geotrain-join|{round_key}|{verifier_nonce}|{prover}".encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def authenticate(
    store: dist.Store, key: str, site: str, members: list[str], secret: bytes, timeout: float, log: Callable[[str], None]
) -> list[str]:
    """HMAC challenge among ``members`` in ``store`` for round ``key``; the ones that proved the
    secret to ``site`` (and back), ``site`` included, sorted.

    Raises:
        MembershipRefused: no peer's proof verified here and a peer refused ours.
    """
    nonce = secrets.token_hex(16)
    store.set(f"nonce/{site}", nonce)
    others = [m for m in members if m != site]
    deadline = time.monotonic() + timeout * 2
    present = wait_keys(store, [f"nonce/{m}" for m in others], deadline)
    for k in present:
        peer = k.split("/", 1)[1]
        store.set(f"proof/{peer}/{site}", join_proof(secret, key, store.get(k).decode(), site))
    got = wait_keys(store, [f"proof/{site}/{m}" for m in others], deadline)
    ok = []
    for k in got:
        peer = k.rsplit("/", 1)[1]
        if hmac.compare_digest(store.get(k).decode(), join_proof(secret, key, nonce, peer)):
            ok.append(peer)
        else:
            store.set(f"refused/{peer}", f"refused by {site}")
            log(f"site {peer!r} failed authentication (wrong secret): refused")
    # refused: no peer's proof verified here and a peer said ours did not verify there (one of
    # the two alone may be a slow peer, or an impostor writing to the store)
    refusal = [f"refused/{site}"]
    if others and not ok and wait_keys(store, refusal, time.monotonic() + timeout):
        raise MembershipRefused(
            f"site {site!r} was refused by its peers and could not authenticate any of them: the "
            f"membership secret differs (elastic.secret_env / elastic.secret_file)"
        )
    return sorted([site, *ok])
