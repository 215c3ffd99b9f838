"""Per-site identities: each site's own Ed25519 key (``cryptography``), and the run's list of the
sites' public keys, the root of trust.

A site's key lives in its keys folder (``<dir>/<site>.key``, PEM, mode 0600, made with its
``<site>.pub`` on first use; ``privacy.keys_dir``, ``$GEOTRAIN_KEYS_DIR`` or
``~/.geotrain/keys``). The audit log signs its lines with it; in elastic mode with
``elastic.site_keys`` set, a site signs what it says in each round (its claims, which carry the
round's ephemeral X25519 key, and its vote), and every other site checks that signature against
the key pinned for that site. The pinned list is a JSON object ``{site: public key hex}`` (what
``geotrain keys`` prints), read again at every round: removing a site's entry revokes it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey


def public_hex(key: Ed25519PrivateKey) -> str:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def site_key(path: Path) -> Ed25519PrivateKey:
    """The site's signing key at ``path`` (PEM, PKCS#8), made (mode 0600) with its ``.pub`` if absent."""
    if path.exists():
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path}: not an Ed25519 private key")
        return key
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    path.with_suffix(".pub").write_text(public_hex(key) + "\n")
    return key


def read_pinned(path: Path) -> dict[str, Ed25519PublicKey]:
    """The pinned public keys in ``path`` (JSON ``{site: 64 hex characters}``).

    Raises:
        ValueError: the file cannot be read or holds anything else (one line naming it).
    """
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read the sites' public keys ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a JSON object of site -> public key hex")
    out = {}
    for site, pub in raw.items():
        try:
            out[str(site)] = Ed25519PublicKey.from_public_bytes(bytes.fromhex(pub))
        except (TypeError, ValueError):
            raise ValueError(f"{path}: the key of site {site!r} is not 64 hex characters of an Ed25519 public key") from None
    return out


class Identity:
    """This site's key and the pinned keys of the run (re-read from ``pinned`` when it changes).

    Raises (at construction and :meth:`refresh`):
        ValueError: the pinned file is unreadable, or this site's key is not (or no longer) the
            one pinned for it (its key was revoked, or this is the wrong key file).
    """

    def __init__(self, site: str, key: Ed25519PrivateKey, pinned: Path) -> None:
        self.site, self.key, self.path = site, key, pinned
        self._stamp: tuple[int, int] | None = None
        self.pinned: dict[str, Ed25519PublicKey] = {}
        self.refresh()

    def refresh(self) -> None:
        """Read the pinned keys again if the file changed."""
        st = self.path.stat()
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        pinned = read_pinned(self.path)
        mine = pinned.get(self.site)
        if mine is None:
            raise ValueError(f"site {self.site!r} has no key in {self.path} (revoked, or never pinned)")
        if mine.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex() != public_hex(self.key):
            raise ValueError(f"site {self.site!r}: its key file does not hold the key pinned for it in {self.path}")
        self.pinned, self._stamp = pinned, stamp

    def sign(self, message: bytes) -> str:
        return self.key.sign(message).hex()

    def verify(self, site: str, message: bytes, signature: object) -> bool:
        """Whether ``signature`` (hex) is ``site``'s over ``message`` under its pinned key. Never raises."""
        pub = self.pinned.get(site)
        if pub is None or not isinstance(signature, str) or len(signature) != 128:
            return False
        try:
            pub.verify(bytes.fromhex(signature), message)
        except (InvalidSignature, ValueError):
            return False
        return True
