"""``geotrain bench scale``: the ``loader`` part here; ``memory``, ``overhead`` and ``gpt2_small``
(FSDP inside sites) in :mod:`geotrain.bench.shard`.

- ``tokens_per_second``: one rank's token loader (the default ``pread`` reader; ``mmap`` beside it) (2 sites x 2 workers, the default
  batch and context) drawing batches as fast as it can, in a fresh process;
- ``training_tokens_per_second``: what one rank of the default run consumes, measured in the same
  benchmark by a short real training run on the same shards (tokens ÷ ranks ÷ wall seconds);
- ``rss_growth_bytes``: a fresh process's resident memory after the same draws from a ~10 MB and
  a ~1 GB shard directory (the large one is the small one's train shards repeated), split into
  anonymous memory (the process's own) and file-backed pages (the shards' page cache it mapped).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from geotrain.bench.common import table

READERS = ("pread", "mmap")
LOADER_TARGETS = {"loader_vs_training": 20.0, "rss_growth_bytes": 50 * 2**20}


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def probe(root: Path | str, batches: int, reader: str = "pread", block_size: int = 64, batch_size: int = 8) -> dict[str, float]:
    """Draw ``batches`` batches as rank 0 of 2 sites x 2 workers; speed and this process's memory."""
    from geotrain.data.tokens import TokenSampler, TokenShards, rank_blocks

    shards = TokenShards(Path(root), "train", block_size, reader)
    sampler = TokenSampler(shards, rank_blocks(shards.n_blocks, 0, [2, 2], False), block_size, batch_size, seed=0)
    sampler.next()  # opened and warm
    t = time.perf_counter()
    for _ in range(batches):
        sampler.next()
    seconds = time.perf_counter() - t
    kib = {k: _status_kib(k) for k in ("VmRSS", "RssAnon", "RssFile")}
    return {
        "tokens_per_second": batches * batch_size * block_size / seconds,
        "rss_bytes": kib["VmRSS"] * 1024,
        "rss_anon_bytes": kib["RssAnon"] * 1024,
        "rss_file_bytes": kib["RssFile"] * 1024,
    }


def _probe_in_fresh_process(root: Path, batches: int, reader: str) -> dict[str, float]:
    code = f"import json; from geotrain.bench.scale import probe; print(json.dumps(probe({str(root)!r}, {batches}, {reader!r})))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    result: dict[str, float] = json.loads(p.stdout.strip().splitlines()[-1])
    return result


def _corpus_text(path: Path, nbytes: int) -> None:
    """``nbytes`` of the default (CPython) corpus as one text file."""
    from geotrain.config import DataConfig
    from geotrain.data import load_corpus

    raw = load_corpus(DataConfig())
    reps = -(-nbytes // len(raw))
    path.write_bytes((raw * reps)[:nbytes])


def _grown(small: Path, big: Path, target_bytes: int) -> int:
    """``big``: ``small`` with its train shards listed again and again (hard copies) up to ``target_bytes``."""
    m = json.loads((small / "manifest.json").read_text())
    big.mkdir(parents=True)
    for sh in m["shards"]["eval"]:
        shutil.copyfile(small / sh["file"], big / sh["file"])
    train, size, i = [], 0, 0
    item = 2 if m["dtype"] == "uint16" else 4
    while size < target_bytes:
        for sh in m["shards"]["train"]:
            name = f"train-{i:05d}.bin"
            shutil.copyfile(small / sh["file"], big / name)
            train.append({**sh, "file": name})
            size += sh["tokens"] * item
            i += 1
    m["shards"]["train"] = train
    m["tokens"]["train"] = sum(sh["tokens"] for sh in train)
    (big / "manifest.json").write_text(json.dumps(m, indent=2))
    return size


def _dir_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.glob("*.bin"))


