"""``geotrain bench codecs``: compression ratio, reconstruction error and one-core throughput of
every codec, against a straightforward torch-ops reference of the same format.

Throughput is measured on ``size_mib`` of Gaussian fp32 (the target is stated at 64 MiB) with
one torch thread (numba kernels are single-threaded): GB/s = fp32 input bytes ÷ seconds, the
median of ``reps`` timed runs after a warm-up (which also loads numba's compiled cache).
Reconstruction error is reported on the same Gaussian data and on real pseudo-gradients: the
default model trained for H inner steps from its initialisation, Δ = θ₀ − θ_H.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from geotrain.codecs import CODEC_NAMES, Codec, build_codec, relative_error
from geotrain.codecs import reference as R
from geotrain.codecs.powersgd import PowerSGD

TARGET_COMBINED_GBPS = 0.5
TARGET_SPEEDUP = 5.0
TARGETED = ("int8", "fp4", "int4")


def combined(enc: float, dec: float) -> float:
    """Encode then decode, as one throughput: 1 / (1/enc + 1/dec)."""
    return 1.0 / (1.0 / enc + 1.0 / dec)


def _median_seconds(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def capture_pseudo_gradients(steps: int = 50, seed: int = 0) -> tuple[list[torch.Tensor], float]:
    """Δ = θ₀ − θ_steps of the default model and data, one process (no downloads); and its seconds."""
    from geotrain.config import load_config
    from geotrain.data import build_rank_data
    from geotrain.models import build_model
    from geotrain.worker import build_optimizer

    t0 = time.perf_counter()
    cfg = load_config(None, [f"train.steps={steps}", f"train.seed={seed}", "train.eval_batches=1"])
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    start = [p.detach().clone() for p in model.parameters()]
    data = build_rank_data(cfg.data, 0, 1, 1, cfg.model.block_size, cfg.train.batch_size, 1, cfg.train.seed)
    opt, sched = build_optimizer(cfg, model)
    model.train()
    for _ in range(steps):
        x, y = data.train.next()
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return [(s - p.detach()).float() for s, p in zip(start, model.parameters(), strict=True)], time.perf_counter() - t0


def _reference(name: str, x: torch.Tensor, codec: Codec) -> tuple[Callable[[], Any], Callable[[], Any]] | None:
    """(encode, decode) closures of the torch-ops reference for ``name``, or None if it has none."""
    n = x.numel()
    if name == "int8":
        codes, table = R.int8_encode(x)
        return (lambda: R.int8_encode(x)), (lambda: R.int8_decode(codes, table))
    if name in ("int4", "fp4"):
        fp4 = name == "fp4"
        bs = getattr(codec, "block_size", 64)
        packed, scales = R.block4_encode(x, bs, fp4)
        return (lambda: R.block4_encode(x, bs, fp4)), (lambda: R.block4_decode(packed, scales, n, bs, fp4))
    return None  # none/bf16/fp16/topk: the codec is already plain torch ops


def bench_codecs(
    size_mib: float = 64, reps: int = 5, rank: int = 4, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        say = progress or (lambda _msg: None)
        say("capturing real pseudo-gradients (default model, 50 inner steps)")
        pg, capture_s = capture_pseudo_gradients()
        pg_flat = torch.cat([t.reshape(-1) for t in pg])
        n = int(size_mib * (1 << 20)) // 4
        x = torch.randn(n, generator=torch.Generator().manual_seed(0))
        gbytes = 4 * n / 1e9
        entries = []
        for name in CODEC_NAMES:
            say(f"{name}")
            if name == "powersgd":
                entries.append(_bench_powersgd(pg, pg_flat, rank, reps))
                continue
            codec = build_codec(name)
            buf = codec.encode(x)
            out = torch.empty(n)
            enc_s = _median_seconds(partial(codec.encode, x), reps)
            dec_s = _median_seconds(partial(codec.decode, buf, n, out), reps)
            e: dict[str, Any] = {
                "codec": name,
                "ratio": codec.ratio(n),
                "bits_per_value": 8 * codec.encoded_nbytes(n) / n,
                "rel_error": relative_error(x, codec.decode(buf, n)),
                "rel_error_pseudo_gradient": relative_error(pg_flat, codec.decode(codec.encode(pg_flat), pg_flat.numel())),
                "pseudo_gradient_ratio": codec.ratio(pg_flat.numel()),
                "encode_gbps": gbytes / enc_s,
                "decode_gbps": gbytes / dec_s,
            }
            e["combined_gbps"] = combined(e["encode_gbps"], e["decode_gbps"])
            ref = _reference(name, x, codec)
            if ref is not None:
                r_enc = _median_seconds(ref[0], max(1, reps // 2))
                r_dec = _median_seconds(ref[1], max(1, reps // 2))
                e["reference_encode_gbps"] = gbytes / r_enc
                e["reference_decode_gbps"] = gbytes / r_dec
                e["reference_combined_gbps"] = combined(e["reference_encode_gbps"], e["reference_decode_gbps"])
                e["speedup"] = e["combined_gbps"] / e["reference_combined_gbps"]
            else:
                e["reference_encode_gbps"] = e["encode_gbps"]
                e["reference_decode_gbps"] = e["decode_gbps"]
                e["reference_combined_gbps"] = e["combined_gbps"]
                e["speedup"] = 1.0
            if name in TARGETED:
                e["meets_target"] = e["combined_gbps"] >= TARGET_COMBINED_GBPS and e["speedup"] >= TARGET_SPEEDUP
            entries.append(e)
        return {
            "size_bytes": 4 * n,
            "reps": reps,
            "threads": 1,
            "pseudo_gradient": {"values": pg_flat.numel(), "tensors": len(pg), "inner_steps": 50, "capture_seconds": capture_s},
            "targets": {
                "combined_gbps": TARGET_COMBINED_GBPS,
                "speedup": TARGET_SPEEDUP,
                "codecs": list(TARGETED),
                "int8_rel_error": 0.015,
            },
            "entries": entries,
        }
    finally:
        torch.set_num_threads(threads)


def _bench_powersgd(pg: list[torch.Tensor], pg_flat: torch.Tensor, rank: int, reps: int) -> dict[str, Any]:
    """PowerSGD on the real pseudo-gradient tensors (it needs matrices, so no Gaussian vector)."""

    def one_round(ps: PowerSGD) -> list[torch.Tensor]:
        out = [t.clone() for t in pg]
        ps.all_reduce(out, lambda _t: None)
        return out

    approx = one_round(PowerSGD(rank, error_feedback=False))
    seconds = _median_seconds(lambda: one_round(PowerSGD(rank, error_feedback=False)), reps)
    gbytes = 4 * pg_flat.numel() / 1e9
    wire = PowerSGD(rank).wire_floats([t.shape for t in pg])
    err = relative_error(pg_flat, torch.cat([a.reshape(-1) for a in approx]))
    return {
        "codec": "powersgd",
        "rank": rank,
        "ratio": pg_flat.numel() / wire,
        "bits_per_value": 32 * wire / pg_flat.numel(),
        "rel_error": None,
        "rel_error_pseudo_gradient": err,
        "pseudo_gradient_ratio": pg_flat.numel() / wire,
        "encode_gbps": gbytes / seconds,  # one round: P = MQ, QR, Q = MᵀP, P Qᵀ
        "decode_gbps": None,
        "combined_gbps": gbytes / seconds,
        "reference_encode_gbps": None,
        "reference_decode_gbps": None,
        "reference_combined_gbps": None,
        "speedup": None,
        "note": "single-round approximation without error feedback; quality vs PyTorch's PowerSGD is checked in tests/test_codecs.py",
    }


def _table(title: str, columns: list[str]) -> Any:
    from rich.table import Table

    t = Table(title=title)
    for col in columns:
        t.add_column(col, justify="right")
    return t


def print_codecs(result: dict[str, Any], console: Any) -> None:
    def f(v: Any, fmt: str) -> str:
        return "–" if v is None else format(v, fmt)

    t = _table(
        f"geotrain bench codecs: {result['size_bytes'] / 2**20:.0f} MiB fp32, 1 thread (median of {result['reps']})",
        [
            "codec",
            "ratio",
            "bits/value",
            "rel. error (Gauss)",
            "rel. error (Δ)",
            "encode GB/s",
            "decode GB/s",
            "enc+dec GB/s",
            "reference enc+dec",
            "speed-up",
            "target",
        ],
    )
    for e in result["entries"]:
        target = {True: "met", False: "MISSED"}.get(e.get("meets_target"), "")  # type: ignore[call-overload]
        t.add_row(
            e["codec"],
            f(e["ratio"], ".2f"),
            f(e["bits_per_value"], ".2f"),
            f(e["rel_error"], ".4f"),
            f(e["rel_error_pseudo_gradient"], ".4f"),
            f(e["encode_gbps"], ".2f"),
            f(e["decode_gbps"], ".2f"),
            f(e["combined_gbps"], ".2f"),
            f(e["reference_combined_gbps"], ".3f"),
            f(e["speedup"], ".1f"),
            target,
        )
    console.print(t)


# --------------------------------------------------------------------------- quality sweep

QUALITY_TARGETS = {"streaming_fp4_vs_ddp_loss": 0.015, "streaming_fp4_bytes_reduction": 500.0, "diloco_int8_vs_diloco_loss": 0.01}


def quality_runs(streaming_H: int = 100) -> list[tuple[str, list[str]]]:
    """(label, overrides) for every point of the sweep: equal tokens, the default model and topology."""
    runs = [("ddp", ["sync.algorithm=ddp"])]
    runs += [(f"diloco+{c}", ["sync.algorithm=diloco", f"sync.codec={c}"]) for c in CODEC_NAMES]
    runs.append((f"streaming+fp4 H={streaming_H}", ["sync.algorithm=streaming", "sync.codec=fp4", f"sync.H={streaming_H}"]))
    return runs


def codec_quality(
    out: Path, extra: list[str] | None = None, streaming_H: int = 100, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Train every point of :func:`quality_runs` with the real launcher; eval loss vs inter-site bytes."""
    from geotrain.config import load_config
    from geotrain.launch import launch_local

    say = progress or (lambda _msg: None)
    points = []
    for label, overrides in quality_runs(streaming_H):
        cfg = load_config(None, [*(extra or []), *overrides, "run.baseline=none", "train.save_final=false"])
        say(f"{label}: {cfg.train.steps} steps")
        s = launch_local(cfg, out / label.replace(" ", "_").replace("=", ""), console_print=None)
        points.append(
            {
                "label": label,
                "algorithm": s["algorithm"],
                "codec": s["codec"],
                "H": s["H"],
                "fragments": s["fragments"],
                "tokens": s["tokens"],
                "final_eval_loss": s["final_eval_loss"],
                "inter_site_bytes": s["inter_site_bytes"],
                "compression_ratio": s["compression_ratio"],
                "peak_inter_site_bytes_per_step": s["peak_inter_site_bytes_per_step"],
                "wall_seconds": s["wall_seconds"],
                "hashes_agree": s["hashes_agree_within_sites"] and len(set(s["global_param_hash"].values())) == 1,
            }
        )
    by = {p["label"]: p for p in points}
    ddp, diloco, int8 = by["ddp"], by["diloco+none"], by["diloco+int8"]
    stream = points[-1]
    checks = {
        "streaming_fp4_vs_ddp_loss": stream["final_eval_loss"] / ddp["final_eval_loss"] - 1,
        "streaming_fp4_bytes_reduction": ddp["inter_site_bytes"] / stream["inter_site_bytes"],
        "diloco_int8_vs_diloco_loss": int8["final_eval_loss"] / diloco["final_eval_loss"] - 1,
    }
    met = {
        "streaming_fp4_vs_ddp_loss": checks["streaming_fp4_vs_ddp_loss"] <= QUALITY_TARGETS["streaming_fp4_vs_ddp_loss"],
        "streaming_fp4_bytes_reduction": checks["streaming_fp4_bytes_reduction"]
        >= QUALITY_TARGETS["streaming_fp4_bytes_reduction"],
        "diloco_int8_vs_diloco_loss": checks["diloco_int8_vs_diloco_loss"] <= QUALITY_TARGETS["diloco_int8_vs_diloco_loss"],
    }
    return {"points": points, "checks": checks, "targets": QUALITY_TARGETS, "met": met}


