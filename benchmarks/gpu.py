"""The GPU check (issue 46): geotrain's CUDA path against plain PyTorch loops of the same model on
one GPU, and the codecs on the device. About 5 minutes on one H100; writes
``benchmarks/results/gpu.json``.

1. **Training** at the 124M shape (12 layers, 12 heads, width 768, context 1,024, batch 16,
   byte vocabulary, bf16, AdamW with clipping at 1.0), one site of one worker on NCCL:
   ``geotrain train`` replicated and under FSDP, each with ``train.compile`` off and on, beside a
   plain loop (autocast bf16, ``model.compile()`` when compiled) and a plain FSDP2 loop
   (``fully_shard`` per block and at the root, a bf16 ``MixedPrecisionPolicy``, each block
   compiled before ``fully_shard`` when compiled). The same model class, optimizer and clipping
   in all. Tokens/s is counted over the steps after the first ``--warm`` (compilation done) with
   the device synchronised at both ends: for geotrain, between two steps that end windows of
   ``train.read_every`` (where its clock waits for the device); geotrain's own summary figure,
   over the whole run, compilation included, is reported beside it. MFU = tokens/s × (6N +
   12·layers·width·context) ÷ the device's dense bf16 peak. Peak memory is
   ``torch.cuda.max_memory_allocated``.
2. **Codecs on the device**: every byte codec's encode and decode of 256 MiB of fp32 on the GPU
   (GB/s of fp32 input, median of 5), then a coded sum between two emulated sites in two threads
   of this process (the device path end to end: encode, hand over the device buffers, decode and
   add): both sites end bit-identical, with the bytes the format says, and the time it took.
3. **Where FSDP2's time goes** on one GPU: the plain loop's and the plain FSDP2 loop's step cut
   into forward, backward, clipping and optimizer, the device waited for after each, and FSDP's
   own ranges (all-gather copies, reduce-scatter, hooks) from the profiler.

``--smoke`` runs the same code at a tiny shape on a CPU (Gloo; the codecs through the torch-ops
path a GPU's tensors take), to check the script where no GPU is: its numbers mean nothing, so
give it a ``--json`` of its own.

    python benchmarks/gpu.py [--json benchmarks/results/gpu.json] [--steps 70] [--warm 20] [--only train|codecs|where]
    python benchmarks/gpu.py --smoke [--no-compile] --json /tmp/gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

SHAPE = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "batch": 16}
SMOKE = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64, "batch": 4}
CPU_WHERE = {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 256, "batch": 8}  # --smoke --only where: a CPU's view
CODEC_MIB = 256


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mfu(tokens_per_s: float, fpt: float, device: torch.device) -> float | None:
    from geotrain.report.summary import device_peak

    peak = device_peak(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return tokens_per_s * fpt / peak if peak else None


def _flops_per_token(model: torch.nn.Module, shape: dict[str, int]) -> float:
    from geotrain.report.summary import flops_per_token

    n = sum(p.numel() for p in model.parameters())
    return flops_per_token(n, shape["n_layer"], shape["n_embd"], shape["block_size"])


# ----------------------------------------------------------------------------- geotrain


def geotrain_case(
    out: Path, within: str, compiled: bool, shape: dict[str, int], steps: int, warm: int, cuda: bool
) -> dict[str, Any]:
    """``geotrain train`` on one site of one worker; tokens/s between the window ends after ``warm`` and at the end."""
    from geotrain.config import load_config
    from geotrain.launch.local import launch_local

    window = min(10, warm)
    overrides = [
        "topology.sites=[{name: A, workers: 1}]",
        f"model.n_layer={shape['n_layer']}",
        f"model.n_head={shape['n_head']}",
        f"model.n_embd={shape['n_embd']}",
        f"model.block_size={shape['block_size']}",
        f"train.batch_size={shape['batch']}",
        f"train.steps={steps}",
        f"train.eval_every={steps}",
        "train.eval_batches=1",
        f"train.log_every={window}",
        f"train.read_every={window}",
        f"train.compile={str(compiled).lower()}",
        "train.precision=bf16",
        "train.save_final=false",
        "sync.algorithm=ddp",
        f"sync.within_site={within}",
        f"run.backend={'nccl' if cuda else 'gloo'}",
        "run.baseline=none",
        "report.plot=false",
        "report.html=false",
        "optim.warmup_steps=0",
    ]
    summary: dict[str, Any] = launch_local(load_config(None, overrides), out, console_print=None)
    records = {r["step"]: r for r in map(json.loads, (out / "metrics" / "rank0.jsonl").read_text().splitlines())}
    first = warm - warm % window  # a window's end: the device was waited for there
    a, b = records[first], records[steps]
    tps = (b["tokens"] - a["tokens"]) / (b["elapsed_seconds"] - a["elapsed_seconds"])
    rank = summary["per_rank"][0]
    return {
        "tokens_per_second": tps,
        "step_seconds": (b["elapsed_seconds"] - a["elapsed_seconds"]) / (steps - first),
        "flops_per_token": summary["flops_per_token"],
        "summary_tokens_per_second_per_rank": summary["tokens_per_second_per_rank"],
        "summary_mfu": summary["mfu"],
        "peak_memory_bytes": rank.get("peak_memory_bytes"),
        "final_loss": b["loss"],
    }


# ----------------------------------------------------------------------------- plain loops


def _plain(fsdp: bool, compiled: bool, shape: dict[str, int], device: torch.device) -> tuple[Any, Any, list[torch.Tensor], float]:
    """(model, optimizer, batches, FLOPs per token) of a plain loop: geotrain's GPT (FSDP2 when
    ``fsdp``), AdamW (foreach), random bytes in pinned memory."""
    from geotrain.config import ModelConfig
    from geotrain.models.gpt import GPT

    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=shape["n_layer"], n_head=shape["n_head"], n_embd=shape["n_embd"], block_size=shape["block_size"])
    model = GPT(cfg).to(device)
    fpt = _flops_per_token(model, shape)
    if fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            if compiled:  # its forward only: FSDP's hooks stay outside the compiled code, as geotrain does
                block.forward = torch.compile(block.forward)  # type: ignore[method-assign]
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    elif compiled:
        model.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=4e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (shape["batch"], shape["block_size"] + 1), generator=g) for _ in range(8)]
    if device.type == "cuda":
        batches = [b.pin_memory() for b in batches]
    return model, opt, batches, fpt


def plain_case(fsdp: bool, compiled: bool, shape: dict[str, int], steps: int, warm: int, device: torch.device) -> dict[str, Any]:
    """The same model, optimizer and clipping in a plain loop (FSDP2 when ``fsdp``), batches copied
    from pinned memory without waiting; the device synchronised after ``warm`` steps and at the end."""
    model, opt, batches, fpt = _plain(fsdp, compiled, shape, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = 0.0
    loss = torch.zeros(())
    for step in range(1, steps + 1):
        if step == warm + 1:
            _sync(device)
            t0 = time.perf_counter()
        b = batches[step % len(batches)].to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not fsdp):
            loss = model(b[:, :-1], b[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    _sync(device)
    seconds = time.perf_counter() - t0
    tps = (steps - warm) * shape["batch"] * shape["block_size"] / seconds
    return {
        "tokens_per_second": tps,
        "step_seconds": seconds / (steps - warm),
        "flops_per_token": fpt,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "final_loss": float(loss),
    }


def where_time_goes(fsdp: bool, shape: dict[str, int], device: torch.device, warm: int = 5, steps: int = 10) -> dict[str, Any]:
    """A plain loop's step cut into forward, backward, clipping and the optimizer step, the device
    waited for after each (median ms over ``steps``); then, under FSDP2, the host time of FSDP's
    own record_function ranges per step (its all-gather copy-in and copy-out, the reduce-scatter
    of gradients, its hooks), summed over the blocks, from one profiled step (each range's time
    includes the ranges it encloses)."""
    model, opt, batches, _ = _plain(fsdp, False, shape, device)
    parts: dict[str, list[float]] = {k: [] for k in ("forward", "backward", "clip", "optimizer")}

    def step(i: int, timed: bool) -> None:
        marks = [time.perf_counter()]

        def mark() -> None:
            if timed:
                _sync(device)
                marks.append(time.perf_counter())

        b = batches[i % len(batches)].to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not fsdp):
            loss = model(b[:, :-1], b[:, 1:])
        mark()
        loss.backward()
        mark()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        mark()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark()
        if timed:
            for k, a, z in zip(parts, marks[:-1], marks[1:], strict=True):
                parts[k].append(1000 * (z - a))

    for i in range(warm):
        step(i, False)
    for i in range(steps):
        _sync(device)
        step(i, True)
    out: dict[str, Any] = {k: statistics.median(v) for k, v in parts.items()}
    if fsdp:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(0, False)
            _sync(device)
        ranges: dict[str, float] = {}
        for e in prof.key_averages():
            if e.key.startswith("FSDP::"):  # summed over the blocks ("FSDP::pre_forward (blocks.3)")
                name = e.key.split(" (")[0].split(" for ")[0]
                ranges[name] = ranges.get(name, 0.0) + e.cpu_time_total / 1000
        out["fsdp_ranges_ms"] = dict(sorted(ranges.items(), key=lambda kv: -kv[1]))
    return out


def _one_rank_world(cuda: bool) -> None:
    """A world of one rank for the plain FSDP2 loop (127.0.0.1, a free port)."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)


