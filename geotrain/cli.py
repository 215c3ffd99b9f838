"""The ``geotrain`` command line.

``geotrain train`` with no arguments is the main job: DiLoCo on 2 sites x 2 workers and the DDP
baseline on the same tokens, then a side-by-side table, ``OUT/loss.png`` and
``OUT/summary.json``. Config errors print one line naming the field and exit with code 2.
Torch is imported only once the config is valid, so bad input is rejected fast.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from geotrain.config import Config, load_config
from geotrain.errors import CheckpointError, ConfigError, LaunchError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Train one model across several datacenters.")
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)
T = TypeVar("T")

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML config file.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", help="Override: KEY=VALUE, e.g. train.steps=200 (repeatable).")]
OutOpt = Annotated[Path, typer.Option("--out", "-o", help="Output directory.")]


def _fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr, no traceback, exit ``code`` (2: bad input)."""
    err_console.print(f"geotrain: {message}", markup=False, highlight=False)
    raise typer.Exit(code) from None


def _write_json(out: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=float) + "\n")
    console.print(f"wrote {path}")


def _load(config: Path | None, overrides: list[str] | None) -> Config:
    try:
        return load_config(config, overrides or [])
    except ConfigError as exc:
        _fail(f"config error: {exc}")


def _scenario_step(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``; a :class:`ConfigError` becomes a one-line 'scenario error' and exit code 2."""
    try:
        return fn(*args)
    except ConfigError as exc:
        _fail(f"scenario error: {exc}")


def _wide(width: int) -> Console:
    """A console at least ``width`` columns wide, for tables (wider than a pipe's 80 columns)."""
    return Console(soft_wrap=True, width=max(console.width, width))


def _run_one(cfg: Config, out: Path, progress: Progress) -> dict[str, Any]:
    from geotrain.launch.local import launch_local
    from geotrain.report.metrics import last_step

    task = progress.add_task(f"{cfg.sync.algorithm:>6}", total=cfg.train.steps)
    metrics = out / "metrics" / "rank0.jsonl"

    def poll() -> None:
        progress.update(task, completed=last_step(metrics))

    def forward(line: str) -> None:
        progress.console.print(line, markup=False, highlight=False)

    summary = launch_local(cfg, out, console_print=forward, on_poll=poll)
    progress.update(task, completed=cfg.train.steps)
    return summary


@app.command()
def train(config: ConfigOpt = None, set_: SetOpt = None, out: OutOpt = Path("runs/geotrain")) -> None:
    """Train (by default DiLoCo on 2 sites x 2 workers, plus the DDP baseline on the same tokens)."""
    cfg = _load(config, set_)
    from geotrain.comm.topology import Topology
    from geotrain.launch.preflight import preflight
    from geotrain.report.outputs import write_outputs
    from geotrain.report.tables import print_table

    try:
        preflight(cfg)
    except ConfigError as exc:
        _fail(f"config error: {exc}")
    except CheckpointError as exc:
        _fail(f"checkpoint.resume: refused: {exc}")
    topo = Topology.from_config(cfg.topology)
    algorithms: list[str] = [cfg.sync.algorithm]
    if cfg.run.baseline not in ("none", cfg.sync.algorithm):
        algorithms.append(cfg.run.baseline)
    out.mkdir(parents=True, exist_ok=True)
    console.print(f"geotrain: {', '.join(algorithms)} on {topo.describe()}, {cfg.train.steps} steps -> {out}")
    runs = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        for alg in algorithms:
            run_dir = out / alg if len(algorithms) > 1 else out
            try:
                runs.append(_run_one(cfg.with_algorithm(alg), run_dir, progress))
            except LaunchError as exc:
                _fail(f"{alg} run failed: {exc}", 1)
            except KeyboardInterrupt:
                _fail("interrupted; all ranks stopped", 130)
    print_table(runs, console)
    for r in runs:
        if "survivors" in r:  # elastic
            fails = ", ".join(f"{f['kind']} {f['site']} (detected {f['detection_seconds'] or 0:.1f}s)" for f in r["failures"])
            console.print(
                f"elastic: {r['rounds_committed']} rounds committed, {r['rounds_rolled_back']} rolled back; "
                f"survivors {', '.join(r['survivors'])} identical: {'yes' if r['consistent'] else 'NO'}; "
                f"failures: {fails or 'none'}"
            )
    write_outputs(runs, out)
    console.print(f"wrote {out / 'summary.json'}, {out / 'loss.png'}; TensorBoard: tensorboard --logdir {out}")


@app.command("config")
def show_config(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print the config reference instead.")] = False,
) -> None:
    """Validate a config and print it with every default filled in."""
    if markdown:
        from geotrain.config import markdown_reference

        print(markdown_reference())
        return
    cfg = _load(config, set_)
    console.print(yaml.safe_dump(cfg.model_dump(), sort_keys=False), markup=False, highlight=False)


@app.command()
def netsim(
    scenario: Annotated[Path, typer.Argument(help="Scenario YAML (see scenarios/netsim/ and docs/NETSIM.md).")],
    set_: SetOpt = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the result as JSON here.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write fct_cdf.png (completion-time CDF per routing) here.")] = None,
    flows_csv: Annotated[Path | None, typer.Option("--flows", help="Write every flow's completion time as CSV here.")] = None,
) -> None:
    """Size a datacenter fabric and simulate synchronized training traffic (ECMP vs multipath)."""
    from geotrain.netsim.scenario import load_scenario

    sc = _scenario_step(load_scenario, scenario, set_)
    from geotrain.netsim.report import print_report
    from geotrain.netsim.run import plot_fct_cdf, run_scenario, write_flows_csv

    out, flows = _scenario_step(run_scenario, sc)  # some limits are only known once the fabric is built
    print_report(out, _wide(132))
    if json_out is not None:
        _write_json(out, json_out)
    if plot is not None:
        plot_fct_cdf(flows, plot / "fct_cdf.png", f"{sc.name}: {sc.fabric.hosts} hosts")
        console.print(f"wrote {plot / 'fct_cdf.png'}")
    if flows_csv is not None:
        write_flows_csv(flows, flows_csv)
        console.print(f"wrote {flows_csv}")


@app.command()
def plan(
    scenario: Annotated[Path, typer.Argument(help="Scenario YAML (see scenarios/plan/ and docs/PLAN.md).")],
    set_: SetOpt = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the plan as JSON here.")] = None,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Write model_size_vs_months.png and bandwidth_vs_utilization.png here.")
    ] = None,
    netsim: Annotated[Path | None, typer.Option("--netsim", help="Write the layout's traffic as a netsim scenario.")] = None,
) -> None:
    """Plan a (multi-site) training run: facility, scaling law, memory, layout, step time, network, sync strategy."""
    from geotrain.plan.scenario import load_plan

    sc = _scenario_step(load_plan, scenario, set_)
    from geotrain.plan.report import plot_plan, print_plan
    from geotrain.plan.run import run_plan
    from geotrain.plan.tonetsim import write_netsim

    out = _scenario_step(run_plan, sc)  # some inputs only the arithmetic can reject (a budget that buys no rack)
    print_plan(out, _wide(132))
    if json_out is not None:
        _write_json(out, json_out)
    if plot is not None:
        for path in plot_plan(sc, out, plot):
            console.print(f"wrote {path}")
    if netsim is not None:
        console.print(f"wrote {_scenario_step(write_netsim, sc, out, netsim)}: run it with geotrain netsim {netsim}")