def print_quality(result: dict[str, Any], console: Any) -> None:
    ddp = result["points"][0]
    t = _table(
        "geotrain bench codec-quality: equal tokens, default model, 2 sites x 2 workers",
        ["run", "final eval loss", "vs ddp", "inter-site MB", "fewer bytes than ddp", "compression", "peak MB/step", "wall s"],
    )
    for p in result["points"]:
        t.add_row(
            p["label"],
            f"{p['final_eval_loss']:.4f}",
            f"{100 * (p['final_eval_loss'] / ddp['final_eval_loss'] - 1):+.2f}%",
            f"{p['inter_site_bytes'] / 1e6:,.2f}",
            f"{ddp['inter_site_bytes'] / p['inter_site_bytes']:,.0f}x",
            f"{p['compression_ratio']:.2f}x",
            f"{p['peak_inter_site_bytes_per_step'] / 1e6:.3f}",
            f"{p['wall_seconds']:.0f}",
        )
    console.print(t)
    c, m = result["checks"], result["met"]
    console.print(
        f"streaming+fp4 vs ddp: eval loss {100 * c['streaming_fp4_vs_ddp_loss']:+.2f}% (target <= +1.5%: {'met' if m['streaming_fp4_vs_ddp_loss'] else 'MISSED'}), "
        f"{c['streaming_fp4_bytes_reduction']:,.0f}x fewer inter-site bytes (target >= 500x: {'met' if m['streaming_fp4_bytes_reduction'] else 'MISSED'}); "
        f"diloco+int8 vs diloco: {100 * c['diloco_int8_vs_diloco_loss']:+.2f}% (target <= +1%: {'met' if m['diloco_int8_vs_diloco_loss'] else 'MISSED'})"
    )


def plot_quality(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for p in result["points"]:
        marker = {"ddp": "s", "diloco": "o", "streaming": "*"}[p["algorithm"]]
        label = f"{p['label']}: {p['final_eval_loss']:.3f}"
        ax.scatter(p["inter_site_bytes"], p["final_eval_loss"], marker=marker, s=120 if marker == "*" else 45, label=label)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_xscale("log")
    ax.set_xlabel("total inter-site bytes (log)")
    ax.set_ylabel("final eval loss")
    ax.set_title("Eval loss vs bytes across sites, equal tokens")
    ax.grid(True, alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
