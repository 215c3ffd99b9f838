"""Processes without the run secret that attack an elastic run on loopback, for a bounded time.
Every byte goes to 127.0.0.1, and only to the Lighthouse and the listeners of the run's processes.

``python -m tests.forger LIGHTHOUSE SECONDS REPORT PID`` (PID: the run's launcher) forges;
``python -m tests.forger replay LIGHTHOUSE SECONDS REPORT SITE`` replays (:func:`replay`).

What it tries (each round it sees), knowing only the Lighthouse's address:
* a fake participant "Z" in the Lighthouse's quorum, claiming a huge committed-round count and
  step (a heal claim: it would be the heal source) and a round store of its own; every other
  request, "Z" makes malformed claims instead: a non-ASCII tag (one such request once stopped
  every site), claims of the wrong types, claims missing, a 100 KB hash (one name throughout: the
  Lighthouse waits for a heartbeating participant to rejoin, so a new name would only delay);
* in every round store it learns from the quorum, as a ``TCPStore`` client would: list the keys
  (to learn the namespace), write votes "0", views, heartbeat counters, ``refused/<site>``,
  nonces, proofs and Gloo rendezvous records for this round's key and the next ones it can guess,
  delete keys, and write 2 MB values (a flood); then the same as a client of geotrain's own store
  protocol with a wrong key. Every one of these must be refused (counted in ``store_refused``);
* garbage bytes sent to every TCP listener of the run's processes (round stores and Gloo pairs).
It writes what it did to REPORT (JSON) so the test knows the attack really ran.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path


def tree(root: int) -> list[int]:
    """``root`` and its descendants (from /proc)."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += [c for c, p in parent.items() if p == pid]
    return out


def listeners(root: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket listening in the process tree of ``root`` (IPv4 and
    IPv6, from /proc/net/tcp{,6}); an address of all zeros is a wildcard."""
    inodes = set()
    for pid in tree(root):
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = str(fd.readlink()) if fd.is_symlink() else ""
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            pass
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            addr, port = f[1].split(":")
            if f[3] == "0A" and f[9] in inodes:
                out.append((addr, int(port, 16)))
    return out


def main(lighthouse: str, seconds: float, report: str, victim: int) -> None:
    import torch.distributed as dist
    from torchft.coordination import LighthouseClient

    done = {"quorums": 0, "store_writes": 0, "store_refused": 0, "garbage_connections": 0, "errors": 0}
    stop = time.monotonic() + seconds
    fake_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    fake = f"127.0.0.1:{fake_store.port}"
    url = f"http://{lighthouse}"

    def heartbeat() -> None:
        client = LighthouseClient(url, connect_timeout=timedelta(seconds=2))
        while time.monotonic() < stop:
            try:
                client.heartbeat("Z", timeout=timedelta(seconds=2))
            except Exception:
                done["errors"] += 1
            time.sleep(0.1)

    threading.Thread(target=heartbeat, daemon=True).start()
    client = LighthouseClient(url, connect_timeout=timedelta(seconds=2))
    huge = 10**9
    claims = {
        "hash": "f" * 64,
        "step": huge,
        "joining": False,
        "committed": huge,
        "store": fake,
        "incarnation": 0,
        "tag": "0" * 64,
    }
    malformed = [  # claims that must be ignored on their own, never stop a site
        {**claims, "tag": "ü" * 64},
        {"hash": None, "step": "x", "joining": "yes", "committed": [1], "store": 5, "tag": 12345},
        {"tag": "a" * 64},
        {**claims, "hash": "h" * 100_000, "tag": "b" * 64},
    ]
    turn = 0
    while time.monotonic() < stop:
        data = claims if turn % 2 == 0 else malformed[(turn // 2) % len(malformed)]
        turn += 1
        try:
            q = client.quorum(
                replica_id="Z",
                timeout=timedelta(seconds=2),
                address=fake,
                store_address=fake,
                step=huge,
                world_size=1,
                data=data,
            )
        except Exception:
            done["errors"] += 1
            time.sleep(0.05)
            continue
        done["quorums"] += 1
        done["malformed"] = done.get("malformed", 0) + (data is not claims)
        sites = [p.replica_id for p in q.participants if p.replica_id != "Z"]
        keys = [f"{q.quorum_id + i}-{q.created.seconds}-{q.created.nanos}" for i in range(2)]
        for p in q.participants:
            if p.replica_id == "Z" or not isinstance(p.store_address, str) or ":" not in p.store_address:
                continue
            if _attack_store(p.store_address, keys, sites):
                done["store_writes"] += 1
            else:
                done["store_refused"] += 1
        for _, port in listeners(victim)[:64]:  # garbage into every listener of the run (stores, Gloo pairs)
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as c:
                    c.sendall(b"\xde\xad\xbe\xef" * 64)
                done["garbage_connections"] += 1
            except OSError:
                pass
        _write(report, done)
    _write(report, done)


def _attack_store(address: str, keys: list[str], sites: list[str]) -> bool:
    """Whether any read, write or delete on the round store at ``address`` got through, first as a
    ``TCPStore`` client, then speaking geotrain's store protocol with a wrong key."""
    import torch.distributed as dist

    from geotrain.comm.authstore import AuthStore

    host, port = address.rsplit(":", 1)
    got_in = False
    with contextlib.suppress(Exception):
        st = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=1))
        with contextlib.suppress(Exception):
            st.list_keys()  # type: ignore[attr-defined]
            got_in = True
        for key in keys:
            for s in sites:
                for k, v in {
                    f"round/{key}/vote/{s}": "0",
                    f"auth/{key}/view/{s}": "Z",
                    f"auth/{key}/refused/{s}": "refused by Z",
                    f"auth/{key}/nonce/{s}": "00",
                    f"pg/{key}/0/0": "garbage",
                    "flood": "x" * 2_000_000,
                }.items():
                    st.set(k, v)
                    got_in = True
        got_in = got_in or bool(st.delete_key(f"round/{keys[0]}/vote/{sites[0]}"))
    with contextlib.suppress(Exception):
        AuthStore(address, b"\0" * 32, 1.0).set("flood", b"x" * 1000)
        got_in = True
    return got_in


