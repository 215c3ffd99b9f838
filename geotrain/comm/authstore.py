"""A key-value store that only holders of the run's key can reach: where an elastic round's sites meet.

torch's ``TCPStore`` serves any client: it lists its keys, lets anyone delete or overwrite a
value, pre-write the rendezvous records of a Gloo group (and so sit between its ranks), or fill
the host's memory. No maintained store authenticates its clients, so this one does (docs/DESIGN.md):

* **Handshake.** The server sends a fresh 16-byte nonce; the client answers with its own nonce and
  an HMAC-SHA256 over both under the store key; the server proves the key back over the same two
  nonces. A connection that fails, or takes longer than :data:`HANDSHAKE_S`, is closed before any
  request is read. Both nonces are fresh, so a recorded handshake cannot be replayed.
* **Messages.** Every request and answer afterwards is sealed with ChaCha20-Poly1305 under a key
  derived from both nonces (one per direction), the nonce being a message counter: an observer
  learns neither key names nor values, and a message altered, dropped, reordered or replayed ends
  the connection.
* **Bounds.** A value over :data:`MAX_VALUE` bytes, a store over :data:`MAX_BYTES` or
  :data:`MAX_KEYS`, and more than :data:`MAX_CONNECTIONS` open connections are refused; only the
  latest ``keep_scopes`` scopes (the first three parts of a key's ``/`` path: one round of one
  kind) are kept, older ones are deleted as new ones appear.

:class:`AuthStore` is the client, a ``torch.distributed.Store``: Gloo runs its rendezvous through
it (a wait is a series of requests the server answers as soon as a key is written, or after
:data:`MAX_WAIT_S`, so one connection serves several threads and no wait holds it for long).
Every answer is checked before it is used: a malformed one raises :class:`StoreRefused`, which
costs the round, never the run.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from geotrain.comm.procs import listening_socket

MAX_VALUE = 1 << 20  # every value geotrain writes is under 1 KB (addresses, nonces, proofs, votes)
MAX_BYTES = 64 << 20
MAX_KEYS = 65_536
MAX_KEY = 4096  # characters in a key name
MAX_CONNECTIONS = 256
HANDSHAKE_S = 5.0
MAGIC = b"GTS1"
_FRAME = MAX_VALUE + 4096  # the largest sealed message either side reads
SET, GET, ADD, CHECK, CAS, DELETE, COUNT, PRESENT = range(8)
MAX_WAIT_S = 0.05  # the longest a PRESENT request waits on the server (a connection serves several threads)
OK, MISSING, REFUSED = range(3)


class StoreRefused(RuntimeError):
    """The store refused a request (a bound) or the connection failed its authentication."""


# --------------------------------------------------------------------------- wire format


def _fields(*parts: bytes) -> bytes:
    return b"".join(struct.pack(">I", len(p)) + p for p in parts)


def _parse(body: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(body):
        if i + 4 > len(body):
            raise ValueError("truncated field")
        (n,) = struct.unpack_from(">I", body, i)
        if i + 4 + n > len(body):
            raise ValueError("truncated field")
        out.append(body[i + 4 : i + 4 + n])
        i += 4 + n
    return out


def _refused(why: str) -> bytes:
    return _fields(bytes([REFUSED]), why.encode())


def _scope(key: str) -> str:
    """A key's scope: its first three ``/`` parts (namespace, kind, round)."""
    return "/".join(key.split("/")[:3])


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


