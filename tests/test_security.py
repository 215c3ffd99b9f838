"""Trust across organisations: the control plane's sealed values, member tags and payload MACs
(unit), and a whole elastic run attacked by a process without the secret on loopback, which must
end exactly as the same run unattacked; nothing the run starts listens on a wildcard address."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from geotrain.comm.procs import listening_store
from geotrain.elastic.auth import RunKeys, SealedStore, frame_tag
from tests.forger import listeners
from tests.helpers import read_summary, train_args

pytestmark = pytest.mark.timeout(300)

SECRET = b"the-run-secret-0123456789abcdef"
TWO = "topology:\n  sites: [{name: A, workers: 1}, {name: B, workers: 1}]\n"


def test_the_store_listens_on_its_address_only() -> None:
    store = listening_store("127.0.0.1", 5)
    mine = [(a, p) for a, p in listeners(os.getpid()) if p == store.port]
    assert mine == [("0100007F", store.port)]  # 127.0.0.1, not 0.0.0.0 / ::


def test_sealed_values_refuse_forgery_replay_and_substitution() -> None:
    raw = listening_store("127.0.0.1", 5)
    keys = RunKeys(SECRET)
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


def test_frame_tags_bind_content_and_context() -> None:
    key = RunKeys(SECRET).payload
    x = torch.randn(1000)
    t = frame_tag(key, b"r1|A|B|0|ring1", x)
    y = x.clone()
    y.view(torch.uint8)[5] ^= 1
    assert frame_tag(key, b"r1|A|B|0|ring1", y) != t
    assert frame_tag(key, b"r1|A|B|0|ring2", x) != t  # another position: a replayed frame fails
    assert frame_tag(key, b"r1|C|B|0|ring1", x) != t


def _run(tmp_path: Path, name: str, attack: bool) -> tuple[dict, dict | None, list[tuple[str, int]]]:
    from geotrain.config import ElasticConfig
    from geotrain.elastic.lighthouse import LighthouseProcess

    out = tmp_path / name
    env = {**os.environ, "GEOTRAIN_SECRET": SECRET.decode()}
    lh = LighthouseProcess(0, ElasticConfig(), tmp_path / f"{name}-lighthouse.log")
    lh.start()
    overrides = ["elastic.enabled=true", "sync.H=10", "train.eval_every=0", "train.steps=120"]
    args = train_args(out, [*overrides, f"elastic.lighthouse={lh.address}"], TWO)
    run = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    forger, report, seen = None, tmp_path / f"{name}-forger.json", set()
    try:
        if attack:
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
    clean, _, listening = _run(tmp_path, "clean", attack=False)
    attacked, did, listening2 = _run(tmp_path, "attacked", attack=True)
    # the attack ran: a fake quorum member with a huge heal claim, forged store keys, garbage
    assert did is not None and did["quorums"] >= 3 and did["store_writes"] > 0 and did["garbage_connections"] > 0, did
    assert did["malformed"] >= 2, did  # malformed participants too (a non-ASCII tag once stopped every site)
    for s in (clean, attacked):
        assert s["survivors"] == ["A", "B"] and s["consistent"] and s["rounds_rolled_back"] == 0
    assert attacked["rounds_committed"] == clean["rounds_committed"] == 12
    assert attacked["global_param_hash"] == clean["global_param_hash"]
    # nothing the run started listened on a wildcard address (0.0.0.0 or ::)
    assert listening and listening2
    wildcard = [(a, p) for a, p in listening + listening2 if set(a) == {"0"}]
    assert not wildcard, wildcard


@pytest.mark.slow
def test_a_frame_altered_on_the_path_rolls_the_round_back(tmp_path: Path) -> None:
    from tests.helpers import train_cli

    out = tmp_path / "tamper"
    overrides = ["elastic.enabled=true", "sync.H=10", "train.eval_every=0", "train.steps=60", 'fault.tamper=["B@30"]']
    proc = train_cli(out, overrides, TWO)
    s = read_summary(out)
    assert s["rounds_rolled_back"] == 1 and s["rounds_committed"] == 5 and s["consistent"]
    assert "a frame from site B failed authentication (payload MAC)" in proc.stdout


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
    assert uses == [("geotrain/elastic/member.py", True), ("geotrain/sync/quorum.py", True)], uses