def bench_loader(
    work: Path, batches: int = 3000, train_steps: int = 60, big_bytes: int = 2**30, progress: Callable[[str], None] = print
) -> dict[str, Any]:
    from geotrain.config import load_config
    from geotrain.data.prepare import prepare
    from geotrain.launch.local import launch_local

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    _corpus_text(work / "corpus.txt", 5 * 2**20)
    progress("preparing ~10 MB of byte-token shards from the CPython corpus")
    prepare([work / "corpus.txt"], "bytes", work / "small", shard_tokens=1 << 20)
    progress(f"repeating them to ~{big_bytes / 2**30:.1f} GiB")
    _grown(work / "small", work / "big", big_bytes)
    probes = {r: {d: _probe_in_fresh_process(work / d, batches, r) for d in ("small", "big")} for r in READERS}
    small, big = probes["pread"]["small"], probes["pread"]["big"]
    progress(f"a {train_steps}-step training run on the same shards (2 sites x 2 workers, defaults)")
    cfg = load_config(
        None, [f"data.corpus={work / 'small'}", "run.baseline=none", f"train.steps={train_steps}", "train.save_final=false"]
    )
    s = launch_local(cfg, work / "run", console_print=None)
    training = s["tokens"] / s["world_size"] / s["wall_seconds"]
    out = {
        "batches": batches,
        "small_dir_bytes": _dir_bytes(work / "small"),
        "big_dir_bytes": _dir_bytes(work / "big"),
        "reader": "pread",
        "small": small,
        "big": big,
        "mmap": {
            **probes["mmap"],
            "rss_growth_bytes": probes["mmap"]["big"]["rss_bytes"] - probes["mmap"]["small"]["rss_bytes"],
        },
        "tokens_per_second": big["tokens_per_second"],
        "training_tokens_per_second": training,
        "ratio": big["tokens_per_second"] / training,
        "rss_growth_bytes": big["rss_bytes"] - small["rss_bytes"],
        "rss_anon_growth_bytes": big["rss_anon_bytes"] - small["rss_anon_bytes"],
        "rss_file_growth_bytes": big["rss_file_bytes"] - small["rss_file_bytes"],
        "training_run": {k: s[k] for k in ("tokens", "wall_seconds", "final_eval_loss")},
    }
    out["targets"] = LOADER_TARGETS
    out["met"] = {
        "loader_vs_training": out["ratio"] >= LOADER_TARGETS["loader_vs_training"],
        "rss_growth_bytes": out["rss_growth_bytes"] <= LOADER_TARGETS["rss_growth_bytes"],
    }
    shutil.rmtree(work / "big", ignore_errors=True)  # 1 GiB of copies
    return out


PARTS = ("loader", "memory", "overhead", "gpt2_small")


def bench_scale(
    work: Path,
    batches: int = 3000,
    big_bytes: int = 2**30,
    progress: Callable[[str], None] = print,
    parts: tuple[str, ...] = PARTS,
    gpt2_steps: int = 20,
) -> dict[str, Any]:
    from geotrain.bench import shard

    out: dict[str, Any] = {"cpus": os.cpu_count(), "seconds": {}}
    for part in parts:
        t = time.perf_counter()
        progress(f"part {part}")
        if part == "loader":
            out["loader"] = bench_loader(work, batches, big_bytes=big_bytes, progress=progress)
        elif part == "memory":
            out["memory"] = shard.bench_memory()
        elif part == "overhead":
            out["overhead"] = shard.bench_overhead()
        else:
            out["gpt2_small"] = shard.bench_gpt2_small(gpt2_steps)
        out["seconds"][part] = time.perf_counter() - t
    out["targets"] = {**LOADER_TARGETS, **shard.TARGETS}
    if "memory" in out:
        out["memory"]["met"] = out["memory"]["ratio"] <= shard.TARGETS["memory_ratio"]
    if "overhead" in out:
        out["overhead"]["met"] = out["overhead"]["median"] <= shard.TARGETS["overhead_median"]
    return out


