"""The ``geotrain`` command line.

``geotrain train`` with no arguments is the main job: DiLoCo on 2 sites x 2 workers and the DDP
baseline on the same tokens, then a side-by-side table, ``OUT/loss.png`` and
``OUT/summary.json``. Config errors print one line naming the field and exit with code 2.
Torch is imported only once the config is valid, so bad input is rejected fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
import yaml
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from geotrain.cli.bench import bench_app
from geotrain.cli.common import ConfigOpt, OutOpt, SetOpt, console, fail, ints, load, scenario_step, wide, write_json
from geotrain.cli.data import data_app
from geotrain.config import Config, load_config
from geotrain.errors import CheckpointError, ConfigError, LaunchError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Train one model across several datacenters.")
app.add_typer(bench_app, name="bench")
app.add_typer(data_app, name="data")


def _prestart_zygote(cfg: Config) -> None:
    """Start the ranks' zygote before the launcher's own checks, so that their imports of torch
    overlap (:func:`geotrain.launch.spawn.prestart_zygote`); :func:`_refuse` stops it."""
    from geotrain.launch import spawn
    from geotrain.launch.zygote import HF_PRELOAD

    spawn.prestart_zygote(cfg.run.backend, HF_PRELOAD if cfg.model.kind == "hf" else ())


def _refuse(message: str) -> NoReturn:
    """:func:`fail` for a run refused before any rank started: the zygote goes at once."""
    from geotrain.launch import spawn

    spawn.stop_zygote(now=True)
    fail(message)


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
    cfg = load(config, set_)
    _prestart_zygote(cfg)
    from geotrain.comm.topology import Topology
    from geotrain.launch.preflight import preflight
    from geotrain.report.outputs import write_outputs
    from geotrain.report.tables import print_table

    try:
        preflight(cfg)
    except ConfigError as exc:
        _refuse(f"config error: {exc}")
    except CheckpointError as exc:
        _refuse(f"checkpoint.resume: refused: {exc}")
    topo = Topology.from_config(cfg.topology)
    if cfg.report.tracker == "mlflow" and cfg.report.tracker_uri is None:  # the run and its baseline in one store
        store = f"sqlite:///{(out / 'mlflow.db').resolve()}"
        cfg = cfg.model_copy(update={"report": cfg.report.model_copy(update={"tracker_uri": store})})
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
                fail(f"{alg} run failed: {exc}", 1)
            except KeyboardInterrupt:
                fail("interrupted; all ranks stopped", 130)
    print_table(runs, console)
    for r in runs:
        if "survivors" in r:  # elastic
            fails = ", ".join(f"{f['kind']} {f['site']} (detected {f['detection_seconds'] or 0:.1f}s)" for f in r["failures"])
            console.print(
                f"elastic: {r['rounds_committed']} rounds committed, {r['rounds_rolled_back']} rolled back; "
                f"survivors {', '.join(r['survivors'])} identical: {'yes' if r['consistent'] else 'NO'}; "
                f"failures: {fails or 'none'}"
            )
    write_outputs(runs, out, cfg.report.plot)
    wrote = f"{out / 'summary.json'}, {out / 'loss.png'}" if cfg.report.plot else f"{out / 'summary.json'}"
    console.print(f"wrote {wrote}; TensorBoard: tensorboard --logdir {out}")
    if cfg.report.html:
        from geotrain.report.html import write_report

        console.print(f"report: {write_report([out], out / 'report.html')} (open it in a browser; no network needed)")


@app.command()
def report(
    runs: Annotated[list[Path], typer.Argument(help="Output folders of geotrain train (one, or several to compare).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="The HTML file to write.")] = Path("report.html"),
) -> None:
    """One self-contained HTML page for one run or several side by side (docs/REPORT.md)."""
    from geotrain.report.html import write_report

    try:
        console.print(f"wrote {write_report(runs, out)}")
    except ValueError as exc:
        fail(f"report: {exc}")


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
    cfg = load(config, set_)
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

    sc = scenario_step(load_scenario, scenario, set_)
    from geotrain.netsim.report import print_report
    from geotrain.netsim.run import plot_fct_cdf, run_scenario, write_flows_csv

    out, flows = scenario_step(run_scenario, sc)  # some limits are only known once the fabric is built
    print_report(out, wide(132))
    if json_out is not None:
        write_json(out, json_out)
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

    sc = scenario_step(load_plan, scenario, set_)
    from geotrain.plan.report import plot_plan, print_plan
    from geotrain.plan.run import run_plan
    from geotrain.plan.tonetsim import write_netsim

    out = scenario_step(run_plan, sc)  # some inputs only the arithmetic can reject (a budget that buys no rack)
    print_plan(out, wide(132))
    if json_out is not None:
        write_json(out, json_out)
    if plot is not None:
        for path in plot_plan(sc, out, plot):
            console.print(f"wrote {path}")
    if netsim is not None:
        console.print(f"wrote {scenario_step(write_netsim, sc, out, netsim)}: run it with geotrain netsim {netsim}")


@app.command()
def place(
    pool_file: Annotated[Path, typer.Argument(metavar="POOL", help="Pool YAML: sites, data, links, job (docs/PLACE.md).")],
    set_: SetOpt = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Write the chosen placement's geotrain config here.")] = Path(
        "placed.yaml"
    ),
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the placement and its runner-ups as JSON here.")] = None,
    best_effort: Annotated[
        bool, typer.Option("--best-effort", help="Write the best placement even when none meets the deadline or budget.")
    ] = False,
) -> None:
    """Choose the sites, workers, tiers, ring order and exchange shape of a job from a pool; write its config.
    Exit 1, writing nothing, when no placement meets the job's deadline or budget (unless --best-effort)."""
    from geotrain.plan.place_report import print_place, run_place
    from geotrain.plan.pool import load_pool

    pool = scenario_step(load_pool, pool_file, set_)
    base_path = pool.job.config
    if base_path is not None and not Path(base_path).is_absolute():
        base_path = str(pool_file.parent / base_path)
    pool_sites = json.dumps([{"name": s.name, "workers": 1} for s in pool.sites])
    try:  # checked over the pool's sites (secure aggregation needs three, say), not the base's own
        base = load_config(base_path, [f"topology.sites={pool_sites}", "topology.regions=[]", *pool.job.set])
    except ConfigError as exc:
        fail(f"scenario error: job.config: {exc}")
    params, tps = pool.job.params, pool.job.tokens_per_step
    if params is None:
        from geotrain.models.factory import build_model, count_params

        params = count_params(build_model(base.model))
    if tps is None:
        tps = base.train.batch_size * base.train.grad_accum * base.model.block_size
    result, config, _ = scenario_step(run_place, pool, params, tps, base)
    print_place(result, wide(140))
    missed = [k for k, ok in result["meets"].items() if not ok]
    if missed and not best_effort:
        c, job = result["chosen"], pool.job
        limits = {"deadline": f"job.deadline_h {job.deadline_h or 0:g} h", "budget": f"job.budget {job.budget or 0:g}"}
        fail(
            f"no placement meets {' and '.join(limits[k] for k in missed)}: the best takes {c['hours']:.4g} h "
            f"and costs {c['cost']:.4g}; nothing written (--best-effort writes it)",
            1,
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(config.model_dump(), sort_keys=False))
    console.print(f"wrote {out}: run it with geotrain train --config {out}")
    if json_out is not None:
        write_json(result, json_out)


