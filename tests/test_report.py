"""What a user does with a run: the experiment tracker's round trip (MLflow's local store), the
refusal of a tracker that is not installed, and the HTML report of one run and of a comparison."""

from __future__ import annotations

import json
import struct
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from geotrain.config import ReportConfig
from geotrain.errors import ConfigError
from tests.helpers import read_summary, train_cli

pytestmark = pytest.mark.timeout(300)

TWO = "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}]"


def test_a_tracker_that_is_not_installed_is_refused_naming_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from geotrain.report import trackers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "alembic") else real(name, *a))
    with pytest.raises(
        ConfigError, match="report.tracker: wandb needs the wandb package, which is not installed: pip install wandb"
    ):
        trackers.check_tracker(ReportConfig(tracker="wandb"))
    with pytest.raises(ConfigError, match="report.tracker: mlflow's SQLite store needs alembic"):
        trackers.check_tracker(ReportConfig(tracker="mlflow"))
    trackers.check_tracker(ReportConfig(tracker="mlflow", tracker_uri="http://127.0.0.1:5000"))  # a server: no SQLite
    trackers.check_tracker(ReportConfig(tracker="none"))


@pytest.mark.slow
def test_mlflow_local_store_round_trip(tmp_path: Path) -> None:
    """A 2-site run and its DDP baseline log to one SQLite store in OUT: one tracker run per site
    and algorithm, with the config as parameters, every step's metrics (read back equal to the
    run's own JSONL) and the final summary as an artifact and final/ metrics."""
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    train_cli(out, ["train.steps=6", "sync.H=3", "report.tracker=mlflow", "run.baseline=ddp", "train.log_every=1", TWO])
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name("geotrain")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"diloco A", "diloco B", "ddp A", "ddp B"}
    assert all(r.info.status == "FINISHED" for r in runs.values())
    a = runs["diloco A"]
    assert a.data.params["sync.H"] == "3" and a.data.params["topology.sites"].startswith("[")
    jsonl = [json.loads(line) for line in (out / "diloco" / "metrics" / "rank0.jsonl").read_text().splitlines()]
    history = client.get_metric_history(a.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["loss"])) for r in jsonl]
    b_jsonl = [json.loads(line) for line in (out / "diloco" / "metrics" / "rank1.jsonl").read_text().splitlines()]
    b_history = client.get_metric_history(runs["diloco B"].info.run_id, "inter_site_bytes")
    assert [m.value for m in b_history] == [float(r["inter_site_bytes"]) for r in b_jsonl]  # site B's own numbers
    s = read_summary(out / "diloco")
    local = Path(client.download_artifacts(a.info.run_id, "summary.json", str(tmp_path)))
    assert json.loads(local.read_text())["final_eval_loss"] == s["final_eval_loss"]
    assert a.data.metrics["final/final_eval_loss"] == pytest.approx(s["final_eval_loss"])
    assert a.data.metrics["final/inter_site_bytes"] == s["inter_site_bytes"]


def _wandb_records(path: Path) -> list[Any]:
    """The records of an offline W&B run file (a LevelDB-style log of 32 KiB blocks after a
    7-byte header; each chunk: crc32, length, type (1 whole, 2 first, 3 middle, 4 last))."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            out.append(rec)
    return out


@pytest.mark.slow
def test_wandb_offline_round_trip(tmp_path: Path) -> None:
    """W&B, offline: one run per site with every step's loss (equal to the JSONL) and the final
    summary; skipped where wandb is not installed (CI installs MLflow only)."""
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    train_cli(out, ["train.steps=4", "sync.H=2", "report.tracker=wandb", "train.log_every=1", TWO])
    runs = {}
    for f in sorted((out / "wandb").glob("offline-run-*/run-*.wandb")):
        recs = _wandb_records(f)
        name = next(r.run.display_name for r in recs if r.WhichOneof("record_type") == "run")
        history = [
            {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in recs
            if r.WhichOneof("record_type") == "history"
        ]
        summary = {
            i.key or "/".join(i.nested_key): json.loads(i.value_json)
            for r in recs
            if r.WhichOneof("record_type") == "summary"
            for i in r.summary.update
        }
        runs[name] = (history, summary)
    assert set(runs) == {"diloco A", "diloco B"}
    jsonl = [json.loads(line) for line in (out / "metrics" / "rank0.jsonl").read_text().splitlines()]
    history, summary = runs["diloco A"]
    by_step = {r["step"]: r["loss"] for r in jsonl}  # (the last step's record is written twice: with its eval)
    assert [(h["_step"], h["loss"]) for h in history] == [(k, pytest.approx(v)) for k, v in by_step.items()]
    assert summary["final_eval_loss"] == pytest.approx(read_summary(out)["final_eval_loss"])


class _Cells(HTMLParser):
    """Every element with data-key, by (run, key): its data-value; and the section ids."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: dict[tuple[str, str], Any] = {}
        self.sections: list[str] = []
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if "data-key" in a:
            self.cells[(str(a["data-run"]), str(a["data-key"]))] = json.loads(str(a["data-value"]))
        if tag == "section":
            self.sections.append(str(a["id"]))
        self.links += [str(v) for k, v in attrs if k in ("src", "href") and v is not None and not v.startswith("#")]


def _read(page: Path) -> _Cells:
    p = _Cells()
    p.feed(page.read_text())
    return p


SECTIONS = ["runs", "loss", "sites", "bytes", "rounds", "guard", "privacy", "checkpoints", "prediction"]