# ----------------------------------------------------------------------------- codecs


def codec_speeds(device: torch.device, mib: float, reps: int = 5) -> list[dict[str, Any]]:
    """Every byte codec's encode and decode of ``mib`` MiB of fp32 on ``device`` (GB/s of fp32
    input, median of ``reps``), as a run takes them (on a GPU: int8's and the 4-bit codecs'
    elementwise cores compiled), and those three with every core eager too."""
    from geotrain.codecs import CODEC_NAMES, build_codec, torchops

    n = int(mib * (1 << 20)) // 4
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    rows = [_codec_speed(build_codec(name), x, device, reps, "as run") for name in CODEC_NAMES if name != "powersgd"]
    if device.type in torchops.COMPILE_ON:
        kept, torchops.COMPILE_ON = torchops.COMPILE_ON, set()
        try:
            rows += [_codec_speed(build_codec(name), x, device, reps, "eager") for name in ("int8", "int4", "fp4")]
        finally:
            torchops.COMPILE_ON = kept
    return rows


def _codec_speed(codec: Any, x: torch.Tensor, device: torch.device, reps: int, path: str) -> dict[str, Any]:
    from geotrain.bench.codecs import combined
    from geotrain.codecs import relative_error

    n = x.numel()
    out = torch.empty_like(x)
    buf = codec.encode(x)  # (the first call compiles, where the cores are compiled)
    codec.decode(buf, n, out)

    def timed(fn: Any) -> float:
        times = []
        for _ in range(reps):
            _sync(device)
            t = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    enc = timed(lambda: codec.encode(x))
    dec = timed(lambda: codec.decode(buf, n, out))
    gb = 4 * n / 1e9
    return {
        "codec": codec.name,
        "path": path,
        "encode_gbps": gb / enc,
        "decode_gbps": gb / dec,
        "combined_gbps": combined(gb / enc, gb / dec),
        "ratio": codec.ratio(n),
        "rel_error": relative_error(x, codec.decode(buf, n)),
    }


