"""geotrain data prepare and the memory-mapped token loader: round trips, bad input, sharing out, exact resume."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from geotrain.config import DataConfig
from geotrain.data import build_rank_data, check_data, vocab_size
from geotrain.data.prepare import BLOCK_TOKENS, PrepareError, prepare
from geotrain.data.tokens import TokenShards, rank_blocks, read_manifest, token_sampler, verify
from tests.helpers import read_summary, train_cli

pytestmark = pytest.mark.timeout(120)

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
    "sigma",
    "tau",
]


def _docs(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(50, 400)))) + " é ✓." for _ in range(n)]


def _ids_in_order(root: Path) -> np.ndarray:
    """The prepared token stream, blocks put back in their original order (eval every k-th)."""
    m = read_manifest(root)
    every = max(2, round(1 / m["eval_fraction"]))
    streams = {
        s: np.concatenate([np.fromfile(root / sh["file"], dtype=m["dtype"]) for sh in m["shards"][s]]) for s in ("train", "eval")
    }
    pos = {"train": 0, "eval": 0}
    out, b = [], 0
    while pos["train"] < streams["train"].size or pos["eval"] < streams["eval"].size:
        s = "eval" if b % every == every - 1 else "train"
        out.append(streams[s][pos[s] : pos[s] + BLOCK_TOKENS])
        pos[s] += BLOCK_TOKENS
        b += 1
    return np.concatenate(out).astype(np.int64)


def test_bytes_tokenizer_round_trips_jsonl_and_text(tmp_path: Path) -> None:
    docs = _docs(60)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[:40])))
    (tmp_path / "b.txt").write_text(docs[40])
    m = prepare([tmp_path / "a.jsonl", tmp_path / "b.txt"], "bytes", tmp_path / "out", eval_fraction=0.1, shard_tokens=10_000)
    assert m["vocab_size"] == 256 and m["dtype"] == "uint16" and m["documents"] == 41
    assert len(m["shards"]["train"]) > 1  # cut into several shard files
    expected = b"".join(d.encode() for d in docs[:41])
    assert bytes(_ids_in_order(tmp_path / "out").astype(np.uint8)) == expected
    verify(tmp_path / "out")


def test_bpe_round_trips_parquet_and_a_directory(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    docs = _docs(80, seed=1)
    pq.write_table(pa.table({"body": docs[:50], "n": list(range(50))}), tmp_path / "d.parquet")
    (tmp_path / "dir" / ".hidden").mkdir(parents=True)
    for i, d in enumerate(docs[50:]):
        (tmp_path / "dir" / f"{i:02d}.md").write_text(d)
    (tmp_path / "dir" / ".hidden" / "x.txt").write_text("not read")
    (tmp_path / "dir" / "empty.py").write_text("")  # empty files inside a tree are skipped
    m = prepare(
        [tmp_path / "d.parquet", tmp_path / "dir"], "bpe", tmp_path / "out", vocab_size=400, text_field="body", eval_fraction=0.2
    )
    assert 257 < m["vocab_size"] <= 400 and m["documents"] == 80 and m["eot_id"] is not None  # few words: fewer merges
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    ids = _ids_in_order(tmp_path / "out")
    assert ids.max() < m["vocab_size"]
    pieces = np.split(ids, np.flatnonzero(ids == m["eot_id"]) + 1)
    assert [tok.decode(p[:-1].tolist()) for p in pieces if p.size] == docs


def test_a_saved_tokenizer_is_loaded_and_its_vocabulary_sets_the_dtype(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70_000)} | {"<|endoftext|>": 70_000}, unk_token="w0"))
    big.pre_tokenizer = pre_tokenizers.Whitespace()
    big.save(str(tmp_path / "big.json"))
    (tmp_path / "t.txt").write_text(" ".join(f"w{i}" for i in range(0, 70_000, 7)))
    with pytest.raises(PrepareError, match="uint16 cannot hold the ids.*70001.*use uint32"):
        prepare([tmp_path / "t.txt"], str(tmp_path / "big.json"), tmp_path / "o16", dtype="uint16", eval_fraction=0.4)
    m = prepare([tmp_path / "t.txt"], str(tmp_path / "big.json"), tmp_path / "o32", eval_fraction=0.4)
    assert m["dtype"] == "uint32" and m["vocab_size"] == 70_001
    ids = _ids_in_order(tmp_path / "o32")
    assert ids[:3].tolist() == [0, 7, 14] and ids[-1] == 70_000
    # a Hugging Face tokenizer directory (save_pretrained), read with no network
    PreTrainedTokenizerFast(tokenizer_object=big).save_pretrained(tmp_path / "hfdir")
    assert prepare([tmp_path / "t.txt"], str(tmp_path / "hfdir"), tmp_path / "ohf", eval_fraction=0.4)["vocab_size"] == 70_001


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda d: d / "missing.txt", "missing.txt: not found"),
        (lambda d: (d / "e.txt").write_text("  \n") and d / "e.txt", "e.txt: empty"),
        (lambda d: (d / "b.txt").write_bytes(b"ab\0cd" * 10) and d / "b.txt", "b.txt: binary"),
        (lambda d: (d / "l.txt").write_bytes(b"caf\xe9") and d / "l.txt", "l.txt: not UTF-8"),
        (lambda d: Path("/proc/self/mem"), "/proc/self/mem: cannot read"),
        (
            lambda d: (d / "j.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n') and d / "j.jsonl",
            "j.jsonl:2: no string field 'text'",
        ),
        (lambda d: (d / "k.jsonl").write_text("[1, 2\n") and d / "k.jsonl", "k.jsonl:1: not a JSON object"),
        (lambda d: (d / "p.parquet").write_text("not parquet") and d / "p.parquet", "p.parquet: not a readable Parquet"),
        (lambda d: (d / "sub").mkdir() or d / "sub", "sub: no files to read in this directory"),
        (
            lambda d: (d / "bin").mkdir() or (d / "bin" / "a.dat").write_bytes(b"\0\1") and d / "bin",
            "bin: no text to read (1 skipped: 1 binary (a NUL byte))",
        ),
    ],
)
def test_bad_input_is_refused_naming_it(tmp_path: Path, make, needle: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PrepareError, match=re.escape(needle)):
        prepare([make(tmp_path)], "bytes", tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written is left behind


def test_bad_options_and_a_full_output_directory_are_refused(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("hello " * 3000)
    with pytest.raises(PrepareError, match="--tokenizer: .*nope.json: not found"):
        prepare([tmp_path / "t.txt"], str(tmp_path / "nope.json"), tmp_path / "o")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(PrepareError, match="--out: .* not an empty directory"):
        prepare([tmp_path / "t.txt"], "bytes", tmp_path / "full")
    with pytest.raises(PrepareError, match="too little text: 5 blocks of 4096 tokens, none held out"):
        prepare([tmp_path / "t.txt"], "bytes", tmp_path / "small")  # 18 KB: 5 blocks, none held out at 5%
    assert not (tmp_path / "small").exists()


def test_cli_bad_input_is_one_line_exit_2(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "geotrain", "data", "prepare", str(tmp_path / "nope"), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [f"geotrain: data prepare: {tmp_path / 'nope'}: not found"]


@pytest.fixture
def prepared(tmp_path: Path) -> Path:
    (tmp_path / "c.txt").write_text("\n".join(_docs(400, seed=2)))
    prepare([tmp_path / "c.txt"], "bytes", tmp_path / "tok", shard_tokens=30_000)
    return tmp_path / "tok"


@pytest.mark.parametrize("non_iid", [False, True])
@pytest.mark.parametrize("sites", [(2, 2, 2), (3, 2, 1)])
def test_blocks_are_shared_out_disjointly_and_completely(non_iid: bool, sites: tuple[int, ...]) -> None:
    n = 103
    seen: list[int] = []
    per_site = [0] * len(sites)
    r = 0
    for s, workers in enumerate(sites):
        for _ in range(workers):
            b = rank_blocks(n, r, sites, non_iid)
            seen += list(range(b.start, b.start + b.stride * b.count, b.stride))
            per_site[s] += b.count
            r += 1
    assert sorted(seen) == list(range(n))
    for s, workers in enumerate(sites):  # in proportion to workers (within a block per rank)
        assert abs(per_site[s] - n * workers / sum(sites)) <= workers


def test_windows_are_contiguous_pieces_of_one_shard_and_resume_exactly(prepared: Path) -> None:
    shards = TokenShards(prepared, "train", block_size=64, reader="mmap")
    assert len(shards.maps) > 1 and shards.n_blocks == sum(-(-(len(mm) - 64) // BLOCK_TOKENS) for mm in shards.maps)
    # shard 0 holds 30,000 tokens: 7 whole blocks and a short 8th of 1,328 that still gives whole windows
    assert shards.maps[0].size == 30_000 and shards.first_block[1] == 8
    assert np.array_equal(shards.window(7, 1263, 65), shards.maps[0][-65:])
    assert np.array_equal(shards.window(7, 1264, 65), shards.maps[0][7 * 4096 : 7 * 4096 + 65])  # offsets wrap
    reader = TokenShards(prepared, "train", block_size=64)  # the default: pread, nothing mapped
    reader.MAX_OPEN = 1  # one descriptor open at a time, however many shards
    for b in range(shards.n_blocks):
        assert np.array_equal(reader.window(b, 77 * b, 65), shards.window(b, 77 * b, 65))
    assert reader.maps is None and len(reader._fds) == 1
    text = b"".join(bytes(np.asarray(mm)) for mm in shards.maps)  # uint16 bytes: text byte then 0
    a = token_sampler(prepared, 1, [2, 2], False, 64, 8, seed=7)
    x, y = a.next()
    assert x.shape == (8, 64) and torch.equal(x[:, 1:], y[:, :-1])
    for row in torch.cat([x, y[:, -1:]], 1):
        assert row.to(torch.int16).numpy().tobytes() in text
    a.next()
    state = a.state()
    want = [a.next() for _ in range(3)]
    b = token_sampler(prepared, 1, [2, 2], False, 64, 8, seed=7)
    b.set_state(state)
    assert all(
        torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(want, [b.next() for _ in range(3)], strict=True)
    )
    c = token_sampler(prepared, 1, [2, 2], False, 64, 8, seed=7)
    c.skip(2)  # a healed site catching up draws what the others drew
    assert torch.equal(c.next()[0], want[0][0])


def test_rank_data_vocabulary_and_launch_checks(prepared: Path, tmp_path: Path) -> None:
    cfg = DataConfig(corpus=str(prepared))
    assert vocab_size(cfg) == 256 and vocab_size(DataConfig()) == 256
    d0 = build_rank_data(cfg, 0, [2, 2], 64, 4, 3, seed=1)
    d3 = build_rank_data(cfg, 3, [2, 2], 64, 4, 3, seed=1)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(d0.eval, d3.eval, strict=True))  # same eval batches
    assert not torch.equal(d0.train.next()[0], d3.train.next()[0])
    check_data(cfg, [2, 2], 64)
    with pytest.raises(ValueError, match=r"leave rank \d+ of 1000 none"):
        check_data(cfg, [500, 500], 64)
    (tmp_path / "o.txt").write_text("\n".join(_docs(200, seed=3)))
    prepare([tmp_path / "o.txt"], "bpe", tmp_path / "other", vocab_size=300)
    with pytest.raises(ValueError, match=r"topology.sites\[1\].corpus: prepared with another tokenizer"):
        check_data(cfg, [2, 2], 64, [None, str(tmp_path / "other")])
    with pytest.raises(ValueError, match=r"topology.sites\[0\].corpus: data.corpus is token shards"):
        check_data(cfg, [2, 2], 64, [str(tmp_path / "o.txt"), None])
    (prepared / "train-00001.bin").write_bytes(b"\0" * 10)  # truncated shard
    with pytest.raises(ValueError, match="train-00001.bin: missing or not"):
        check_data(cfg, [2, 2], 64)


def test_verify_finds_a_flipped_byte_of_the_right_size(prepared: Path) -> None:
    geo = [sys.executable, "-m", "geotrain", "data", "verify", str(prepared)]
    ok = subprocess.run(geo, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "sha256 as recorded" in ok.stdout
    shard = prepared / "train-00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[1001] ^= 1  # same size: only the hash can tell
    shard.write_bytes(bytes(raw))
    bad = subprocess.run(geo, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [f"geotrain: data verify: {shard}: sha256 differs from the manifest"]


def test_training_on_prepared_bpe_shards(tmp_path: Path) -> None:
    """A 2-site run reads the shards; the model's vocabulary is the tokenizer's."""
    (tmp_path / "c.txt").write_text("\n".join(_docs(300, seed=4)))
    prepare([tmp_path / "c.txt"], "bpe", tmp_path / "tok", vocab_size=320, eval_fraction=0.2)
    out = tmp_path / "run"
    train_cli(out, [f"data.corpus={tmp_path / 'tok'}", "train.steps=20", "sync.H=10"], timeout=180)
    s = read_summary(out)
    assert s["final_eval_loss"] < 5.5  # ln(320) = 5.77 for a uniform guess over the vocabulary
    assert len(set(s["global_param_hash"].values())) == 1
    assert torch.load(out / "final_model.pt", weights_only=True)["wte.weight"].shape[0] == 320


def test_bench_scale_grows_a_valid_directory_and_probes_both_readers(prepared: Path, tmp_path: Path) -> None:
    from geotrain.bench.scale import _grown, probe

    size = _grown(prepared, tmp_path / "big", 400_000)
    verify(tmp_path / "big")  # a real prepared directory: manifest, sizes and hashes agree
    assert size >= 400_000 and read_manifest(tmp_path / "big")["tokens"]["train"] * 2 == size
    for reader in ("pread", "mmap"):
        p = probe(tmp_path / "big", 20, reader)
        assert p["tokens_per_second"] > 0 and p["rss_bytes"] >= p["rss_anon_bytes"] > 0


def test_a_missing_tokenizers_library_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "t.txt").write_text("hello " * 3000)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails as if it were not installed
    with pytest.raises(PrepareError, match=r"^--tokenizer bpe: needs the Hugging Face tokenizers library"):
        prepare([tmp_path / "t.txt"], "bpe", tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_shard_bytes_follow_the_dtype_prepare_chose(tmp_path: Path) -> None:
    """--shard-mib is bytes: with uint32 ids a shard holds half the tokens it would as uint16."""
    (tmp_path / "t.txt").write_text("\n".join(_docs(200, seed=5)))
    for dtype, tokens in (("uint16", 20_000), ("uint32", 10_000)):
        m = prepare([tmp_path / "t.txt"], "bytes", tmp_path / dtype, dtype=dtype, shard_bytes=40_000)
        assert m["shards"]["train"][0]["tokens"] == tokens
        assert (tmp_path / dtype / "train-00000.bin").stat().st_size == 40_000


def _mixed_tree(root: Path) -> Path:
    """A folder as a user has one: texts without a suffix or with one no list knew, sources, a
    binary, a Latin-1 file, something hidden."""
    d = root / "mixed"
    (d / "licenses").mkdir(parents=True)
    (d / "src").mkdir()
    (d / ".git").mkdir()
    for i in range(3):
        (d / "licenses" / f"LICENSE-{i}").write_text(f"licence {i}: permission is granted " * 300)
    (d / "src" / "main.c").write_text("int main(void) { return 0; }\n" * 400)
    (d / "src" / "lib.rs").write_text("fn main() {}\n" * 400)
    (d / "paper.tex").write_text("\\section{Intro} text " * 400)
    (d / "src" / "util.py").write_text("print('hello')\n" * 400)
    (d / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(100))
    (d / "old.txt").write_bytes(b"caf\xe9 " * 100)
    (d / "blank.md").write_text("   \n")
    (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return d


def test_a_folder_is_read_by_content_and_what_is_skipped_is_said(tmp_path: Path) -> None:
    d = _mixed_tree(tmp_path)
    m = prepare([d], "bytes", tmp_path / "all", eval_fraction=0.2)
    assert m["documents"] == 7  # 3 licences, main.c, lib.rs, paper.tex, util.py
    assert m["skipped"] == {
        str(d / "blank.md"): "empty",
        str(d / "image.png"): "binary (a NUL byte)",
        str(d / "old.txt"): "not UTF-8 text (byte 3)",
    }  # (hidden paths are never read, and not listed)
    only = prepare([d], "bytes", tmp_path / "only", include=("LICENSE-*", "*.c"), exclude=("*-2",), eval_fraction=0.2)
    assert only["documents"] == 3 and only["include"] == ["LICENSE-*", "*.c"] and only["exclude"] == ["*-2"]
    assert only["skipped"][str(d / "licenses" / "LICENSE-2")] == "excluded by --exclude *-2"
    assert only["skipped"][str(d / "src" / "lib.rs")] == "not matched by --include LICENSE-* *.c"
    by_path = prepare([d], "bytes", tmp_path / "src", include=("src/*",), eval_fraction=0.2)
    assert by_path["documents"] == 3  # globs match the path below the folder too


def test_cli_says_what_it_skipped(tmp_path: Path) -> None:
    d = _mixed_tree(tmp_path)
    p = subprocess.run(
        [sys.executable, "-m", "geotrain", "data", "prepare", str(d), "--out", str(tmp_path / "o"), "--tokenizer", "bytes",
         "--eval-fraction", "0.2", "--exclude", "*.rs"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    out = " ".join(p.stdout.split())
    assert "6 documents" in out
    assert "4 files skipped: 1 binary (a NUL byte), 1 empty, 1 excluded by --exclude *.rs, 1 not UTF-8 text" in out, out
    assert "manifest.json lists them" in out
