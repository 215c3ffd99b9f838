"""The base of every section of every file geotrain reads, and the small validators they share.

Strict pydantic: unknown keys refused, no silent type coercion (a string is never a number),
defaults validated too. No torch here, so the CLI can reject bad input fast.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every section of a file geotrain reads: unknown keys refused, strict types."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True)


def submodel(annotation: Any) -> type[BaseModel] | None:
    """The config section type an annotation holds (``X``, ``X | None``, ``list[X]``), if any."""
    for a in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def absolute_path(v: str | None) -> str | None:
    """A path made absolute (``~`` expanded), not checked: it may exist on another machine only."""
    return None if v is None else str(Path(v).expanduser().resolve())


def existing_path(v: str | None) -> str | None:
    """A file or directory that exists, made absolute (``~`` expanded); None stays None."""
    if v is not None and not Path(v).expanduser().exists():
        raise ValueError(f"file or directory not found: {v}")
    return None if v is None else str(Path(v).expanduser().resolve())


def check_site_at(items: list[str], kinds: tuple[str, ...]) -> list[str]:
    """Validate failure injections 'SITE@N' (or 'SITE@N:KIND' for one of ``kinds``)."""
    suffix = f":({'|'.join(kinds)})" if kinds else ""
    expected = " or ".join(f"SITE@ROUND:{k}" for k in kinds) or "SITE@ROUND"
    for i, item in enumerate(items):
        if not re.fullmatch(rf"[A-Za-z0-9_-]+@\d+{suffix}", item):
            raise ValueError(f"item {i} ({item!r}): expected {expected}")
    return items


def parse_site_at(item: str) -> tuple[str, int, str]:
    """'SITE@N[:KIND]' -> (site, N, kind or '')."""
    site, rest = item.split("@")
    number, _, kind = rest.partition(":")
    return site, int(number), kind
