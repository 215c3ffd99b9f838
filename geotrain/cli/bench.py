"""``geotrain bench ...``: benchmarks that print a table and write JSON (their code is in ``geotrain.bench``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from geotrain.cli.common import (
    JsonOpt,
    LatencyOpt,
    OutOpt,
    SetOpt,
    bit_rates,
    console,
    fail,
    ints,
    load,
    progress_line,
    wide,
    write_json,
)
from geotrain.errors import LaunchError

bench_app = typer.Typer(help="Benchmarks that print a table and write JSON.", no_args_is_help=True, add_completion=False)


@bench_app.command("codecs")
def bench_codecs_cmd(
    json_out: JsonOpt = None,
    size_mib: Annotated[float, typer.Option("--size-mib", min=0.001, max=4096, help="fp32 tensor size for throughput.")] = 64,
    reps: Annotated[int, typer.Option(min=1, max=100, help="Timed repetitions (median).")] = 5,
    rank: Annotated[int, typer.Option(min=1, max=1024, help="PowerSGD rank.")] = 4,
) -> None:
    """Every codec: compression ratio, reconstruction error, one-core encode/decode GB/s vs a torch-ops reference."""
    from geotrain.bench.codecs import bench_codecs, print_codecs

    out = bench_codecs(size_mib, reps, rank, progress=progress_line)
    print_codecs(out, wide(160))
    if json_out is not None:
        write_json(out, json_out)


@bench_app.command("codec-quality")
def bench_codec_quality_cmd(
    json_out: JsonOpt = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write codec_quality.png here (a directory).")] = None,
    out: OutOpt = Path("runs/codec-quality"),
    streaming_h: Annotated[int, typer.Option("--streaming-h", min=1, help="H of the streaming+fp4 point.")] = 100,
    seeds: Annotated[int, typer.Option("--seeds", min=1, max=20, help="Seeds per configuration.")] = 3,
    regime: Annotated[
        str,
        typer.Option(
            "--regime",
            help="default: the default model on 2 sites x 2 workers; many: 8 sites x 1 worker, H = 15, --rounds rounds, "
            "a 2-layer GPT (SparseLoCo's regime).",
        ),
    ] = "default",
    rounds: Annotated[int, typer.Option("--rounds", min=1, max=10_000, help="Rounds of the many-round regime.")] = 100,
    sites: Annotated[int, typer.Option("--sites", min=2, max=16, help="Sites (1 worker each) of the many-round regime.")] = 8,
    set_: SetOpt = None,
) -> None:
    """Eval loss vs inter-site bytes at equal tokens over seeds: ddp, diloco, int8, streaming+fp4, sparseloco, muloco."""
    from geotrain.bench.quality import REGIMES, codec_quality, many_rounds, plot_quality, print_quality

    if regime not in REGIMES:
        fail(f"--regime: choose from {', '.join(REGIMES)} (got {regime!r})")
    load(None, [*(many_rounds(rounds, sites) if regime == "many" else []), *(set_ or [])])  # bad overrides fail here
    try:
        result = codec_quality(out, set_, streaming_h, seeds, progress=progress_line, regime=regime, rounds=rounds, sites=sites)
    except LaunchError as exc:
        fail(f"a run failed: {exc}", 1)
    print_quality(result, wide(140))
    if json_out is not None:
        write_json(result, json_out)
    if plot is not None:
        console.print(f"wrote {plot_quality(result, plot / 'codec_quality.png')}")


@bench_app.command("privacy")
def bench_privacy_cmd(
    json_out: JsonOpt = None,
    out: OutOpt = Path("runs/privacy"),
    parts: Annotated[str, typer.Option("--parts", help="Comma-separated: overhead, keys, quality.")] = "overhead,keys,quality",
    sizes: Annotated[str, typer.Option("--sizes", help="Site counts for the key-agreement table.")] = "4,8,16",
    reps: Annotated[int, typer.Option(min=1, max=50, help="Timed aggregation rounds per mode.")] = 5,
    eps: Annotated[str, typer.Option("--eps", help="The two ε values of the quality table (low,high).")] = "2,8",
    set_: SetOpt = None,
) -> None:
    """Secure aggregation overhead (bytes, time) vs plain, key-agreement cost by site count, eval loss with and without privacy."""
    from geotrain.bench.privacy import bench_key_agreement, bench_overhead, bench_quality, print_privacy

    chosen = {p.strip() for p in parts.split(",") if p.strip()}
    if not chosen or chosen - {"overhead", "keys", "quality"}:
        fail(f"--parts: choose from overhead, keys, quality (got {parts!r})")
    try:
        site_counts = tuple(int(v) for v in sizes.split(","))
        eps_low, eps_high = (float(v) for v in eps.split(","))
    except ValueError:
        fail(f"--sizes/--eps: expected comma-separated numbers (got {sizes!r}, {eps!r})")
    if any(n < 2 or n > 64 for n in site_counts) or not 0 < eps_low < eps_high:
        fail("--sizes: site counts between 2 and 64; --eps: 0 < low < high")
    load(None, set_)
    result: dict[str, Any] = {}
    if "overhead" in chosen:
        console.print("[dim]overhead: secure vs plain aggregation over Gloo[/dim]")
        result["overhead"] = bench_overhead(reps=reps)
    if "keys" in chosen:
        console.print("[dim]key agreement and masking cost[/dim]")
        result["key_agreement"] = bench_key_agreement(site_counts)
    if "quality" in chosen:
        try:
            result["quality"] = bench_quality(out, set_, eps_low, eps_high, progress=progress_line)
        except LaunchError as exc:
            fail(f"a run failed: {exc}", 1)
    print_privacy(result, wide(150))
    if json_out is not None:
        write_json(result, json_out)


@bench_app.command("link")
def bench_link_cmd(
    json_out: JsonOpt = None,
    speeds: Annotated[str, typer.Option(help="Link bandwidths in bit/s, comma-separated.")] = "1e7,1e8,1e9",
    latency: LatencyOpt = 0.04,
    reps: Annotated[int, typer.Option(min=1, max=50, help="Timed transfers per point (median).")] = 3,
) -> None:
    """Transfer time over an emulated link vs size/bandwidth + latency, in-process and kernel (root) modes."""
    from geotrain.bench.link import bench_link, print_link

    out = bench_link(bit_rates(speeds, "--speeds"), latency, reps=reps)
    print_link(out, wide(140))
    if json_out is not None:
        write_json(out, json_out)


@bench_app.command("allreduce")
def bench_allreduce_cmd(
    json_out: JsonOpt = None,
    sizes_mib: Annotated[str, typer.Option("--sizes-mib", help="Message sizes in MiB, comma-separated.")] = "1,16,64,128",
    bandwidth: Annotated[float, typer.Option("--bandwidth", min=1, help="Inter-site bandwidth in bit/s.")] = 1e9,
    latency: LatencyOpt = 0.04,
    reps: Annotated[int, typer.Option(min=1, max=50, help="Timed runs per point (median).")] = 3,
    lanes: Annotated[int, typer.Option(min=1, max=64, help="Chunks in flight (sync.lanes).")] = 4,
    chunk_mib: Annotated[float, typer.Option("--chunk-mib", min=0.01, max=1024, help="Chunk size (sync.chunk_bytes).")] = 4,
) -> None:
    """Hierarchical vs flat all-reduce on emulated links: busbw, link utilisation, α-β prediction."""
    from geotrain.bench.allreduce import bench_allreduce, print_allreduce

    sizes = bit_rates(sizes_mib, "--sizes-mib")
    out = bench_allreduce(sizes, bandwidth, latency, reps=reps, lanes=lanes, chunk_bytes=int(chunk_mib * (1 << 20)))
    print_allreduce(out, wide(140))
    if json_out is not None:
        write_json(out, json_out)


@bench_app.command("wan")
def bench_wan_cmd(
    json_out: JsonOpt = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write wan.png and wan_timeline.png here (a directory).")] = None,
    out: OutOpt = Path("runs/bench-wan"),
    speeds: Annotated[str, typer.Option(help="Inter-site bandwidths in bit/s, comma-separated.")] = "1e7,1e8,1e9,1e10",
    latency: LatencyOpt = 0.04,
    steps: Annotated[int, typer.Option(min=10, help="Inner steps per run (ddp fewer on slow links).")] = 150,
    timeline_bps: Annotated[float, typer.Option("--timeline-bps", min=1, help="Link of the timeline run.")] = 1e7,
    tau: Annotated[int, typer.Option(min=0, help="Streaming: steps a fragment's exchange may take (sync.tau).")] = 20,
    set_: SetOpt = None,
) -> None:
    """Compute utilisation, inter-site bytes and loss of ddp, diloco, streaming and eager streaming across link speeds."""
    from geotrain.bench.wan import bench_wan, plot_timeline, plot_wan, print_wan

    set_ = [f"sync.tau={tau}", *(set_ or [])]
    load(None, set_)  # bad overrides fail here, before any run starts
    bws = bit_rates(speeds, "--speeds")
    try:
        result = bench_wan(
            out,
            bws,
            latency,
            steps=steps,
            extra=set_,
            timeline_bps=timeline_bps,
            progress=progress_line,
        )
    except LaunchError as exc:
        fail(f"a run failed: {exc}", 1)
    print_wan(result, wide(140))
    if json_out is not None:
        write_json(result, json_out)
    if plot is not None:
        console.print(f"wrote {plot_wan(result, plot / 'wan.png')}")
        if result["timeline_run"]:
            console.print(f"wrote {plot_timeline(Path(result['timeline_run']), plot / 'wan_timeline.png')}")


def _over_seeds(seeds: str, set_: list[str] | None, run: Callable[[tuple[int, ...]], dict[str, Any]]) -> dict[str, Any]:
    """Check the overrides and ``--seeds`` before any run starts, then ``run(seeds)``; a failed run is one line, exit 1."""
    load(None, set_ or [])
    seed_list = tuple(ints(seeds, "--seeds", 0, 2**31))
    try:
        return run(seed_list)
    except LaunchError as exc:
        fail(f"a run failed: {exc}", 1)


@bench_app.command("hetero")
def bench_hetero_cmd(
    json_out: JsonOpt = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write hetero.png here (a directory).")] = None,
    out: OutOpt = Path("runs/bench-hetero"),
    seconds: Annotated[float, typer.Option(min=5, max=3600, help="Training seconds per run (train.max_seconds).")] = 120.0,
    H: Annotated[int, typer.Option("--H", min=1, max=10000, help="Inner steps per round (the fastest site's).")] = 200,
    seeds: Annotated[str, typer.Option(help="Seeds, comma-separated.")] = "0,1",
    modes: Annotated[
        str,
        typer.Option(
            help="Modes, comma-separated: sync, adaptive, async, async-q2, async-dyn, async-kill (site B killed), async-rejoin (killed, back 10 s later), async-int8."
        ),
    ] = "sync,adaptive,async,async-q2,async-dyn",
    set_: SetOpt = None,
) -> None:
    """Sites at compute speeds 1, 1, 0.5, 0.25 for the same wall time: lock-step DiLoCo, adaptive and asynchronous quorum rounds."""
    from geotrain.bench.hetero import MODES, bench_hetero, plot_hetero, print_hetero

    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    if not chosen or any(m not in MODES for m in chosen):
        fail(f"--modes: {modes!r} (allowed, comma-separated: {', '.join(MODES)})")
    result = _over_seeds(
        seeds, set_, lambda s: bench_hetero(out, seconds, H, s, extra=set_, progress=progress_line, modes=chosen)
    )
    print_hetero(result, wide(140))
    if json_out is not None:
        write_json(result, json_out)
    if plot is not None:
        console.print(f"wrote {plot_hetero(result, plot / 'hetero.png')}")


@bench_app.command("tiers")
def bench_tiers_cmd(
    json_out: JsonOpt = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write tiers_adapt.png here (a directory).")] = None,
    out: OutOpt = Path("runs/bench-tiers"),
    steps: Annotated[int, typer.Option(min=10, max=100_000, help="Inner steps per run (equal tokens).")] = 300,
    H: Annotated[int, typer.Option("--H", min=1, max=10000, help="Inner steps per region round (H1).")] = 25,
    seeds: Annotated[str, typer.Option(help="Seeds, comma-separated.")] = "0,1",
    adapt_steps: Annotated[
        int, typer.Option(min=0, max=100_000, help="Inner steps of the adaptive run with the mid-run slowdown (0: skip it).")
    ] = 1200,
    slowdown_s: Annotated[float, typer.Option(min=1, max=3600, help="When the links between regions slow 10x.")] = 60.0,
    adapt_algorithm: Annotated[
        str, typer.Option(help="The adaptive run's algorithm: diloco, or streaming (the fragment count is chosen too).")
    ] = "diloco",
    adapt_only: Annotated[bool, typer.Option("--adapt-only", help="Run only the adaptive run.")] = False,
    set_: SetOpt = None,
) -> None:
    """Two regions of two sites (10 Gbit/s inside, 10 Mbit/s across): flat DiLoCo vs two tiers, slow-tier bytes and loss;
    then adaptation to a 10x slowdown of the links between regions."""
    if adapt_algorithm not in ("diloco", "streaming"):
        fail(f"--adapt-algorithm: {adapt_algorithm!r} (allowed: diloco, streaming)")
    if adapt_only and not adapt_steps:
        fail("--adapt-only: needs --adapt-steps above 0")
    from geotrain.bench.adapt import plot_adapt
    from geotrain.bench.tiers import bench_tiers, print_tiers

    result = _over_seeds(
        seeds,
        set_,
        lambda s: bench_tiers(
            out,
            steps,
            H,
            s,
            extra=set_,
            progress=progress_line,
            adapt_steps=adapt_steps,
            slowdown_s=slowdown_s,
            adapt_algorithm=adapt_algorithm,
            adapt_only=adapt_only,
        ),
    )
    print_tiers(result, wide(150))
    if json_out is not None:
        write_json(result, json_out)
    if plot is not None and result["adaptive"]:
        name = "tiers_adapt_streaming.png" if adapt_algorithm == "streaming" else "tiers_adapt.png"
        console.print(f"wrote {plot_adapt(result['adaptive'], plot / name)}")


@bench_app.command("place")
def bench_place_cmd(
    json_out: JsonOpt = None,
    out: OutOpt = Path("runs/bench-place"),
    pools: Annotated[str, typer.Option(help="Pools, comma-separated: slow-pair, unequal.")] = "slow-pair,unequal",
    migration: Annotated[bool, typer.Option(help="Also time a migration of one site (elastic, 2 seeds).")] = True,
) -> None:
    """geotrain place's predictions (utilisation, bytes per link) against runs of the configs it writes; chosen vs naive."""
    from geotrain.bench.place import POOLS, bench_place, print_place_bench

    names = tuple(p.strip() for p in pools.split(",") if p.strip())
    bad = [n for n in names if n not in POOLS]
    if bad or not names:
        fail(f"--pools: {', '.join(bad) or 'none given'} (allowed: {', '.join(POOLS)})")
    result = bench_place(out, out / "corpus.txt", names, progress=progress_line, migration=migration)
    print_place_bench(result, wide(150))
    if json_out is not None:
        write_json(result, json_out)