def two_site_exchange(device: torch.device, mib: float) -> list[dict[str, Any]]:
    """A coded sum between two emulated sites (two threads of this process, the buffers handed
    over on the device) for every byte codec: the device path end to end."""
    from geotrain.codecs import CODEC_NAMES, build_codec

    n = int(mib * (1 << 20)) // 4
    return [_coded_pair(build_codec(name), n, device) for name in CODEC_NAMES if name != "powersgd"]


def _coded_pair(codec: Any, n: int, device: torch.device) -> dict[str, Any]:
    from geotrain.codecs import Residual
    from geotrain.comm.coded import coded_sum

    boxes: dict[tuple[int, int], queue.Queue[torch.Tensor]] = {(a, b): queue.Queue() for a in (0, 1) for b in (0, 1)}
    sent = [0, 0]
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(s)).to(device) for s in (0, 1)]
    truth = xs[0] + xs[1]
    errors: list[BaseException] = []

    def site(me: int) -> None:
        def exchange(sends: dict[int, tuple[torch.Tensor, int]], recvs: dict[int, torch.Tensor]) -> None:
            for dst, (buf, _) in sends.items():
                sent[me] += buf.numel()
                boxes[(me, dst)].put(buf.clone())
            for src, into in recvs.items():
                into.copy_(boxes[(src, me)].get(timeout=120))

        try:
            coded_sum(xs[me], codec, [0, 1], me, exchange, Residual() if codec.reduce == "gather" else None, None, lambda r: r)
        except BaseException as exc:  # reported below, after both threads end
            errors.append(exc)

    _sync(device)
    t = time.perf_counter()
    threads = [threading.Thread(target=site, args=(i,)) for i in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    _sync(device)
    seconds = time.perf_counter() - t
    if errors:
        raise errors[0]
    half = [c.numel() for c in torch.empty(n).tensor_split(2)]
    # site 0 sends: a gather codec's encoding of everything; a scatter codec's encoding of chunk 1, then its encoded sum of chunk 0
    expected = (
        codec.encoded_nbytes(n) if codec.reduce == "gather" else codec.encoded_nbytes(half[1]) + codec.encoded_nbytes(half[0])
    )
    return {
        "codec": codec.name,
        "seconds": seconds,
        "fp32_gbps": 4 * n / 1e9 / seconds,
        "identical": bool(torch.equal(xs[0], xs[1])),
        "wire_bytes": sent[0],
        "wire_bytes_expected": expected,
        "rel_error": float((xs[0] - truth).norm() / truth.norm()),
    }


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="benchmarks/results/gpu.json")
    ap.add_argument("--steps", type=int, default=70)
    ap.add_argument("--warm", type=int, default=20)
    ap.add_argument("--only", choices=["train", "codecs", "where"])
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on a CPU: checks the script, measures nothing")
    ap.add_argument("--no-compile", action="store_true", help="leave out the compiled cases")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        sys.exit("benchmarks/gpu.py: no CUDA device here; --smoke checks the script on a CPU (its numbers mean nothing)")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    shape = SHAPE if cuda else SMOKE
    if not cuda:  # a CPU's tensors take the path a GPU's would (geotrain/codecs/base.py: on_kernels)
        os.environ["GEOTRAIN_CODEC_KERNELS"] = "0"
    compiles = (False,) if args.no_compile else (False, True)
    steps, warm = (args.steps, args.warm) if cuda else (12, 4)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "smoke": args.smoke,
        "codec_path": "torch ops (on the device)" if cuda else "torch ops (GEOTRAIN_CODEC_KERNELS=0)",
        "shape": shape,
        "steps": steps,
        "warm": warm,
    }
    t_all = time.perf_counter()
    if args.only in (None, "train"):
        cases: dict[str, dict[str, Any]] = {}
        with tempfile.TemporaryDirectory() as tmp:
            for within in ("replicate", "fsdp"):
                for compiled in compiles:
                    key = f"geotrain {within}{' compiled' if compiled else ''}"
                    print(key, flush=True)
                    cases[key] = geotrain_case(Path(tmp) / key.replace(" ", "-"), within, compiled, shape, steps, warm, cuda)
        for compiled in compiles:
            key = f"plain{' compiled' if compiled else ''}"
            print(key, flush=True)
            cases[key] = plain_case(False, compiled, shape, steps, warm, device)
        _one_rank_world(cuda)
        for compiled in compiles:
            key = f"plain fsdp2{' compiled' if compiled else ''}"
            print(key, flush=True)
            cases[key] = plain_case(True, compiled, shape, steps, warm, device)
        print("where the time goes", flush=True)
        result["where_time_goes_ms"] = {
            k: where_time_goes(f, shape, device) for k, f in (("plain", False), ("plain fsdp2", True))
        }
        for c in cases.values():
            c["mfu"] = _mfu(c["tokens_per_second"], c["flops_per_token"], device)
        ratios = {
            f"{k} / {base}": cases[k]["tokens_per_second"] / cases[base]["tokens_per_second"]
            for k, base in (
                ("geotrain replicate", "plain"),
                ("geotrain replicate compiled", "plain compiled"),
                ("geotrain fsdp", "plain fsdp2"),
                ("geotrain fsdp compiled", "plain fsdp2 compiled"),
                ("plain fsdp2", "plain"),
            )
            if k in cases and base in cases
        }
        result |= {"training": cases, "ratios": ratios}
    if args.only == "where":  # (alone, on a CPU: at a shape where the parts are more than noise)
        shape = shape if cuda else CPU_WHERE
        _one_rank_world(cuda)
        parts = (("plain", False), ("plain fsdp2", True))
        result |= {"shape": shape, "where_time_goes_ms": {k: where_time_goes(f, shape, device) for k, f in parts}}
    if args.only in (None, "codecs"):
        mib = CODEC_MIB if cuda else 1
        print("codecs", flush=True)
        result["codecs"] = {"mib": mib, "speeds": codec_speeds(device, mib), "two_sites": two_site_exchange(device, mib / 4)}
    result["seconds"] = time.perf_counter() - t_all
    _print(result)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json}")