class _Channel:
    """One authenticated, encrypted connection (either end)."""

    def __init__(self, sock: socket.socket, key: bytes, ns: bytes, nc: bytes, client: bool) -> None:
        def derive(label: bytes) -> ChaCha20Poly1305:
            return ChaCha20Poly1305(hmac.new(key, label + ns + nc, hashlib.sha256).digest())

        c2s, s2c = derive(b"geotrain-store|c2s|"), derive(b"geotrain-store|s2c|")
        self.sock = sock
        self._out, self._in = (c2s, s2c) if client else (s2c, c2s)
        self._sent = self._received = 0

    def send(self, body: bytes) -> None:
        nonce = struct.pack(">4xQ", self._sent)
        self._sent += 1
        sealed = self._out.encrypt(nonce, body, None)
        self.sock.sendall(struct.pack(">I", len(sealed)) + sealed)

    def recv(self) -> bytes:
        (n,) = struct.unpack(">I", _recv_exact(self.sock, 4))
        if n > _FRAME:
            raise StoreRefused(f"a message of {n} bytes (at most {_FRAME})")
        nonce = struct.pack(">4xQ", self._received)
        self._received += 1
        try:
            return self._in.decrypt(nonce, _recv_exact(self.sock, n), None)
        except InvalidTag:
            raise StoreRefused("a message failed its authentication") from None


def _proof(key: bytes, who: bytes, ns: bytes, nc: bytes) -> bytes:
    return hmac.new(key, b"geotrain-store|" + who + b"|" + ns + nc, hashlib.sha256).digest()


# --------------------------------------------------------------------------- server