def print_scale(result: dict[str, Any], console: Any) -> None:
    if "loader" in result:
        _print_loader(result["loader"], console)
    _print_shard(result, console)


def _print_shard(result: dict[str, Any], console: Any) -> None:
    ok = {True: "met", False: "MISSED"}
    mib = 2**20
    if "memory" in result:
        m = result["memory"]
        t = table(
            f"memory per rank: {m['params'] / 1e6:.1f}M-parameter GPT, 2 sites x 2 workers, DiLoCo + AdamW",
            ["", "replicate", "fsdp"],
        )
        for key in ("parameters", "gradients", "inner_optimizer", "outer_state", "total"):
            t.add_row(key.replace("_", " "), f"{m['replicate'][key] / mib:,.1f} MiB", f"{m['fsdp'][key] / mib:,.1f} MiB")
        console.print(t)
        console.print(f"fsdp / replicate: {m['ratio']:.3f} (target <= 0.55: {ok[m['met']]})")
    if "overhead" in result:
        o = result["overhead"]
        console.print(
            f"overhead vs a plain FSDP2 loop (1 site x 2 workers, {len(o['relative'])} alternating blocks of "
            f"{o['steps_per_block']} steps): median {o['median']:+.1%} (target <= 5%: {ok[o['met']]}), "
            f"range {min(o['relative']):+.1%} .. {max(o['relative']):+.1%}"
        )
    if "gpt2_small" in result:
        g = result["gpt2_small"]
        console.print(
            f"gpt2_small ({g['params'] / 1e6:.1f}M, {g['layout']}): loss {g['first_loss']:.3f} -> {g['last_loss']:.3f} in "
            f"{g['steps']} steps, {g['seconds_per_step']:.2f} s/step, bit-identical after the final sync: {g['hashes_agree']}"
        )


def _print_loader(lo: dict[str, Any], console: Any) -> None:
    t = table("geotrain bench scale: loader, pread (rank 0 of 2 sites x 2 workers, batch 8 x 64 tokens)", ["", "~10 MB", "~1 GB"])
    mib = 2**20
    t.add_row("shard bytes", f"{lo['small_dir_bytes'] / mib:,.1f} MiB", f"{lo['big_dir_bytes'] / mib:,.1f} MiB")
    t.add_row("loader tokens/s", f"{lo['small']['tokens_per_second']:,.0f}", f"{lo['big']['tokens_per_second']:,.0f}")
    for key, label in (("rss_bytes", "RSS"), ("rss_anon_bytes", "  anonymous"), ("rss_file_bytes", "  file-backed")):
        t.add_row(label, f"{lo['small'][key] / mib:,.1f} MiB", f"{lo['big'][key] / mib:,.1f} MiB")
    m = lo["mmap"]
    t.add_row("with mmap: tokens/s", f"{m['small']['tokens_per_second']:,.0f}", f"{m['big']['tokens_per_second']:,.0f}")
    t.add_row("with mmap: RSS", f"{m['small']['rss_bytes'] / mib:,.1f} MiB", f"{m['big']['rss_bytes'] / mib:,.1f} MiB")
    console.print(t)
    ok = {True: "met", False: "MISSED"}
    console.print(
        f"loader {lo['tokens_per_second']:,.0f} tokens/s vs training {lo['training_tokens_per_second']:,.0f} tokens/s per rank: "
        f"{lo['ratio']:,.0f}x (target >= 20x: {ok[lo['met']['loader_vs_training']]}); RSS growth 10 MB -> 1 GB: "
        f"{lo['rss_growth_bytes'] / mib:+,.1f} MiB (target <= 50 MiB: {ok[lo['met']['rss_growth_bytes']]}; "
        f"anonymous {lo['rss_anon_growth_bytes'] / mib:+,.1f}, file-backed {lo['rss_file_growth_bytes'] / mib:+,.1f})"
    )