def replay(lighthouse: str, seconds: float, report: str, site: str) -> None:
    """Record ``site``'s quorum request as the Lighthouse hands it to anyone (its claims and member
    tag), then send it again and again under ``site``'s name for ``seconds``. Claims replayed from
    an earlier round once made the replayed site a healer that contributed zeros."""
    from torchft.coordination import LighthouseClient

    done = {"recorded": 0, "replays": 0, "errors": 0}
    stop = time.monotonic() + seconds
    client = LighthouseClient(f"http://{lighthouse}", connect_timeout=timedelta(seconds=2))
    recorded = None
    while recorded is None and time.monotonic() < stop:  # watch as a participant of no consequence
        try:
            q = client.quorum(replica_id="W", timeout=timedelta(seconds=3), address="", store_address="", step=0, data={})
            recorded = next((p for p in q.participants if p.replica_id == site and p.data), None)
        except Exception:
            done["errors"] += 1
            time.sleep(0.2)
    if recorded is not None:
        done["recorded"] = 1
        _write(report, done)
        time.sleep(1.0)  # let the run commit a few rounds: the recorded claims are now old
    while recorded is not None and time.monotonic() < stop:
        try:
            client.quorum(
                replica_id=site,
                timeout=timedelta(seconds=2),
                address=recorded.address,
                store_address=recorded.store_address,
                step=recorded.step,
                world_size=recorded.world_size,
                data=recorded.data,
            )
            done["replays"] += 1
        except Exception:
            done["errors"] += 1
        _write(report, done)
    _write(report, done)


def _write(report: str, done: dict[str, int]) -> None:
    """The counts so far, replaced whole (the test may SIGKILL this process at any moment: a plain
    write_text killed between truncating and writing left an empty report, seen in CI)."""
    tmp = Path(report + ".tmp")
    tmp.write_text(json.dumps(done))
    os.replace(tmp, report)


if __name__ == "__main__":
    if sys.argv[1] == "replay":
        replay(sys.argv[2], float(sys.argv[3]), sys.argv[4], sys.argv[5])
    else:
        main(sys.argv[1], float(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
