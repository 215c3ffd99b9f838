"""train.read_every: the loss read, and the device waited for, once per window of steps (what a GPU
run does by default, ``log_every`` steps), here forced on CPU: the same losses as reading every
step, the window's mean step time on each of its steps, a non-finite loss stopping the run at
its step with the steps before it written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from geotrain.errors import LaunchError
from tests.helpers import train_cli

RUN = ["train.steps=12", "sync.algorithm=diloco", "sync.H=3", "train.eval_every=6"]


def _records(out: Path, rank: int = 0) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()]


@pytest.mark.timeout(240)
def test_a_window_reads_the_same_losses_and_gives_its_steps_their_mean_time(tmp_path: Path) -> None:
    train_cli(tmp_path / "each", RUN)
    train_cli(tmp_path / "window", [*RUN, "train.read_every=5"])
    for rank in range(4):
        each, window = _records(tmp_path / "each", rank), _records(tmp_path / "window", rank)
        assert [r["step"] for r in window] == [r["step"] for r in each]
        assert [r["loss"] for r in window] == [r["loss"] for r in each]  # the same numbers, read later
        assert list(window[0]) == list(each[0])  # the same fields, in the same order
        # windows end every 5 steps, at the evaluation after step 6 and at the end: 1-5, 6, 7-10, 11-12
        steps = [r for r in window if "step_seconds" in r and r["step"] <= 12][:12]
        for first, last in ((1, 5), (6, 6), (7, 10), (11, 12)):
            times = {r["step_seconds"] for r in steps if first <= r["step"] <= last}
            assert len(times) == 1, (rank, first, last, times)
        assert len({r["step_seconds"] for r in each[:12]}) > 4  # (reading every step: each its own)


@pytest.mark.timeout(240)
def test_a_non_finite_loss_stops_the_run_at_its_step_after_the_steps_before_it(tmp_path: Path) -> None:
    """Site B's pseudo-gradient of the round at step 6 is NaN (fault.nan, no guard): the global model is NaN
    from step 6 on, so step 7's loss is; with windows of 5 steps it is read at step 10 and the
    run stops naming step 7, with steps 1-6 written, as when every step is read."""
    for name, extra in (("each", []), ("window", ["train.read_every=5"])):
        out = tmp_path / name
        with pytest.raises((AssertionError, LaunchError)):
            train_cli(out, [*RUN, "fault.nan=[B@1]", "guard.enabled=false", *extra])
        assert "loss is nan at step 7" in (out / "logs" / "rank0.log").read_text(), name
        assert [r["step"] for r in _records(out)] == [1, 2, 3, 4, 5, 6], name
