"""Typed, validated configuration for a geotrain run (no torch: the CLI rejects bad input fast).

One pydantic model per section; every field has a description (rendered into docs/CONFIG.md)
and is checked when the config is loaded, never deep inside a run: unknown keys, wrong types
(strict mode: a string is not a number) and out-of-range values raise
:class:`geotrain.errors.ConfigError`, whose one-line message names the field.

- :mod:`.base`: the ``Section`` base and shared validators;
- :mod:`.topology`, :mod:`.training`, :mod:`.sync`, :mod:`.privacy`, :mod:`.resilience`: the sections;
- :mod:`.root`: the whole ``Config`` and the checks that span sections;
- :mod:`.load`: YAML files plus ``--set KEY=VALUE`` overrides, one-line errors;
- :mod:`.reference`: the markdown reference generator.
"""

from geotrain.config.base import Section
from geotrain.config.load import format_error, load_config, load_yaml_model
from geotrain.config.privacy import DPConfig, PrivacyConfig
from geotrain.config.reference import markdown_reference
from geotrain.config.resilience import ElasticConfig, FaultConfig, GuardConfig, LivenessConfig
from geotrain.config.root import Config
from geotrain.config.sync import CODEC_BITS, STREAMING_HOLD, AdaptConfig, CodecConfig, QuorumConfig, SyncConfig
from geotrain.config.topology import LinkChangeConfig, LinkConfig, LinksConfig, PairLinkConfig, SiteConfig, TopologyConfig
from geotrain.config.training import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ReportConfig,
    RunConfig,
    TrainConfig,
)
from geotrain.errors import ConfigError

__all__ = [
    "CODEC_BITS",
    "STREAMING_HOLD",
    "CheckpointConfig",
    "CodecConfig",
    "Config",
    "ConfigError",
    "DPConfig",
    "DataConfig",
    "ElasticConfig",
    "FaultConfig",
    "GuardConfig",
    "LinkChangeConfig",
    "LivenessConfig",
    "LinkConfig",
    "LinksConfig",
    "ModelConfig",
    "ReportConfig",
    "OptimConfig",
    "PairLinkConfig",
    "PrivacyConfig",
    "RunConfig",
    "Section",
    "SiteConfig",
    "SyncConfig",
    "AdaptConfig",
    "QuorumConfig",
    "TopologyConfig",
    "TrainConfig",
    "format_error",
    "load_config",
    "load_yaml_model",
    "markdown_reference",
]