@app.command()
def lighthouse(
    bind: Annotated[str, typer.Option(help="HOST:PORT to listen on (a loopback, private or VPN address).")] = "127.0.0.1:29510",
    min_sites: Annotated[int, typer.Option(help="Fewest sites a round needs.")] = 1,
    heartbeat_timeout: Annotated[float, typer.Option(help="Seconds of silence before a site is dropped.")] = 2.0,
    join_timeout: Annotated[
        float,
        typer.Option(help="Seconds a round with min-sites sites waits for the others (quorum rounds: sync.quorum.grace_s)."),
    ] = 60.0,
) -> None:
    """Run the membership coordinator of elastic runs (torchft's Lighthouse) in the foreground.

    Run it under a supervisor that restarts it (systemd Restart=always, a Kubernetes Deployment):
    while it is down, sites keep doing inner steps and postpone their rounds."""
    from geotrain.elastic.lighthouse import lighthouse_main

    args = ["--bind", bind, "--min-sites", str(min_sites), "--heartbeat-timeout", str(heartbeat_timeout)]
    args += ["--join-timeout", str(join_timeout)]
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
    cfg = load(config, set_)
    _prestart_zygote(cfg)
    from geotrain.launch.site import run_site

    try:
        summary = run_site(cfg, out, site_name, lighthouse_addr, bind, incarnation)
    except ConfigError as exc:
        _refuse(f"config error: {exc}")
    except CheckpointError as exc:
        _refuse(f"checkpoint.resume: refused: {exc}")
    except LaunchError as exc:
        fail(f"site failed: {exc}", 1)
    if summary is None:
        console.print(
            f"site {site_name} drained after a committed round (SIGUSR1); to move it, start it where it goes with "
            f"geotrain site --site {site_name} --incarnation {incarnation + 1} (it heals from a live site)"
        )
        return
    console.print(f"site {site_name} finished; wrote {summary}")


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
    workers: Annotated[int, typer.Option(min=1, max=8, help="Workers per site.")] = 1,
    reference: Annotated[bool, typer.Option(help="Per load, one run without failures first: the goodput's denominator.")] = True,
    overrides: SetOpt = None,
) -> None:
    """Soak elastic training under random site kills and hangs; report rounds, rollbacks, consistency,
    seconds lost per failure and goodput. ``--set`` soaks any combination (e.g. ``--set sync.codec=int8``)."""
    from geotrain.bench.chaos import chaos_config, chaos_table, run_soaks, schedule_lines

    seed_list, hog_list = ints(seeds, "--seeds", 0, 2**31), ints(cpu_hogs, "--cpu-hogs", 0, 64)
    try:
        chaos_config(sites, rounds, H, failures, 0, restart_after, 6, workers, overrides)  # one-line errors before any run
    except ConfigError as exc:
        fail(str(exc))
    try:
        kw = {"sites": sites, "rounds": rounds, "H": H, "failures": failures, "restart_after": restart_after}
        report = run_soaks(out, seed_list, hog_list, reference, console_print=None, workers=workers, overrides=overrides, **kw)
    except LaunchError as exc:
        fail(f"chaos run failed: {exc}", 1)
    extra = "".join(f", {o}" for o in overrides or [])
    table = chaos_table(report, f"chaos: {sites} sites x {workers}, {rounds} rounds of H={H}{extra}")
    wide(160).print(table)
    for line in schedule_lines(report):
        console.print(line, markup=False, highlight=False)
    write_json(report, json_out or out / "chaos.json")
    if not all(r["consistent"] for r in report["runs"]):
        fail("survivors' global models differ", 1)


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
        fail(f"audit verify: {exc}")
    for line in lines:
        console.print(line, markup=False, highlight=False)
    if json_out is not None:
        write_json({"findings": [vars(f) for f in findings]}, json_out)
    if findings:
        fail(f"audit verify: {len(findings)} finding(s) in {run_dir}", 1)


