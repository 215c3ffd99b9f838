"""What every command of the CLI shares: consoles, option types, one-line failures, JSON output."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console

from geotrain.config import Config, load_config
from geotrain.errors import ConfigError

console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)
T = TypeVar("T")

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML config file.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", help="Override: KEY=VALUE, e.g. train.steps=200 (repeatable).")]
OutOpt = Annotated[Path, typer.Option("--out", "-o", help="Output directory.")]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")]
LatencyOpt = Annotated[float, typer.Option("--latency", min=0, max=10, help="One-way inter-site latency in seconds.")]


def fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr, no traceback, exit ``code`` (2: bad input)."""
    err_console.print(f"geotrain: {message}", markup=False, highlight=False)
    raise typer.Exit(code) from None


def write_json(out: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=float) + "\n")
    console.print(f"wrote {path}")


def load(config: Path | None, overrides: list[str] | None) -> Config:
    try:
        return load_config(config, overrides or [])
    except ConfigError as exc:
        fail(f"config error: {exc}")


def scenario_step(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``; a :class:`ConfigError` becomes a one-line 'scenario error' and exit code 2."""
    try:
        return fn(*args)
    except ConfigError as exc:
        fail(f"scenario error: {exc}")


def wide(width: int) -> Console:
    """A console at least ``width`` columns wide, for tables (wider than a pipe's 80 columns)."""
    return Console(soft_wrap=True, width=max(console.width, width))


def progress_line(message: str) -> None:
    console.print(f"[dim]{message}[/dim]")


def ints(text: str, option: str, low: int, high: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        fail(f"{option}: expected comma-separated whole numbers (got {text!r})")
    if not values or any(not low <= v <= high for v in values):
        fail(f"{option}: every value must be between {low} and {high} (got {text!r})")
    return values


def bit_rates(text: str, option: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        fail(f"{option}: expected comma-separated bit rates such as 1e7,1e8 (got {text!r})")
    if not values or any(not v > 0 for v in values):
        fail(f"{option}: every bandwidth must be > 0 bit/s (got {text!r})")
    return values