@bench_app.command("scale")
def bench_scale_cmd(
    json_out: JsonOpt = None,
    out: OutOpt = Path("runs/scale"),
    batches: Annotated[int, typer.Option(min=10, max=1_000_000, help="Batches each loader probe draws.")] = 3000,
    big_gib: Annotated[float, typer.Option("--big-gib", min=0.01, max=64, help="Size of the large shard directory.")] = 1.0,
    parts: Annotated[
        str, typer.Option(help="Comma-separated parts to run: loader, memory, overhead, gpt2_small.")
    ] = "loader,memory,overhead,gpt2_small",
    gpt2_steps: Annotated[int, typer.Option(min=2, max=1000, help="Steps of the gpt2_small run.")] = 20,
) -> None:
    """Scale: the token-shard loader (tokens/s vs training, RSS at 10 MB and 1 GB of shards), memory per rank replicated vs FSDP,
    FSDP overhead vs a plain FSDP2 loop, and a 124M GPT-2-shaped DiLoCo + FSDP run (about 15 min on 2 cores)."""
    from geotrain.bench.scale import PARTS, bench_scale, print_scale

    chosen = tuple(p.strip() for p in parts.split(",") if p.strip())
    unknown = [p for p in chosen if p not in PARTS]
    if unknown or not chosen:
        fail(f"--parts: unknown part {', '.join(unknown) or '(none)'} (allowed: {', '.join(PARTS)})", 2)
    try:
        result = bench_scale(out, batches, int(big_gib * 2**30), progress=progress_line, parts=chosen, gpt2_steps=gpt2_steps)
    except LaunchError as exc:
        fail(f"bench scale: training run failed: {exc}", 1)
    print_scale(result, wide(150))
    if json_out is not None:
        write_json(result, json_out)