@app.command("keys")
def keys_cmd(
    sites: Annotated[list[str], typer.Argument(help="The sites whose keys to make (if absent) and list.")],
    keys_dir: Annotated[
        Path | None,
        typer.Option("--dir", help="The keys folder (default: $GEOTRAIN_KEYS_DIR or ~/.geotrain/keys, as privacy.keys_dir)."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Write the JSON here too (elastic.site_keys, audit verify --keys).")
    ] = None,
) -> None:
    """Each site's own Ed25519 key, made in the keys folder if absent (<site>.key, mode 0600), and the
    JSON {site: public key} that pins them: give it to every site as elastic.site_keys."""
    import json

    from geotrain.comm.identity import public_hex, site_key
    from geotrain.config import PrivacyConfig
    from geotrain.privacy.build import keys_dir as default_dir

    folder = keys_dir or default_dir(PrivacyConfig())
    try:
        pinned = {s: public_hex(site_key(folder / f"{s}.key")) for s in sites}
    except (OSError, ValueError) as exc:
        fail(f"keys: {exc}")
    text = json.dumps(pinned, indent=2)
    console.print(text, markup=False, highlight=False)
    if out is not None:
        out.write_text(text + "\n")


def main() -> None:
    """The ``geotrain`` command. It ends without the interpreter's teardown
    (:func:`geotrain.comm.procs.leave`): every command has closed its files and stopped its
    processes and threads by then, and tearing down torch's modules costs a launcher 0.6 s of CPU."""
    from geotrain.comm.procs import leave

    code: int | None = 0
    try:
        app()
    except SystemExit as exc:
        if exc.code is not None and not isinstance(exc.code, int):
            raise  # a message to print: the interpreter prints it
        code = exc.code
    spawn = sys.modules.get("geotrain.launch.spawn")
    if spawn is not None:  # its ranks are done: stop and reap the zygote (it would exit with us anyway)
        spawn.stop_zygote()
    leave(code or 0)


if __name__ == "__main__":
    main()