@app.command()
def lighthouse(
    bind: Annotated[str, typer.Option(help="HOST:PORT to listen on (a loopback, private or VPN address).")] = "127.0.0.1:29510",
    min_sites: Annotated[int, typer.Option(help="Fewest sites a round needs.")] = 1,
    heartbeat_timeout: Annotated[float, typer.Option(help="Seconds of silence before a site is dropped.")] = 2.0,
) -> None:
    """Run the membership coordinator of elastic runs (torchft's Lighthouse) in the foreground.

    Run it under a supervisor that restarts it (systemd Restart=always, a Kubernetes Deployment):
    while it is down, sites keep doing inner steps and postpone their rounds."""
    from geotrain.elastic.lighthouse import lighthouse_main

    args = ["--bind", bind, "--min-sites", str(min_sites), "--heartbeat-timeout", str(heartbeat_timeout)]
    raise typer.Exit(lighthouse_main(args))


@app.command()
def site(
    site_name: Annotated[str, typer.Option("--site", help="This machine's site: a name from topology.sites.")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
    lighthouse_addr: Annotated[
        str | None, typer.Option("--lighthouse", help="HOST:PORT of the running Lighthouse (default: elastic.lighthouse).")
    ] = None,
    bind: Annotated[
        str, typer.Option(help="This machine's address the other sites reach (its round store and Gloo traffic).")
    ] = "127.0.0.1",
    incarnation: Annotated[
        int, typer.Option(min=0, max=1_000_000, help="0 on the first start; 1, 2, ... when restarting a failed site.")
    ] = 0,
    out: OutOpt = Path("runs/site"),
) -> None:
    """Run one site of an elastic run on this machine (one command per site; docs/ELASTIC.md)."""
    cfg = _load(config, set_)
    from geotrain.launch.site import run_site

    try:
        summary = run_site(cfg, out, site_name, lighthouse_addr, bind, incarnation)
    except ConfigError as exc:
        _fail(f"config error: {exc}")
    except CheckpointError as exc:
        _fail(f"checkpoint.resume: refused: {exc}")
    except LaunchError as exc:
        _fail(f"site failed: {exc}", 1)
    console.print(f"site {site_name} finished; wrote {summary}")


def _ints(text: str, option: str, low: int, high: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        _fail(f"{option}: expected comma-separated whole numbers (got {text!r})")
    if not values or any(not low <= v <= high for v in values):
        _fail(f"{option}: every value must be between {low} and {high} (got {text!r})")
    return values


@app.command()
def chaos(
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report here (default: OUT/chaos.json).")] = None,
    out: OutOpt = Path("runs/chaos"),
    sites: Annotated[int, typer.Option(min=3, max=16, help="Sites (one worker each).")] = 4,
    rounds: Annotated[int, typer.Option(min=5, max=1000, help="DiLoCo rounds.")] = 30,
    H: Annotated[int, typer.Option("--H", min=2, max=1000, help="Inner steps per round.")] = 200,
    failures: Annotated[
        int, typer.Option(min=0, max=1000, help="Site failures to plan (some may be skipped: see the report).")
    ] = 12,
    seeds: Annotated[str, typer.Option("--seeds", help="Seeds of the failure plan, comma-separated (a run each).")] = "0",
    cpu_hogs: Annotated[
        str, typer.Option("--cpu-hogs", help="Busy-looping processes beside the soak, comma-separated (a run each); 0: quiet.")
    ] = "0",
    restart_after: Annotated[float, typer.Option(min=0, max=600, help="Seconds until a failed site restarts.")] = 1.0,
) -> None:
    """Soak elastic training under random site kills and hangs; report rounds, rollbacks, consistency."""
    from geotrain.bench.chaos import chaos_table, run_soaks

    seed_list, hog_list = _ints(seeds, "--seeds", 0, 2**31), _ints(cpu_hogs, "--cpu-hogs", 0, 64)
    try:
        kw = {"sites": sites, "rounds": rounds, "H": H, "failures": failures, "restart_after": restart_after}
        report = run_soaks(out, seed_list, hog_list, console_print=None, **kw)
    except LaunchError as exc:
        _fail(f"chaos run failed: {exc}", 1)
    table = chaos_table(report, f"chaos: {sites} sites, {rounds} rounds of H={H}")
    _wide(120).print(table)
    _write_json(report, json_out or out / "chaos.json")
    if not all(r["consistent"] for r in report["runs"]):
        _fail("survivors' global models differ", 1)


audit_app = typer.Typer(help="The sites' signed audit logs.", no_args_is_help=True, add_completion=False)
app.add_typer(audit_app, name="audit")


@audit_app.command("verify")
def audit_verify_cmd(
    run_dir: Annotated[Path, typer.Argument(help="A run directory holding audit*.jsonl (one per site).")],
    keys: Annotated[
        Path | None, typer.Option("--keys", help="JSON {site: public key hex} pinned out of band (else each log's own).")
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the findings as JSON here.")] = None,
) -> None:
    """Check every site's signed hash chain and the sites' agreement on each round; exit 1 on any finding."""
    from geotrain.privacy.audit import verify_dir

    try:
        lines, findings = verify_dir(run_dir, keys)
    except ValueError as exc:
        _fail(f"audit verify: {exc}")
    for line in lines:
        console.print(line, markup=False, highlight=False)
    if json_out is not None:
        _write_json({"findings": [vars(f) for f in findings]}, json_out)
    if findings:
        _fail(f"audit verify: {len(findings)} finding(s) in {run_dir}", 1)


bench_app = typer.Typer(help="Benchmarks that print a table and write JSON.", no_args_is_help=True, add_completion=False)
app.add_typer(bench_app, name="bench")


@bench_app.command("codecs")
def bench_codecs_cmd(
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
    size_mib: Annotated[float, typer.Option("--size-mib", min=0.001, max=4096, help="fp32 tensor size for throughput.")] = 64,
    reps: Annotated[int, typer.Option(min=1, max=100, help="Timed repetitions (median).")] = 5,
    rank: Annotated[int, typer.Option(min=1, max=1024, help="PowerSGD rank.")] = 4,
) -> None:
    """Every codec: compression ratio, reconstruction error, one-core encode/decode GB/s vs a torch-ops reference."""
    from geotrain.bench.codecs import bench_codecs, print_codecs

    out = bench_codecs(size_mib, reps, rank, progress=lambda m: console.print(f"[dim]{m}[/dim]"))
    print_codecs(out, _wide(160))
    if json_out is not None:
        _write_json(out, json_out)


@bench_app.command("codec-quality")
def bench_codec_quality_cmd(
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write codec_quality.png here (a directory).")] = None,
    out: OutOpt = Path("runs/codec-quality"),
    streaming_h: Annotated[int, typer.Option("--streaming-h", min=1, help="H of the streaming+fp4 point.")] = 100,
    seeds: Annotated[int, typer.Option("--seeds", min=1, max=20, help="Seeds per configuration.")] = 3,
    set_: SetOpt = None,
) -> None:
    """Eval loss vs inter-site bytes at equal tokens over seeds: ddp, diloco, int8, streaming+fp4, sparseloco, muloco."""
    from geotrain.bench.quality import codec_quality, plot_quality, print_quality

    _load(None, set_)  # bad overrides fail here, before any run starts
    try:
        result = codec_quality(out, set_, streaming_h, seeds, progress=lambda m: console.print(f"[dim]{m}[/dim]"))
    except LaunchError as exc:
        _fail(f"a run failed: {exc}", 1)
    print_quality(result, _wide(140))
    if json_out is not None:
        _write_json(result, json_out)
    if plot is not None:
        console.print(f"wrote {plot_quality(result, plot / 'codec_quality.png')}")


@bench_app.command("privacy")
def bench_privacy_cmd(
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
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
        _fail(f"--parts: choose from overhead, keys, quality (got {parts!r})")
    try:
        site_counts = tuple(int(v) for v in sizes.split(","))
        eps_low, eps_high = (float(v) for v in eps.split(","))
    except ValueError:
        _fail(f"--sizes/--eps: expected comma-separated numbers (got {sizes!r}, {eps!r})")
    if any(n < 2 or n > 64 for n in site_counts) or not 0 < eps_low < eps_high:
        _fail("--sizes: site counts between 2 and 64; --eps: 0 < low < high")
    _load(None, set_)
    result: dict[str, Any] = {}
    if "overhead" in chosen:
        console.print("[dim]overhead: secure vs plain aggregation over Gloo[/dim]")
        result["overhead"] = bench_overhead(reps=reps)
    if "keys" in chosen:
        console.print("[dim]key agreement and masking cost[/dim]")
        result["key_agreement"] = bench_key_agreement(site_counts)
    if "quality" in chosen:
        try:
            result["quality"] = bench_quality(out, set_, eps_low, eps_high, progress=lambda m: console.print(f"[dim]{m}[/dim]"))
        except LaunchError as exc:
            _fail(f"a run failed: {exc}", 1)
    print_privacy(result, _wide(150))
    if json_out is not None:
        _write_json(result, json_out)


def _speeds(text: str, option: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        _fail(f"{option}: expected comma-separated bit rates such as 1e7,1e8 (got {text!r})")
    if not values or any(not v > 0 for v in values):
        _fail(f"{option}: every bandwidth must be > 0 bit/s (got {text!r})")
    return values


LatencyOpt = Annotated[float, typer.Option("--latency", min=0, max=10, help="One-way inter-site latency in seconds.")]


@bench_app.command("link")
def bench_link_cmd(
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
    speeds: Annotated[str, typer.Option(help="Link bandwidths in bit/s, comma-separated.")] = "1e7,1e8,1e9",
    latency: LatencyOpt = 0.04,
    reps: Annotated[int, typer.Option(min=1, max=50, help="Timed transfers per point (median).")] = 3,
) -> None:
    """Transfer time over an emulated link vs size/bandwidth + latency, in-process and kernel (root) modes."""
    from geotrain.bench.link import bench_link, print_link

    out = bench_link(_speeds(speeds, "--speeds"), latency, reps=reps)
    print_link(out, _wide(140))
    if json_out is not None:
        _write_json(out, json_out)


@bench_app.command("allreduce")
def bench_allreduce_cmd(
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
    sizes_mib: Annotated[str, typer.Option("--sizes-mib", help="Message sizes in MiB, comma-separated.")] = "1,16,64,128",
    bandwidth: Annotated[float, typer.Option("--bandwidth", min=1, help="Inter-site bandwidth in bit/s.")] = 1e9,
    latency: LatencyOpt = 0.04,
    reps: Annotated[int, typer.Option(min=1, max=50, help="Timed runs per point (median).")] = 3,
    lanes: Annotated[int, typer.Option(min=1, max=64, help="Chunks in flight (sync.lanes).")] = 4,
    chunk_mib: Annotated[float, typer.Option("--chunk-mib", min=0.01, max=1024, help="Chunk size (sync.chunk_bytes).")] = 4,
) -> None:
    """Hierarchical vs flat all-reduce on emulated links: busbw, link utilisation, α-β prediction."""
    from geotrain.bench.allreduce import bench_allreduce, print_allreduce

    sizes = _speeds(sizes_mib, "--sizes-mib")
    out = bench_allreduce(sizes, bandwidth, latency, reps=reps, lanes=lanes, chunk_bytes=int(chunk_mib * (1 << 20)))
    print_allreduce(out, _wide(140))
    if json_out is not None:
        _write_json(out, json_out)


@bench_app.command("wan")
def bench_wan_cmd(
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
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
    _load(None, set_)  # bad overrides fail here, before any run starts
    bws = _speeds(speeds, "--speeds")
    try:
        result = bench_wan(
            out,
            bws,
            latency,
            steps=steps,
            extra=set_,
            timeline_bps=timeline_bps,
            progress=lambda m: console.print(f"[dim]{m}[/dim]"),
        )
    except LaunchError as exc:
        _fail(f"a run failed: {exc}", 1)
    print_wan(result, _wide(140))
    if json_out is not None:
        _write_json(result, json_out)
    if plot is not None:
        console.print(f"wrote {plot_wan(result, plot / 'wan.png')}")
        if result["timeline_run"]:
            console.print(f"wrote {plot_timeline(Path(result['timeline_run']), plot / 'wan_timeline.png')}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
