"""geotrain: train one language model across several datacenters as if they were one computer.

The public API, for a training loop of your own (see :mod:`geotrain.api` and the README)::

    geotrain.Config, geotrain.load_config      the run's configuration (validated, one-line errors)
    geotrain.Site                               this process's place in the run; Site.wrap(model, optimizer)
    geotrain.DDP, geotrain.DiLoCo, geotrain.StreamingDiLoCo, geotrain.SyncAlgorithm
    geotrain.ConfigError, geotrain.RoundFailed  what a caller may catch

Names are imported on first use, so ``import geotrain`` (and the CLI's config check) stays
light: torch is loaded only when a name that needs it is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from geotrain.api import DDP, DiLoCo, Site, StreamingDiLoCo, SyncAlgorithm
    from geotrain.config import Config, load_config
    from geotrain.errors import ConfigError, RoundFailed

__all__ = [
    "DDP",
    "Config",
    "ConfigError",
    "DiLoCo",
    "RoundFailed",
    "Site",
    "StreamingDiLoCo",
    "SyncAlgorithm",
    "__version__",
    "load_config",
]


def __getattr__(name: str) -> Any:
    if name in ("Config", "load_config"):
        from geotrain import config

        return getattr(config, name)
    if name in ("ConfigError", "RoundFailed"):
        from geotrain import errors

        return getattr(errors, name)
    if name in ("Site", "DDP", "DiLoCo", "StreamingDiLoCo", "SyncAlgorithm"):
        from geotrain import api

        return getattr(api, name)
    raise AttributeError(f"module 'geotrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