def _print(result: dict[str, Any]) -> None:
    from rich.console import Console

    from geotrain.bench.common import table

    console = Console()
    if "training" in result:
        t = table(f"training on {result['device']}", ["case", "tokens/s", "step ms", "MFU", "peak GiB", "summary tokens/s"])
        for k, c in result["training"].items():
            mem = c["peak_memory_bytes"]
            t.add_row(
                k,
                f"{c['tokens_per_second']:,.0f}",
                f"{1000 * c['step_seconds']:.1f}",
                "–" if c["mfu"] is None else f"{100 * c['mfu']:.1f}%",
                "–" if mem is None else f"{mem / 2**30:.1f}",
                f"{c['summary_tokens_per_second_per_rank']:,.0f}" if "summary_tokens_per_second_per_rank" in c else "–",
            )
        console.print(t)
        for k, v in result["ratios"].items():
            console.print(f"{k}: {v:.3f}")
    if "where_time_goes_ms" in result:
        t = table(
            "where a step's time goes (ms, the device waited for after each part)",
            ["loop", "forward", "backward", "clip", "optimizer"],
        )
        for k, w in result["where_time_goes_ms"].items():
            t.add_row(k, *(f"{w[p]:.1f}" for p in ("forward", "backward", "clip", "optimizer")))
        console.print(t)
        for k, ms in result["where_time_goes_ms"]["plain fsdp2"].get("fsdp_ranges_ms", {}).items():
            console.print(f"  {k}: {ms:.1f} ms host time in one step")
    if "codecs" in result:
        t = table(
            f"codecs on {result['device']}, {result['codecs']['mib']} MiB",
            ["codec", "path", "encode GB/s", "decode GB/s", "enc+dec GB/s"],
        )
        for r in result["codecs"]["speeds"]:
            t.add_row(r["codec"], r["path"], f"{r['encode_gbps']:.1f}", f"{r['decode_gbps']:.1f}", f"{r['combined_gbps']:.1f}")
        console.print(t)
        t = table("coded sum between two emulated sites", ["codec", "seconds", "identical", "wire bytes", "expected"])
        for r in result["codecs"]["two_sites"]:
            t.add_row(
                r["codec"], f"{r['seconds']:.3f}", str(r["identical"]), f"{r['wire_bytes']:,}", f"{r['wire_bytes_expected']:,}"
            )
        console.print(t)


if __name__ == "__main__":
    main()
