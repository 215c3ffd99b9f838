"""Experiment trackers: a run's per-step metrics, its config and its final summary in MLflow or
Weights & Biases (``report.tracker``), from the first rank of each site.

Each site's first rank opens one tracker run named after the site (``A``, ``B``, ...; a
restarted site's incarnation is added) and tagged with the run's output folder, so a run of
several sites is several tracker runs side by side, as they are several processes.

- **MLflow** (the embedded default): a local SQLite store, ``OUT/mlflow.db``, artifacts under
  ``OUT/mlruns`` (MLflow's file store is in maintenance mode and refuses to start by default);
  ``report.tracker_uri`` names another store or a tracking server. ``geotrain train`` points a
  run and its baseline at one store in its ``--out``, so both are in one experiment. The sites of
  one machine share the database: creating its tables and the experiment is done under a file
  lock.
- **Weights & Biases**: offline, under ``OUT/wandb`` (``wandb sync`` uploads it later).

Aim is not offered: with aim 3.29 a run written through its SDK lists in the repository but its
metrics and parameters did not read back through the SDK (only its UI's indexing shows them),
so we could not test a round trip; the other two are tested end to end.

The package is imported only when its tracker is chosen, and :func:`check_tracker` refuses a
tracker that is not installed before anything starts, naming the package.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import math
import re
from pathlib import Path
from typing import Any, Protocol

from geotrain.config import ReportConfig
from geotrain.errors import ConfigError

# the package a tracker needs, and how to install it
PACKAGES = {
    "mlflow": ("mlflow", "pip install mlflow-skinny sqlalchemy alembic (or pip install 'geotrain[track]')"),
    "wandb": ("wandb", "pip install wandb"),
}
FLUSH_EVERY = 50  # MLflow: metrics buffered and sent in batches of this many steps


class Tracker(Protocol):
    """What a run tells a tracker."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_summary(self, summary: dict[str, Any]) -> None: ...

    def close(self, failed: bool = False) -> None: ...


def check_tracker(cfg: ReportConfig) -> None:
    """Refuse a tracker whose package is not installed (one line naming the package).

    Raises:
        ConfigError: ``report.tracker`` names a tracker that cannot be imported here.
    """
    if cfg.tracker == "none":
        return
    module, how = PACKAGES[cfg.tracker]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"report.tracker: {cfg.tracker} needs the {module} package, which is not installed: {how}")
    if cfg.tracker == "mlflow" and (cfg.tracker_uri or "sqlite:").startswith("sqlite:"):
        missing = [m for m in ("sqlalchemy", "alembic") if importlib.util.find_spec(m) is None]
        if missing:
            raise ConfigError(f"report.tracker: mlflow's SQLite store needs {' and '.join(missing)}: {how}")


def metric_name(key: str) -> str:
    """``key`` as a name every tracker accepts: letters, digits, '_', '-', '.', ' ', ':', '/'
    (a link "A->B" is "A to B"; anything else becomes '_')."""
    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", key.replace("->", " to "))


def numbers(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of ``record`` (nested dicts flattened with '/'), as a tracker takes them."""
    out: dict[str, float] = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(numbers(v, f"{prefix}{metric_name(str(k))}/"))
        elif isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            out[f"{prefix}{metric_name(str(k))}"] = float(v)
    return out


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A config as dotted keys and string values (a tracker's parameters)."""
    out: dict[str, str] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flat_params(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if not isinstance(v, str) else v
    return out


def open_tracker(cfg: ReportConfig, out: Path, run_name: str, config: dict[str, Any]) -> Tracker | None:
    """The tracker of ``cfg`` for one site's first rank, its config logged; None for ``none``."""
    if cfg.tracker == "none":
        return None
    out.mkdir(parents=True, exist_ok=True)
    tracker: Tracker = _MLflow(cfg, out, run_name, config) if cfg.tracker == "mlflow" else _Wandb(cfg, out, run_name, config)
    return tracker


class _MLflow:
    def __init__(self, cfg: ReportConfig, out: Path, run_name: str, config: dict[str, Any]) -> None:
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        self.uri = cfg.tracker_uri or f"sqlite:///{(out / 'mlflow.db').resolve()}"
        # a SQLite store's folder holds its artifacts and the lock; another store's, this run's folder
        home = Path(self.uri[len("sqlite:///") :]).parent if self.uri.startswith("sqlite:///") else out
        home.mkdir(parents=True, exist_ok=True)
        with open(home / ".mlflow.lock", "w") as lock:  # one process at a time creates tables and the experiment
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.client = MlflowClient(self.uri)
            exp = self.client.get_experiment_by_name(cfg.experiment)
            exp_id = (
                exp.experiment_id
                if exp is not None
                else self.client.create_experiment(cfg.experiment, artifact_location=(home / "mlruns").resolve().as_uri())
            )
            run = self.client.create_run(exp_id, run_name=run_name, tags={"geotrain.out": str(out.resolve())})
        self.run_id = run.info.run_id
        params = [Param(k, v[:6000]) for k, v in flat_params(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(
                self.run_id, params=params[i : i + 100], tags=[RunTag("geotrain.site", run_name)] if i == 0 else []
            )
        self._pending: list[Any] = []
        self._steps = 0

    def log(self, step: int, metrics: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._pending += [Metric(k, v, now, step) for k, v in metrics.items()]
        self._steps += 1
        if self._steps % FLUSH_EVERY == 0:
            self._flush()

    def _flush(self) -> None:
        for i in range(0, len(self._pending), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=self._pending[i : i + 1000])
        self._pending = []

    def log_summary(self, summary: dict[str, Any]) -> None:
        self._flush()
        self.client.log_dict(self.run_id, summary, "summary.json")
        final = numbers({k: v for k, v in summary.items() if k not in ("config", "runs")}, "final/")
        if final:
            self.log(self._steps, final)
            self._flush()

    def close(self, failed: bool = False) -> None:
        with contextlib.suppress(Exception):  # the run's end must not fail the run
            self._flush()
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


class _Wandb:
    def __init__(self, cfg: ReportConfig, out: Path, run_name: str, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(
            project=cfg.experiment, name=run_name, dir=str(out), mode="offline", config=config, reinit="create_new"
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_summary(self, summary: dict[str, Any]) -> None:
        self.run.summary.update(numbers({k: v for k, v in summary.items() if k not in ("config", "runs")}))

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)