@pytest.mark.slow
def test_the_report_of_a_run_and_of_a_comparison_holds_their_own_numbers(tmp_path: Path) -> None:
    """Two runs: one of 2 sites with a NaN update the guard leaves out and checkpoints, one of 3
    with secure aggregation and site-level DP. geotrain train writes each one's page; geotrain report compares
    them. Every number read back from the page equals its summary.json, and the page holds no URL."""
    import subprocess
    import sys

    a, b = tmp_path / "a", tmp_path / "b"
    common = ["train.steps=8", "sync.H=2", "train.log_every=1", TWO]
    pa = train_cli(a, [*common, 'fault.nan=["B@2"]', "checkpoint.every=4", "report.html=true"])
    assert f"report: {a / 'report.html'}" in " ".join(pa.stdout.split())
    three = "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}]"
    private = ["privacy.secure_aggregation=true", "privacy.dp.unit=site", "privacy.dp.noise_multiplier=0.01"]
    train_cli(b, [*common, three, *private])  # secure aggregation needs 3 sites
    assert not (b / "report.html").exists() and not (b / "loss.png").exists()  # report.html and report.plot off
    page = tmp_path / "both.html"
    proc = subprocess.run(
        [sys.executable, "-m", "geotrain", "report", str(a), str(b), "--out", str(page)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    for one, name, s in (
        (a / "report.html", "diloco", read_summary(a)),
        (page, "a", read_summary(a)),
        (page, "b", read_summary(b)),
    ):
        got = _read(one)
        assert got.sections == SECTIONS and got.links == []
        text = one.read_text()
        assert "http://" not in text and "https://" not in text and "<script" not in text  # opens with no network
        for key in ("steps", "tokens", "final_eval_loss", "inter_site_bytes", "compression_ratio", "wall_seconds", "utilization"):
            assert got.cells[(name, key)] == s[key], key
        assert got.cells[(name, "rounds")] == s["rounds"] and got.cells[(name, "rounds_rolled_back")] == s["rounds_rolled_back"]
        per_site = [got.cells[(name, f"site:{site}:inter_site_bytes")] for site in s["sites"]]
        assert sum(per_site) == s["inter_site_bytes"]
        for site, n in s["guard_rejections"].items():
            assert got.cells[(name, f"site:{site}:guard_rejections")] == n
        assert got.cells[(name, "epsilon")] == s["epsilon"] and got.cells[(name, "dropouts")] == s["dropouts"]
    sa, sb = read_summary(a), read_summary(b)
    assert sa["guard_rejections"] == {"A": 0, "B": 1} and sb["epsilon"] is not None and sb["secagg"]
    both = page.read_text()
    assert "norm" in both or "non-finite" in both  # the guard's reason is shown
    assert "privacy.secure_aggregation" in both and "fault.nan" in both  # what differs between the configs
    assert both.count("step-0000000") == 2 and "complete" in both  # a's checkpoints at steps 4 and 8
    # the CLI's verdict line, on the page; bytes shown in units, exact in data-value
    from geotrain.report.tables import human_bytes, verdict

    assert verdict(sa, sb, ("a", "b")) in both and "x more inter-site bytes" in verdict(sb, sa)  # b sends more
    assert f'data-value="{sa["inter_site_bytes"]}">{human_bytes(sa["inter_site_bytes"])}<' in both
    assert human_bytes(2_002_329_600) == "2.00 GB" and human_bytes(40_046_784) == "40.05 MB" and human_bytes(812) == "812 B"


@pytest.mark.slow
def test_the_report_of_a_1000_step_run_stays_small(tmp_path: Path) -> None:
    out = tmp_path / "long"
    train_cli(
        out,
        ["train.steps=1000", "sync.H=50", "train.log_every=1000", "topology.links.emulate=off", TWO, "report.html=true"],
        timeout=280,
    )
    size = (out / "report.html").stat().st_size
    assert size < 3_000_000, size  # (a few hundred KB: every step's record is charted, as SVG)
    assert _read(out / "report.html").cells[("diloco", "steps")] == 1000


def test_summary_keys_become_names_every_tracker_accepts() -> None:
    """A directed link's key ("A->B") once failed MLflow's name check and, with it, the run."""
    from geotrain.report.trackers import numbers

    got = numbers({"link_bytes": {"A->B": 3, "x|y": 1}, "loss": 2.0, "hash": "abc"}, "final/")
    assert got == {"final/link_bytes/A to B": 3.0, "final/link_bytes/x_y": 1.0, "final/loss": 2.0}


def test_mfu_arithmetic() -> None:
    """6N + 12·layers·width·context FLOPs per token against the device's dense bf16 peak; none on a CPU."""
    from geotrain.report.summary import device_peak, flops_per_token, throughput

    assert flops_per_token(124_000_000, 12, 768, 1024) == 6 * 124e6 + 12 * 12 * 768 * 1024
    assert device_peak("NVIDIA H100 80GB HBM3") == 989e12 and device_peak("cpu") is None
    ranks = [{"wall_seconds": 12.0, "eval_seconds": 2.0}, {"wall_seconds": 11.0, "eval_seconds": 2.0}]
    result = {"curve": [{"tokens": 0}, {"tokens": 2_000_000}]}
    got = throughput(result, ranks, {"device": "NVIDIA H100 80GB HBM3", "flops_per_token": 1e9})
    assert got["tokens_per_second_per_rank"] == 100_000.0  # 2M tokens, 2 ranks, 10 s of training
    assert got["mfu"] == pytest.approx(100_000 * 1e9 / 989e12)
    assert throughput(result, ranks, {"device": "cpu", "flops_per_token": 1e9})["mfu"] is None
    # the evaluation before the first step is in eval_seconds but not in wall_seconds
    before = [{**r, "eval_seconds": r["eval_seconds"] + 3.0, "eval_seconds_before": 3.0} for r in ranks]
    assert throughput(result, before, {"device": "cpu", "flops_per_token": 1e9})["tokens_per_second_per_rank"] == 100_000.0
