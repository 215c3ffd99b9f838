"""Trust across organisations: the control plane's sealed values, member tags and payload MACs
(unit), and a whole elastic run attacked by a process without the secret on loopback, which must
end exactly as the same run unattacked; nothing the run starts listens on a wildcard address."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from geotrain.comm.authstore import AuthStore, AuthStoreServer
from geotrain.elastic.auth import CHUNK, FrameCipher, RunKeys, SealedStore, sealed_size
from tests.forger import listeners
from tests.helpers import read_summary, train_args

pytestmark = pytest.mark.timeout(300)

SECRET = b"the-run-secret-0123456789abcdef"
TWO = "topology:\n  sites: [{name: A, workers: 1}, {name: B, workers: 1}]\n"


def test_the_store_listens_on_its_address_only() -> None:
    store = AuthStoreServer("127.0.0.1", RunKeys(SECRET).store)
    mine = [(a, p) for a, p in listeners(os.getpid()) if p == store.port]
    store.close()
    assert mine == [("0100007F", store.port)]  # 127.0.0.1, not 0.0.0.0 / ::


def test_sealed_values_refuse_forgery_replay_and_substitution() -> None:
    keys = RunKeys(SECRET)
    server = AuthStoreServer("127.0.0.1", keys.store)
    raw = AuthStore(server.address, keys.store, 5)
    r1, r2 = SealedStore(raw, keys, "round/1"), SealedStore(raw, keys, "round/2")
    r1.set("vote/A", "1")
    assert r1.get("vote/A") == b"1"
    ns = keys.namespace
    # an outsider without the secret can name only the pre-namespace keys: nothing reads them
    raw.set("round/1/vote/A", "0")
    assert r1.get("vote/A") == b"1"
    # an observer who saw a name and a value on the wire: altered, replayed into another round,
    # or moved under another site's name, the value is refused
    sealed = raw.get(f"{ns}/round/1/vote/A")
    raw.set(f"{ns}/round/1/vote/A", sealed[:-1] + b"0")
    assert r1.get("vote/A") is None
    raw.set(f"{ns}/round/2/vote/A", sealed)
    assert r2.get("vote/A") is None
    raw.set(f"{ns}/round/1/vote/B", sealed)
    assert r1.get("vote/B") is None
    # another secret: another namespace and key
    other = SealedStore(raw, RunKeys(b"another-secret-of-enough-length"), "round/1")
    assert not other.check(["vote/A"])
    server.close()


def test_member_tags_bind_every_claim() -> None:
    keys = RunKeys(SECRET)
    claims = {"hash": "ab", "step": 10, "joining": False, "committed": 1, "store": "127.0.0.1:5", "incarnation": 0}
    data = {**claims, "tag": keys.member_tag("A", claims)}
    assert keys.member_ok("A", data)
    assert not keys.member_ok("B", data)  # another site's name
    for field, value in [("committed", 10**9), ("step", 10**9), ("store", "127.0.0.1:6"), ("incarnation", 1), ("hash", "cd")]:
        assert not keys.member_ok("A", {**data, field: value}), field
    assert not RunKeys(b"another-secret-of-enough-length").member_ok("A", data)


def test_a_malformed_participant_is_ignored_on_its_own_never_an_error() -> None:
    """Anyone who reaches the Lighthouse adds participants: a non-ASCII tag (hmac.compare_digest
    raised TypeError on it, which stopped every site), wrong types, missing fields, claims JSON
    cannot write, a name that is no string. Each is rejected alone; the real member stays."""
    from types import SimpleNamespace

    from geotrain.elastic.view import members_of

    keys = RunKeys(SECRET)
    claims = {"hash": "ab", "step": 3, "joining": False, "committed": 3, "store": "127.0.0.1:5", "incarnation": 0}
    good = SimpleNamespace(
        replica_id="A", data={**claims, "tag": keys.member_tag("A", claims)}, step=3, store_address="127.0.0.1:5"
    )
    bad = [
        {**claims, "tag": "ü" * 64},
        {**claims, "tag": 12345},
        {**claims, "tag": "0" * 63},
        {"tag": "a" * 64},
        {**claims, "hash": {1, 2}, "tag": "c" * 64},  # not JSON
        {**claims, "committed": "3", "tag": keys.member_tag("A", {**claims, "committed": "3"})},  # tagged, wrong type
        ["not", "a", "dict"],
        None,
    ]
    for data in bad:
        if isinstance(data, dict) and data.get("committed") != "3":  # (that one is tagged: its type is members_of's to refuse)
            assert not keys.member_ok("A", data)
    fakes = [SimpleNamespace(replica_id=f"Z{i}", data=d, step=3, store_address="127.0.0.1:5") for i, d in enumerate(bad)]
    fakes.append(SimpleNamespace(replica_id=None, data=good.data, step=3, store_address="127.0.0.1:5"))
    members, rejected = members_of(SimpleNamespace(participants=[*fakes, good]), keys.member_ok)
    assert [m.site for m in members] == ["A"] and len(rejected) == len(fakes)


def test_frames_are_encrypted_and_bound_to_round_context_and_content() -> None:
    from geotrain.elastic.auth import ephemeral, ephemeral_shared, pair_key

    payload = RunKeys(SECRET).payload
    (ea, pa), (eb, pb) = ephemeral(), ephemeral()
    shared = ephemeral_shared(ea, pb)
    assert shared is not None and shared == ephemeral_shared(eb, pa)  # both ends of a pair derive one key
    key = pair_key(payload, shared, "round-1", "A", "B")
    assert key == pair_key(payload, shared, "round-1", "B", "A")
    x = torch.randn(CHUNK // 4 * 2 + 3)  # three chunks, the last one short
    sealed = FrameCipher(key).seal(b"A|B|0|ring1", x)
    assert sealed.numel() == sealed_size(x.numel() * 4) == x.numel() * 4 + 3 * 16
    plain = x.view(torch.uint8).numpy().tobytes()
    assert plain[:64] not in sealed.numpy().tobytes()  # an observer does not see the values
    y = torch.empty_like(x)
    assert FrameCipher(key).open(b"A|B|0|ring1", sealed, y) and torch.equal(x, y)
    altered = sealed.clone()
    altered[CHUNK + 40] ^= 1  # one bit in the second chunk
    cut = sealed[: -(16 + 3 * 4)]  # the last chunk dropped
    other_secret = RunKeys(b"another-secret-of-enough-length").payload
    for k, context, frame in (
        (key, b"A|B|0|ring1", altered),
        (key, b"A|B|0|ring1", cut),
        (key, b"A|B|0|ring2", sealed),  # another position: a replayed frame
        (key, b"C|B|0|ring1", sealed),  # another sender
        (pair_key(payload, shared, "round-2", "A", "B"), b"A|B|0|ring1", sealed),  # another round
        (pair_key(payload, shared, "round-1", "A", "C"), b"A|B|0|ring1", sealed),  # another pair
        (pair_key(payload, ephemeral_shared(ea, ephemeral()[1]) or b"", "round-1", "A", "B"), b"A|B|0|ring1", sealed),
        (pair_key(other_secret, shared, "round-1", "A", "B"), b"A|B|0|ring1", sealed),  # the secret alone is not enough
    ):
        assert not FrameCipher(k).open(context, frame, torch.empty_like(x))
    # a zero or low-order X25519 public key (its shared secret is all zeros) is refused, as is garbage
    for bad in ("00" * 32, "01" + "00" * 31, "e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800", "zz", "ab"):
        assert ephemeral_shared(ea, bad) is None


def _run(
    tmp_path: Path, name: str, attack: bool | str, steps: int = 120, extra: tuple[str, ...] = ()
) -> tuple[dict, dict | None, list[tuple[str, int]]]:
    from geotrain.config import ElasticConfig
    from geotrain.elastic.lighthouse import LighthouseProcess

    out = tmp_path / name
    env = {**os.environ, "GEOTRAIN_SECRET": SECRET.decode()}
    lh = LighthouseProcess(0, ElasticConfig(), tmp_path / f"{name}-lighthouse.log")
    lh.start()
    overrides = ["elastic.enabled=true", "sync.H=10", "train.eval_every=0", f"train.steps={steps}", *extra]
    args = train_args(out, [*overrides, f"elastic.lighthouse={lh.address}"], TWO)
    run = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    forger, report, seen = None, tmp_path / f"{name}-forger.json", set()
    try:
        if attack == "replay":  # site A's recorded claims, replayed under its name
            cmd = [sys.executable, "-m", "tests.forger", "replay", lh.address, "150", str(report), "A"]
            forger = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        elif attack:
            cmd = [sys.executable, "-m", "tests.forger", lh.address, "150", str(report), str(run.pid)]
            forger = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while run.poll() is None:  # who listens where, while the run is up
            seen |= set(listeners(run.pid))
            time.sleep(0.5)
        stdout = run.communicate(timeout=200)[0]
    finally:
        for p in (run, forger):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        lh.stop()
    assert run.returncode == 0, stdout[-3000:]
    return read_summary(out), (json.loads(report.read_text()) if attack else None), sorted(seen)


@pytest.mark.slow
def test_a_process_without_the_secret_changes_nothing(tmp_path: Path) -> None:
    clean, _, listening = _run(tmp_path, "clean", attack=False, steps=50)
    attacked, did, listening2 = _run(tmp_path, "attacked", attack=True, steps=50)
    # the attack ran: a fake quorum member with a huge heal claim, forged store keys, garbage
    assert did is not None and did["quorums"] >= 3 and did["garbage_connections"] > 0, did
    # it reached the round stores, and not one read, write, delete or flood got through
    assert did["store_refused"] > 0 and did["store_writes"] == 0, did
    assert did["malformed"] >= 2, did  # malformed participants too (a non-ASCII tag once stopped every site)
    for s in (clean, attacked):
        assert s["survivors"] == ["A", "B"] and s["consistent"] and s["rounds_rolled_back"] == 0
    assert attacked["rounds_committed"] == clean["rounds_committed"] == 5
    assert attacked["global_param_hash"] == clean["global_param_hash"]
    # nothing the run started listened on a wildcard address (0.0.0.0 or ::)
    assert listening and listening2
    wildcard = [(a, p) for a, p in listening + listening2 if set(a) == {"0"}]
    assert not wildcard, wildcard


@pytest.mark.slow
def test_replayed_claims_decide_nothing(tmp_path: Path) -> None:
    """A process without the secret records site A's quorum request (claims and member tag, which
    the Lighthouse hands to anyone) and replays it under A's name all run long. The replayed claims
    are older than A's: they once made A a healer that contributed zeros to rounds that still
    committed. Now healing is decided from claims made inside the round, bound to its nonces: every
    round that commits has both sites' data, nobody heals, and the sites end on one model."""
    from geotrain.elastic.records import read_rounds

    attacked, did, _ = _run(tmp_path, "replayed", attack="replay", steps=110, extra=("elastic.min_sites=2",))
    # each replay joins one quorum the Lighthouse forms (or times out after 2 s): the run's rounds
    # bound the count, 8 to 20 on 2 cores as the run's length varies
    assert did is not None and did["recorded"] == 1 and did["replays"] >= 5, did
    assert attacked["survivors"] == ["A", "B"] and attacked["consistent"], attacked
    committed = [r for recs in read_rounds(tmp_path / "replayed").values() for r in recs if r["outcome"] == "committed"]
    assert committed and all(r["healers"] == [] and r["contributors"] == 2 for r in committed), committed
    # requests under A's name change when the Lighthouse forms quorums: rounds may roll back
    # (docs/SECURITY.md, "What stays exposed"), never commit without A's data
    assert attacked["rounds_committed"] >= 3, attacked


