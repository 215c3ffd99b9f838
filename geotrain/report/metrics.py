"""Per-rank metrics sinks: a JSONL line per step, TensorBoard events, the console log line, and
the timeline of compute and network intervals.

Every rank writes ``OUT/metrics/rank{r}.jsonl``; global rank 0 also writes TensorBoard events to
``OUT/tb``; local rank 0 of each site prints one fixed-format line every ``log_every`` steps
with the ``[site/rank step N]`` prefix. A do-nothing sink stands in for TensorBoard when it is
not installed, instead of ``if tb:`` branches in the loop.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Protocol

from geotrain.comm.topology import RankInfo
from geotrain.report.trackers import Tracker, numbers


class _Scalars(Protocol):
    def add_scalar(self, tag: str, value: float, step: int) -> None: ...
    def close(self) -> None: ...


class _NullWriter:
    def add_scalar(self, tag: str, value: float, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def _tensorboard(path: Path) -> _Scalars:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("geotrain: tensorboard not installed; no event files written", file=sys.stderr)
        return _NullWriter()
    return SummaryWriter(log_dir=str(path))


def last_step(path: Path) -> int:
    """The step of the last record in a metrics JSONL file (0 if none yet); reads only its tail."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
        return int(json.loads(lines[-1])["step"]) if lines else 0
    except (OSError, ValueError, KeyError, IndexError):
        return 0


def log(me: RankInfo, step: int, message: str) -> None:
    """Print one line with the rank prefix, flushed (the launcher forwards it live)."""
    print(f"[{me.tag} step {step}] {message}", flush=True)


class MetricsSink:
    def __init__(
        self,
        out: Path,
        me: RankInfo,
        log_every: int,
        print_steps: bool,
        suffix: str = "",
        resumed_at: int = 0,
        tracker: Tracker | None = None,
    ) -> None:
        """``resumed_at`` > 0: the run resumed after that step; the records up to it are kept and
        those after it (written before the interruption, now trained again) are dropped.
        ``tracker``: also sent every record's numbers (a site's first rank; its owner closes it)."""
        self.tracker = tracker
        self.me = me
        self.log_every = log_every
        self.print_steps = print_steps
        (out / "metrics").mkdir(parents=True, exist_ok=True)
        path = out / "metrics" / f"rank{me.rank}{suffix}.jsonl"
        kept = []
        if resumed_at and path.exists():
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):  # a torn last line is dropped
                    if int(json.loads(line)["step"]) <= resumed_at:
                        kept.append(line + "\n")
        self._jsonl = open(path, "w", buffering=1)  # noqa: SIM115
        self._jsonl.writelines(kept)
        self._tb: _Scalars = _tensorboard(out / "tb") if me.rank == 0 else _NullWriter()

    def step(self, record: dict[str, Any], step_line: bool = True) -> None:
        self._jsonl.write(json.dumps(record) + "\n")
        step = int(record["step"])
        if self.tracker is not None:
            self.tracker.log(step, numbers({k: v for k, v in record.items() if k != "step"}))
        for key in (
            "loss",
            "lr",
            "inter_site_bytes",
            "intra_site_bytes",
            "comm_seconds",
            "wait_seconds",
            "in_flight_bytes",
            "eval_loss",
            "epsilon",
        ):
            if key in record:
                self._tb.add_scalar(f"train/{key}", float(record[key]), step)
        if "eval_loss" in record and self.print_steps and self.me.rank == 0:
            log(self.me, step, f"eval_loss {record['eval_loss']:.4f} tokens {record['tokens']:,}")
        if step_line and self.print_steps and (step % self.log_every == 0 or step == 1):
            log(
                self.me,
                step,
                f"loss {record['loss']:.4f} | dt {record['step_seconds'] * 1000:6.1f} ms | "
                f"tok/s {record['tokens_per_second']:8.0f} | inter-site {record['inter_site_bytes'] / 1e6:9.3f} MB | "
                f"wan wait {record['wait_seconds'] * 1000:5.0f} ms | in flight {record['in_flight_bytes'] / 1e6:6.3f} MB"
                + (f" | ε {record['epsilon']:.3f}" if "epsilon" in record else ""),
            )

    def close(self) -> None:
        self._jsonl.close()
        self._tb.close()


def write_timeline(
    out: Path, rank: int, compute: list[tuple[float, float]], network: list[tuple[float, float]], t0: float
) -> None:
    """This rank's compute and wide-area intervals (seconds since the first step) for the timeline plot."""
    (out / "timeline").mkdir(exist_ok=True)
    data = {
        "rank": rank,
        "compute": [(a - t0, b - t0) for a, b in compute],
        "network": [(a - t0, b - t0) for a, b in network if b >= t0],
    }
    (out / "timeline" / f"rank{rank}.json").write_text(json.dumps(data))