class AuthStoreServer:
    """The store, served by threads of this process on ``host`` (never a wildcard address).

    Args:
        host: the address to listen on; ``key``: the store key (32 bytes, from the run secret).
        keep_scopes: how many scopes (rounds) are kept before the oldest is deleted.
        log: where refused connections are reported (once per reason).
    """

    def __init__(self, host: str, key: bytes, keep_scopes: int = 32, log: Callable[[str], None] | None = None) -> None:
        self.key, self.keep_scopes = key, keep_scopes
        self._log = log
        self._data: dict[str, bytes] = {}
        self._scopes: OrderedDict[str, set[str]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified on every write: PRESENT waits on it
        self._conns: set[socket.socket] = set()
        self._logged: set[str] = set()
        self.refused = 0  # connections that failed the handshake
        self._sock = listening_socket(host, 128)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="authstore-accept").start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)

    def _note(self, why: str) -> None:
        if self._log is not None and why not in self._logged and len(self._logged) < 16:
            self._logged.add(why)
            self._log(f"round store {self.address}: refused a connection ({why})")

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                full = len(self._conns) >= MAX_CONNECTIONS
                if not full:
                    self._conns.add(conn)
            if full:
                self._note(f"more than {MAX_CONNECTIONS} connections")
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="authstore-conn").start()

    def _handshake(self, conn: socket.socket) -> _Channel | None:
        conn.settimeout(HANDSHAKE_S)
        ns = secrets.token_bytes(16)
        conn.sendall(MAGIC + ns)
        got = _recv_exact(conn, 16 + 32)
        nc, proof = got[:16], got[16:]
        if not hmac.compare_digest(proof, _proof(self.key, b"client", ns, nc)):
            self.refused += 1
            self._note("it does not hold the run's key")
            return None
        conn.sendall(_proof(self.key, b"server", ns, nc))
        conn.settimeout(None)
        return _Channel(conn, self.key, ns, nc, client=False)

    def _serve(self, conn: socket.socket) -> None:
        try:
            ch = self._handshake(conn)
            while ch is not None:
                ch.send(self._answer(_parse(ch.recv())))
        except (OSError, ConnectionError, ValueError, StoreRefused, struct.error):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()

    def _answer(self, req: list[bytes]) -> bytes:
        if not req or len(req[0]) != 1:
            raise ValueError("malformed request")
        op, args = req[0][0], req[1:]
        with self._lock:
            if op == PRESENT and args:  # which of the keys are there, once one that was not is (or after the wait)
                names = [a.decode(errors="replace") for a in args[1:]]
                try:
                    wait_s = min(MAX_WAIT_S, max(0.0, float(args[0])))
                except ValueError:
                    return _refused("present: a malformed wait")
                absent = [n for n in names if n not in self._data]
                if absent and wait_s > 0:
                    self._changed.wait_for(lambda: any(n in self._data for n in absent), timeout=wait_s)
                return _fields(bytes([OK]), bytes(int(n in self._data) for n in names))
            if op == GET and len(args) == 1:
                v = self._data.get(args[0].decode(errors="replace"))
                return _fields(bytes([OK]), v) if v is not None else _fields(bytes([MISSING]))
            if op == CHECK:
                return _fields(bytes([OK if all(a.decode(errors="replace") in self._data for a in args) else MISSING]))
            if op == COUNT and not args:
                return _fields(bytes([OK]), str(len(self._data)).encode())
            if op == DELETE and len(args) == 1:
                found = self._delete(args[0].decode(errors="replace"))
                return _fields(bytes([OK if found else MISSING]))
            if op == SET and len(args) == 2:
                why = self._put(args[0].decode(errors="replace"), args[1])
                return _refused(why) if why else _fields(bytes([OK]))
            if op == ADD and len(args) == 2:
                k = args[0].decode(errors="replace")
                try:
                    n = int(self._data.get(k, b"0")) + int(args[1])
                except ValueError:
                    return _refused("add: the value is not an integer")
                why = self._put(k, str(n).encode())
                return _refused(why) if why else _fields(bytes([OK]), str(n).encode())
            if op == CAS and len(args) == 3:
                k = args[0].decode(errors="replace")
                cur = self._data.get(k)
                if (cur is None and args[1] == b"") or cur == args[1]:
                    why = self._put(k, args[2])
                    if why:
                        return _refused(why)
                    cur = args[2]
                return _fields(bytes([OK]), cur if cur is not None else args[1])
        raise ValueError("malformed request")

    def _put(self, key: str, value: bytes) -> str:
        """Under the lock: store ``value`` within the bounds (a new scope may retire the oldest); why
        it was refused, or an empty string."""
        old = self._data.get(key)
        grow = len(key) + len(value) - (len(key) + len(old) if old is not None else 0)
        if len(value) > MAX_VALUE:
            return f"a value of {len(value)} bytes (at most {MAX_VALUE})"
        if len(key) > MAX_KEY:
            return f"a key of {len(key)} characters (at most {MAX_KEY})"
        scope = _scope(key)
        if scope not in self._scopes:
            self._scopes[scope] = set()
            while len(self._scopes) > self.keep_scopes:
                _, keys = self._scopes.popitem(last=False)
                for k in list(keys):
                    self._delete(k)
        if self._bytes + grow > MAX_BYTES or (old is None and len(self._data) >= MAX_KEYS):
            return f"the store is full ({MAX_BYTES} bytes, {MAX_KEYS} keys)"
        self._data[key] = value
        self._scopes[scope].add(key)
        self._bytes += grow
        self._changed.notify_all()
        return ""

    def _delete(self, key: str) -> bool:
        v = self._data.pop(key, None)
        if v is None:
            return False
        self._bytes -= len(key) + len(v)
        scope = self._scopes.get(_scope(key))
        if scope is not None:
            scope.discard(key)
        return True


# --------------------------------------------------------------------------- client