@pytest.mark.slow
def test_a_frame_altered_on_the_path_rolls_the_round_back(tmp_path: Path) -> None:
    from tests.helpers import train_cli

    out = tmp_path / "tamper"
    overrides = ["elastic.enabled=true", "sync.H=10", "train.eval_every=0", "train.steps=60", 'fault.tamper=["B@30"]']
    proc = train_cli(out, overrides, TWO)
    s = read_summary(out)
    assert s["rounds_rolled_back"] == 1 and s["rounds_committed"] == 5 and s["consistent"]
    assert "a frame from site B failed authentication (AES-GCM tag)" in proc.stdout


@pytest.mark.slow
def test_a_masked_frame_altered_on_the_path_rolls_the_round_back(tmp_path: Path) -> None:
    """Secure aggregation in elastic mode rides the authenticated transport: B's masked frames of
    the round at step 30 are altered after sealing (an attacker on the path); the frame fails
    its AES-GCM tag, that round rolls back on every site, and the other rounds commit with every
    site's masked update."""
    from tests.helpers import train_cli

    three = "topology:\n  sites: [{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}]\n"
    out = tmp_path / "tamper"
    overrides = ["elastic.enabled=true", "sync.H=10", "train.eval_every=0", "train.steps=50", 'fault.tamper=["B@30"]']
    proc = train_cli(out, [*overrides, "privacy.secure_aggregation=true"], three)
    s = read_summary(out)
    assert s["rounds_rolled_back"] == 1 and s["rounds_committed"] == 4 and s["consistent"]
    assert "a frame from site B failed authentication (AES-GCM tag)" in proc.stdout


