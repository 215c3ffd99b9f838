"""Config loading: defaults, overrides, and bad input rejected through the CLI with exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from geotrain.config import Config, load_config
from geotrain.errors import ConfigError
from tests.helpers import REPO, train_args


def test_defaults_are_the_documented_main_job() -> None:
    cfg = load_config()
    assert [s.name for s in cfg.topology.sites] == ["A", "B"]
    assert all(s.workers == 2 for s in cfg.topology.sites)
    assert cfg.sync.algorithm == "diloco" and cfg.run.baseline == "ddp"
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.betas) == (4e-4, 0.1, [0.9, 0.95])
    assert cfg.sync.outer_sgd == (0.7, 0.9, True)


def test_overrides_and_yaml(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  steps: 10\ntopology:\n  links:\n    inter: {bandwidth_bps: 1e8, latency_s: 0.04}\n")
    cfg = load_config(f, ["train.steps=200", "sync.algorithm=ddp", "optim.lr=1e-3", "topology.sites.0.workers=3"])
    assert cfg.train.steps == 200 and cfg.sync.algorithm == "ddp" and cfg.optim.lr == 1e-3
    assert cfg.topology.links.inter.bandwidth_bps == 1e8  # YAML 1.1 would read 1e8 as a string
    assert cfg.topology.sites[0].workers == 3


def test_with_algorithm_and_round_trip() -> None:
    cfg = load_config(None, ["sync.H=7"]).with_algorithm("ddp")
    assert cfg.sync.algorithm == "ddp" and cfg.run.baseline == "none" and cfg.sync.H == 7
    assert Config.model_validate(cfg.model_dump()) == cfg
    # an elastic run's failure injection needs elastic rounds: its DDP baseline runs without it
    faults = ["elastic.enabled=true", 'fault.kill=["B@5"]', 'fault.tamper=["A@10"]', 'fault.split=["B@20"]']
    two = ["topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}]"]
    base = load_config(None, [*two, *faults]).with_algorithm("ddp")
    assert not base.elastic.enabled and not base.fault.site_faults()
    # two kinds at one site and step are both carried out (a kill is not lost to a split there)
    both = load_config(None, [*two, "elastic.enabled=true", 'fault.kill=["B@40"]', 'fault.split=["B@40"]']).fault
    assert both.site_faults() == [("B", 40, "kill"), ("B", 40, "split")] and both.at("split") == [("B", 40)]


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["sync.H=0"], "sync.H"),
        (["topology.sites.0.workers=-1"], "topology.sites[0].workers"),
    ],
)
def test_errors_name_the_field(overrides: list[str], field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, overrides)
    assert str(exc.value).startswith(field + ":")


BAD = [
    # (yaml text or None, overrides, text the one-line message must contain)
    (
        "trian:\n  steps: 3\n",
        [],
        "trian: unknown key; allowed keys: checkpoint, data, elastic, fault, guard, liveness, model, optim, privacy, report, run, sync, topology, train",
    ),
    (None, ["train.stpes=3"], "train.stpes: unknown key"),
    (None, ["topology.sites.0.workers=-2"], "topology.sites[0].workers: Input should be greater than or equal to 1"),
    ("topology:\n  sites: []\n", [], "topology.sites: at least one site is required"),
    (None, ["sync.H=0"], "sync.H: Input should be greater than or equal to 1"),
    (
        "topology:\n  links:\n    inter: {bandwidth_bps: fast, latency_s: 0.01}\n",
        [],
        "topology.links.inter.bandwidth_bps: Input should be a valid number",
    ),
    (None, ["topology.links.inter.bandwidth_bps=0"], "topology.links.inter.bandwidth_bps: Input should be greater than 0"),
    (None, ["topology.links.inter.latency_s=11"], "topology.links.inter.latency_s: Input should be less than or equal to 10"),
    (None, ["data.corpus=/nonexistent/corpus.txt"], "data.corpus: Value error, file or directory not found"),
    (None, ["sync.algorithm=gossip"], "sync.algorithm: Input should be 'ddp', 'diloco' or 'streaming'"),
    (None, ["model.n_embd=100", "model.n_head=3"], "model: n_embd (100) must be divisible by n_head (3)"),
    (None, ["train.steps=ten"], "train.steps: Input should be a valid integer"),
    ("topology:\n  sites: [{name: A, workers: 2}, {name: A, workers: 2}]\n", [], "site names must be unique"),
    (
        "topology:\n  sites: [{name: A, workers: 2}, {name: B, workers: 1}]\nsync: {within_site: fsdp}\n",
        ["sync.algorithm=streaming", "sync.eager=true"],
        "sync.eager: the eager step applies each site's own share of the whole pseudo-gradient at once",
    ),
    (None, ["elastic.enabled=true", "sync.codec=powersgd"], "sync.codec: PowerSGD's factors are all-reduced over a fixed world"),
    ("- just\n- a list\n", [], "must hold a mapping"),
    (None, ["optim.betas=[0.9]"], "optim.betas"),
    (
        None,
        ["optim.name=muon", "optim.momentum=0.9"],
        "optim.momentum: applies to name=sgd only (name=muon; Muon's is optim.muon_momentum)",
    ),
    (None, ["optim.muon_momentum=1"], "optim.muon_momentum: Input should be less than 1"),
    (None, ["optim.name=lion"], "optim.name: Input should be 'adamw', 'sgd' or 'muon'"),
    (
        None,
        ["sync.codec=sparseloco", "sync.codec.fraction=0.1"],
        "sync.codec.fraction: sparseloco sends 0.5-5% of each chunk's entries (0.005..0.05; got 0.1)",
    ),
    (None, ["train.steps"], "--set: expected KEY=VALUE"),
    (None, ["privacy.dp.epsilon=0"], "privacy.dp.epsilon: Input should be greater than 0"),
    (None, ["privacy.dp.delta=1"], "privacy.dp.delta: Input should be less than 1"),
    (None, ["privacy.dp.clip_norm=-1"], "privacy.dp.clip_norm: Input should be greater than 0"),
    (
        None,
        ["privacy.secure_aggregation=true"],
        "privacy.secure_aggregation: needs at least 3 sites, not 2 (with two, each site learns the other's update",
    ),
    (
        "topology:\n  sites: [{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}]\n",
        ["privacy.secure_aggregation=true", "privacy.threshold=4"],
        "privacy.threshold: 4 is larger than the number of sites (3)",
    ),
    (None, ["privacy.threshold=2"], "privacy.threshold: Input should be greater than or equal to 3"),
    (None, ["privacy.dp.unit=site"], "privacy.dp.noise_multiplier: set it or dp.epsilon"),
    (None, ["privacy.inject=[A@x:drop]"], "privacy.inject: item 0 ('A@x:drop'): expected SITE@ROUND:drop"),
    (None, ["privacy.secure_aggregation=true", "sync.algorithm=ddp"], "privacy.secure_aggregation: works on pseudo-gradients"),
    (None, ["fault.kill=[A@10]"], "fault.kill: failing a site this way needs elastic.enabled=true"),
    (None, ["liveness.heartbeat_timeout_s=0.3"], "liveness.heartbeat_timeout_s: must exceed twice heartbeat_s=0.25 (got 0.3)"),
    (None, ["elastic.heartbeat_timeout_s=3"], "elastic.heartbeat_timeout_s: moved to liveness.heartbeat_timeout_s"),
    (None, ["run.timeout_s=60"], "run.timeout_s: moved to liveness.group_timeout_s"),
    (None, ["sync.quorum={sites: 1, lost_after_s: 30}"], "sync.quorum.lost_after_s: moved to liveness.hub_lost_after_s"),
    ("elastic:\n  enabled: true\n  wait_timeout_s: 30\n", [], "elastic.wait_timeout_s: moved to liveness.wait_timeout_s"),
    (
        None,
        ["elastic.enabled=true", "sync.algorithm=ddp"],
        "sync.algorithm: elastic membership meets once per round, and DDP has no rounds",
    ),
    (
        None,
        ["elastic.enabled=true", "sync.algorithm=streaming", "sync.eager=true"],
        "sync.eager: the eager variant leaves each site on its own global model",
    ),
    (
        None,
        ["elastic.enabled=true", "privacy.inject=[A@1:drop]"],
        "privacy.inject: drops secure-aggregation rounds of plain mode; in elastic mode a site drops out for real",
    ),
    (None, ["elastic.enabled=true", "elastic.min_sites=3"], "elastic.min_sites: 3 is more than the number of sites (2)"),
    (None, ["elastic.enabled=true", "fault.hang=[Z@3]"], "fault.hang: unknown site 'Z' (sites: A, B)"),
    (None, ["elastic.enabled=true", "elastic.secret_file=/nonexistent/s"], "elastic.secret_file: cannot read /nonexistent/s"),
    (None, ["train.precision=fp16"], "train.precision: Input should be 'fp32' or 'bf16'"),
    (None, ["train.grad_accum=0"], "train.grad_accum: Input should be greater than or equal to 1"),
    (
        None,
        ["privacy.dp.unit=example", "privacy.dp.epsilon=8", "train.grad_accum=2"],
        "train.grad_accum: privacy.dp.unit=example clips each example's gradient, which its hooks read from one eager",
    ),
    (
        None,
        ["privacy.dp.unit=example", "privacy.dp.epsilon=8", "train.compile=true"],
        "train.compile: privacy.dp.unit=example clips each example's gradient",
    ),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("text,overrides,expect", BAD)
def test_bad_config_through_cli(tmp_path: Path, text: str | None, overrides: list[str], expect: str) -> None:
    args = [sys.executable, "-m", "geotrain", "train", "--out", str(tmp_path / "out")]
    if text is not None:
        f = tmp_path / "bad.yaml"
        f.write_text(text)
        args += ["--config", str(f)]
    for o in overrides:
        args += ["--set", o]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert lines[0].startswith("geotrain: config error: ")
    assert expect.replace("Value error, ", "") in lines[0], lines[0]
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


@pytest.mark.timeout(120)
def test_a_run_refused_before_launch_leaves_no_zygote(tmp_path: Path) -> None:
    """The launcher starts its zygote before its own checks (so their imports overlap); a run they
    refuse kills it at once rather than leaving it to finish importing torch as an orphan."""
    (tmp_path / "tiny.txt").write_text("too small")
    args = train_args(tmp_path / "out", [f"data.corpus={tmp_path / 'tiny.txt'}"])
    t0 = _ticks()
    tag = f"GEOTRAIN_TEST_RUN={tmp_path.name}-{os.getpid()}"  # this run's processes inherit it (tests run in parallel)
    env = {**os.environ, tag.split("=")[0]: tag.split("=")[1]}
    with open(tmp_path / "err", "w") as err:  # a file, not a pipe: the zygote would hold a pipe open
        code = subprocess.run(args, stdout=subprocess.DEVNULL, stderr=err, timeout=60, env=env).returncode
    assert not _zygotes_since(t0, tag), "a refused run left its zygote behind"
    assert code == 2
    assert (tmp_path / "err").read_text().startswith("geotrain: config error: data.corpus: held-out split too small")


def _ticks() -> float:
    """Now, in the clock ticks since boot that /proc/PID/stat gives start times in."""
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK")


def _zygotes_since(t0: float, tag: str) -> list[int]:
    """Live (not zombie) zygote processes started at or after ``t0`` (:func:`_ticks`) whose
    environment holds ``tag`` (``NAME=value``): a fresh interpreter by its command line, one
    forked from the launcher by its name."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if (
                d.name.isdigit()
                and (
                    b"geotrain.launch.zygote" in (d / "cmdline").read_bytes()
                    or (d / "comm").read_text().strip() == "geotrain-zygote"
                )
                and tag.encode() in (d / "environ").read_bytes().split(b"\0")
            ):
                fields = (d / "stat").read_text().rsplit(") ", 1)[1].split()
                if fields[0] != "Z" and int(fields[19]) >= t0 - 1:
                    found.append(int(d.name))
        except OSError:
            continue
    return found


def test_config_reference_is_up_to_date() -> None:
    from geotrain.config import markdown_reference

    doc = Path(__file__).resolve().parent.parent / "docs" / "CONFIG.md"
    assert doc.read_text().strip() == markdown_reference().strip(), "run: geotrain config --markdown > docs/CONFIG.md"


def test_shipped_default_config_is_the_default() -> None:
    shipped = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    assert shipped == Config().model_dump()


def test_an_unknown_hugging_face_family_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"hf.model_type: must be one of gpt2, llama, mistral, qwen2 \(got 'bert'\)"):
        load_config(None, ["model.kind=hf", 'model.hf={"model_type": "bert"}'])
    pytest.importorskip("transformers")
    from geotrain.models.hf import hf_config_kwargs

    kw = hf_config_kwargs(load_config(None, ["model.kind=hf", 'model.hf={"model_type": "mistral"}']).model)
    assert kw["hidden_size"] == 128 and kw["num_key_value_heads"] == 4