class AuthStore(dist.Store):
    """A client of an :class:`AuthStoreServer` at ``HOST:PORT``; every operation is bounded by
    ``timeout_s`` (a blocking ``get`` or ``wait`` asks again, each request held by the server at
    most :data:`MAX_WAIT_S`, until then).

    Raises:
        StoreRefused: the server did not prove the key (not our store), or refused a request.
        TimeoutError: the server cannot be reached, or a waited key did not appear in time.
    """

    def __init__(self, address: str, key: bytes, timeout_s: float) -> None:
        super().__init__()
        self.address, self._timeout = address, timeout_s
        host, port = address.rsplit(":", 1)
        self._lock = threading.Lock()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock = socket.create_connection((host.strip("[]"), int(port)), timeout=min(HANDSHAKE_S, timeout_s))
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"round store {address} cannot be reached ({exc.strerror or exc})") from None
                time.sleep(0.05)
        try:
            got = _recv_exact(sock, len(MAGIC) + 16)
            if got[: len(MAGIC)] != MAGIC:
                raise StoreRefused(f"{address} is not a geotrain round store")
            ns, nc = got[len(MAGIC) :], secrets.token_bytes(16)
            sock.sendall(nc + _proof(key, b"client", ns, nc))
            if not hmac.compare_digest(_recv_exact(sock, 32), _proof(key, b"server", ns, nc)):
                raise StoreRefused(f"round store {address} failed to prove the run's key")
        except (OSError, ConnectionError) as exc:
            sock.close()
            raise StoreRefused(f"round store {address} closed the handshake ({exc}): it does not hold the run's key") from None
        except BaseException:
            sock.close()
            raise
        sock.settimeout(timeout_s)
        self._ch = _Channel(sock, key, ns, nc, client=True)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._ch.sock.close()

    def _call(self, op: int, *args: bytes) -> list[bytes]:
        with self._lock:
            self._ch.send(_fields(bytes([op]), *args))
            try:
                got = _parse(self._ch.recv())
            except ValueError:
                raise StoreRefused(f"round store {self.address}: a malformed answer") from None
        if not got or len(got[0]) != 1:
            raise StoreRefused(f"round store {self.address}: a malformed answer")
        if got[0][0] == REFUSED:
            raise StoreRefused(f"round store {self.address} refused: {got[1].decode(errors='replace') if len(got) > 1 else ''}")
        return got

    def _value(self, got: list[bytes]) -> bytes:
        """The value an OK answer carries (a store holding the key may still answer badly)."""
        if got[0][0] != OK or len(got) != 2:
            raise StoreRefused(f"round store {self.address}: a malformed answer")
        return got[1]

    def _number(self, got: list[bytes]) -> int:
        try:
            return int(self._value(got))
        except ValueError:
            raise StoreRefused(f"round store {self.address}: a malformed answer") from None

    @staticmethod
    def _b(x: str | bytes) -> bytes:
        return x.encode() if isinstance(x, str) else bytes(x)

    def set(self, key: str, value: str | bytes) -> None:  # type: ignore[override]
        self._call(SET, key.encode(), self._b(value))

    def get(self, key: str) -> bytes:  # type: ignore[override]
        self.wait([key])
        got = self._call(GET, key.encode())
        if got[0][0] == MISSING:
            raise TimeoutError(f"round store {self.address}: key {key!r} was deleted")
        return self._value(got)

    def add(self, key: str, amount: int) -> int:  # type: ignore[override]
        return self._number(self._call(ADD, key.encode(), str(int(amount)).encode()))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:  # type: ignore[override]
        return self._value(self._call(CAS, key.encode(), self._b(expected), self._b(desired)))

    def check(self, keys: list[str]) -> bool:  # type: ignore[override]
        return self._call(CHECK, *(k.encode() for k in keys))[0][0] == OK

    def present(self, keys: list[str], wait_s: float = 0.0) -> list[bool]:
        """Which of ``keys`` are set, in one request; if some are not, the server waits up to
        ``wait_s`` (at most :data:`MAX_WAIT_S`) for one of them to be written, so a waiting loop
        needs no sleep of its own and hears of a key as soon as it is written."""
        flags = self._value(self._call(PRESENT, repr(float(wait_s)).encode(), *(k.encode() for k in keys)))
        if len(flags) != len(keys):
            raise StoreRefused(f"round store {self.address}: a malformed answer")
        return [bool(f) for f in flags]

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        return self._call(DELETE, key.encode())[0][0] == OK

    def num_keys(self) -> int:  # type: ignore[override]
        return self._number(self._call(COUNT))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        limit = timeout.total_seconds() if timeout is not None else self._timeout
        deadline = time.monotonic() + limit
        while not all(self.present(keys, min(MAX_WAIT_S, max(0.0, deadline - time.monotonic())))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"round store {self.address}: {', '.join(keys)[:200]} not set within {limit:.0f}s")