def test_the_lighthouse_does_not_get_the_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It never needs the run secret: the Lighthouse the launcher starts is not handed it in its
    environment (where any process of the user, or a crash dump, could read it)."""
    from geotrain.config import ElasticConfig
    from geotrain.elastic.lighthouse import LighthouseProcess

    monkeypatch.setenv("GEOTRAIN_SECRET", "a-secret-the-lighthouse-must-not-hold")
    monkeypatch.setenv("MY_SECRET", "another-secret-it-must-not-hold")
    lh = LighthouseProcess(0, ElasticConfig(secret_env="MY_SECRET"), tmp_path / "lh.log")
    lh.start()
    try:
        environ = Path(f"/proc/{lh.proc.pid}/environ").read_bytes()  # type: ignore[union-attr]
    finally:
        lh.stop()
    assert b"GEOTRAIN_SECRET" not in environ and b"MY_SECRET" not in environ
    assert b"GEOTRAIN_PARENT_PID" in environ  # (it is this process's environment, otherwise)


def _gather_rank(rank: int, victim: str) -> str:
    import os
    import pickle

    import torch
    import torch.distributed as dist

    from geotrain.comm.control import all_gather_json

    class Payload:
        def __reduce__(self) -> tuple:
            return (os.remove, (victim,))

    dist.init_process_group("gloo")
    try:
        if rank == 0:  # an honest rank gathers its control values
            try:
                all_gather_json({"hash": "ab"}, dist.group.WORLD)
            except ValueError as exc:
                return str(exc)
            return "accepted"
        # a peer that sends a pickle where the JSON goes, in the same collective's shape
        data = pickle.dumps(Payload())
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64))
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        dist.all_gather([torch.empty(longest, dtype=torch.uint8) for _ in range(2)], mine)
        return "sent"
    finally:
        dist.destroy_process_group()


def test_a_peer_cannot_run_code_through_the_control_plane(tmp_path: Path) -> None:
    """Control values that cross sites travel as JSON, never as pickles: a peer sending a pickle
    that would delete a file is refused by name, and the file stays. No object collective (which
    unpickles what peers send) is left on a group that crosses sites: the two left gather inside a
    site, one trust domain."""
    import re

    from tests.helpers import REPO, run_ranks

    victim = tmp_path / "victim"
    victim.write_text("still here")
    got = run_ranks(2, _gather_rank, str(victim))
    assert got == ["rank 1 of the group sent a control value that is not JSON", "sent"] and victim.exists()
    uses = []
    for f in sorted((REPO / "geotrain").rglob("*.py")):
        for line in f.read_text().splitlines():
            if re.search(
                r"\b(all_gather_object|broadcast_object_list|gather_object|scatter_object_list|send_object_list|recv_object_list)\(",
                line,
            ):
                uses.append((f.relative_to(REPO).as_posix(), "group=self.intra" in line or "group=g.intra" in line))
    assert uses == [("geotrain/elastic/member.py", True), ("geotrain/round/hub.py", True)], uses


def test_the_round_store_serves_only_holders_of_the_key() -> None:
    """The round store authenticates every client before it reads a request, bounds what it holds,
    and keeps only recent rounds: a TCPStore client cannot list, write or delete anything, a client
    with another key is refused, and no one can fill its memory."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    from geotrain.comm import authstore
    from geotrain.comm.authstore import StoreRefused

    key = RunKeys(SECRET).store
    server = AuthStoreServer("127.0.0.1", key, keep_scopes=2)
    try:
        good = AuthStore(server.address, key, 5)
        good.set("ns/round/1/vote/A", "1")
        assert good.get("ns/round/1/vote/A") == b"1" and good.add("ns/round/1/n", 2) == 2
        with pytest.raises(dist.DistNetworkError):  # torch's own client: refused at its first message
            dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=1))
        with pytest.raises(StoreRefused, match="does not hold the run's key"):
            AuthStore(server.address, RunKeys(b"another-secret-of-enough-length").store, 5)
        with socket.create_connection(("127.0.0.1", server.port)) as raw:  # garbage instead of a handshake
            raw.recv(20)
            raw.sendall(b"\xde\xad" * 100)
            try:
                answer = raw.recv(10)
            except ConnectionResetError:  # closed with our bytes unread
                answer = b""
            assert answer == b""  # closed without an answer
        assert server.refused >= 2 and good.get("ns/round/1/vote/A") == b"1"
        # bounds: a value over the limit, and a store that would grow past its total
        with pytest.raises(StoreRefused, match="at most"):
            good.set("ns/round/1/big", b"x" * (authstore.MAX_VALUE + 1))
        for i in range(authstore.MAX_BYTES // authstore.MAX_VALUE + 1):
            try:
                good.set(f"ns/round/1/fill{i}", b"x" * authstore.MAX_VALUE)
            except StoreRefused as exc:
                assert "full" in str(exc)
                break
        else:
            raise AssertionError("the store grew past its bound")
        # a wait ends as soon as the key is written (the server holds each request up to MAX_WAIT_S)
        late = AuthStore(server.address, key, 5)
        threading.Timer(0.3, lambda: late.set("ns/round/1/late", "x")).start()
        t0 = time.monotonic()
        assert good.present(["ns/round/1/vote/A", "ns/round/1/late"], 0.01) == [True, False]
        good.wait(["ns/round/1/late"])
        assert 0.25 < time.monotonic() - t0 < 2.0
        # old rounds are pruned: two newer scopes retire round 1
        good.set("ns/round/2/vote/A", "1")
        good.set("ns/round/3/vote/A", "1")
        assert not good.check(["ns/round/1/vote/A"]) and good.check(["ns/round/3/vote/A"])
        # a message altered on the wire ends the connection, never reaches the store
        ch = good._ch
        ch.sock.sendall(b"\x00\x00\x00\x20" + b"\x01" * 32)
        with pytest.raises((OSError, StoreRefused)):
            good.check(["ns/round/3/vote/A"])
        assert AuthStore(server.address, key, 5).check(["ns/round/3/vote/A"])
    finally:
        server.close()


def test_a_stale_quorum_entry_is_ignored() -> None:
    """A quorum entry older than what its site last proved inside a round (an earlier incarnation,
    or the same incarnation of another process: an earlier run) is a replay: ignored."""
    from types import SimpleNamespace

    from geotrain.elastic.hints import QuorumHints
    from geotrain.elastic.view import Member

    me = SimpleNamespace(site="A", session="s-now", known={"B": (2, "b-now")})

    def stale(site: str, incarnation: int, session: str) -> bool:
        return QuorumHints.stale(me, Member(site, "127.0.0.1:1", 0, "h", False, incarnation, session))  # type: ignore[arg-type]

    assert not stale("B", 2, "b-now") and not stale("B", 3, "b-new")  # live, or restarted since
    assert stale("B", 1, "b-old") and stale("B", 2, "b-earlier-run")
    assert not stale("C", 0, "c") and not stale("A", 0, "s-now") and stale("A", 0, "s-old")


def test_site_identities_sign_and_a_removed_key_is_revoked(tmp_path: Path) -> None:
    from geotrain.comm.identity import Identity, public_hex, site_key

    ka, kb = site_key(tmp_path / "A.key"), site_key(tmp_path / "B.key")
    assert (tmp_path / "A.key").stat().st_mode & 0o777 == 0o600
    pins = tmp_path / "pins.json"
    pins.write_text(json.dumps({"A": public_hex(ka), "B": public_hex(kb)}))
    a, b = Identity("A", ka, pins), Identity("B", kb, pins)
    sig = a.sign(b"claims")
    assert b.verify("A", b"claims", sig)
    assert not b.verify("A", b"other claims", sig) and not b.verify("B", b"claims", sig)  # B cannot pass for A
    assert not b.verify("C", b"claims", sig) and not b.verify("A", b"claims", "zz" * 64) and not b.verify("A", b"claims", 5)
    with pytest.raises(ValueError, match="does not hold the key pinned"):  # a site with another site's key file
        Identity("A", kb, pins)
    pins.write_text(json.dumps({"A": public_hex(ka)}))  # B revoked: A stops trusting it, B stops
    a.refresh()
    assert not a.verify("B", b"claims", b.sign(b"claims"))
    with pytest.raises(ValueError, match="has no key in"):
        b.refresh()
    pins.write_text('{"A": "not a key"}')
    with pytest.raises(ValueError, match="not 64 hex characters"):
        a.refresh()


@pytest.mark.slow
def test_a_revoked_site_is_left_out_and_the_run_goes_on(tmp_path: Path) -> None:
    """Three sites with pinned keys (elastic.site_keys): every claim, proof and vote is signed by its
    site's own key. Site C's entry is removed from the pinned list mid-run: A and B ignore C from
    the next round on and finish on one model; C stops (membership refused) and cannot come back."""
    from geotrain.elastic.records import read_rounds

    keys, pins, out = tmp_path / "keys", tmp_path / "pins.json", tmp_path / "revoked"
    env = {**os.environ, "GEOTRAIN_SECRET": SECRET.decode(), "GEOTRAIN_KEYS_DIR": str(keys)}
    made = subprocess.run(
        [sys.executable, "-m", "geotrain", "keys", "A", "B", "C", "--out", str(pins)], env=env, capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    three = "topology:\n  sites: [{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}]\n"
    overrides = ["elastic.enabled=true", "sync.H=10", "train.eval_every=0", "train.steps=300", f"elastic.site_keys={pins}"]
    run = subprocess.Popen(
        train_args(out, overrides, three), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # revoke C once three rounds committed with it
            recs = read_rounds(out).get("A", []) if (out / "elastic").exists() else []
            if sum(r["outcome"] == "committed" and "C" in r["admitted"] for r in recs) >= 3:
                break
            time.sleep(0.2)
        pinned = json.loads(pins.read_text())
        del pinned["C"]
        pins.write_text(json.dumps(pinned))
        stdout = run.communicate(timeout=240)[0]
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    logs = read_rounds(out)
    with_c = [r for r in logs["A"] if r["outcome"] == "committed" and "C" in r["admitted"]]
    assert len(with_c) >= 3, stdout[-3000:]
    after = logs["A"][logs["A"].index(with_c[-1]) + 1 :]
    committed_after = [r for r in after if r["outcome"] == "committed"]
    assert committed_after and all(r["admitted"] == ["A", "B"] for r in committed_after), after
    text = stdout + "".join(f.read_text() for f in (out / "logs").glob("*.log"))
    assert "has no key in" in text, stdout[-3000:]
    s = read_summary(out)
    assert "A" in s["survivors"] and "B" in s["survivors"] and "C" not in s["survivors"] and s["consistent"], s


def test_a_bug_in_a_round_stops_the_site_a_failing_store_rolls_the_round_back() -> None:
    """A round's failures from peers, the network or the store roll it back; a bug in this process
    (here: claims that cannot be written) stops it with its own error. Before, every exception
    became a rolled-back round, so a bug showed as a run that never synced."""
    from geotrain.elastic.meeting import meet
    from geotrain.elastic.view import RoundView

    keys = RunKeys(SECRET)
    server = AuthStoreServer("127.0.0.1", keys.store)
    client = AuthStore(server.address, keys.store, 2)
    claims = {
        "hash": "h",
        "step": 0,
        "joining": False,
        "committed": 0,
        "store": server.address,
        "incarnation": 0,
        "session": "s",
        "part": 0,
        "rest": 0,
        "pace": 0,
        "link": "",
        "done": False,
    }
    lines: list[str] = []
    with pytest.raises(TypeError):
        meet(
            client,
            keys,
            RoundView(key="k1", meeting=server.address),
            "A",
            ["A"],
            {**claims, "hash": {1}},
            None,
            0.5,
            1,
            lines.append,
        )
    view, members = meet(
        client, keys, RoundView(key="k2", meeting=server.address), "A", ["A"], claims, None, 0.5, 1, lines.append
    )
    assert not view.error and view.admitted == ["A"] and members[0].site == "A"
    server.close()
    view, _ = meet(client, keys, RoundView(key="k3", meeting=server.address), "A", ["A"], claims, None, 0.5, 1, lines.append)
    assert "membership set-up failed" in view.error
