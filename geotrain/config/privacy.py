"""The privacy section: secure aggregation and differential privacy (cross-organisation mode)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from geotrain.config.base import Section, check_site_at, parse_site_at


def sparse_degree(n: int) -> int:
    """SecAgg+ neighbourhood size for ``n`` sites: O(log n), even, at most n - 1 (Bell et al. 2020).

    Lives with the config because the threshold check at load time needs it; the protocol
    (:mod:`geotrain.privacy.secagg`) uses this same function."""
    return min(n - 1, 2 * math.ceil(math.log2(max(2, n))))


class DPConfig(Section):
    unit: Literal["none", "site", "example"] = Field(
        default="none",
        description="Differential privacy unit: none; site (each site clips its pseudo-gradient and adds its share of "
        "Gaussian noise, meaningful with many sites); example (DP-SGD on the inner steps: per-example clipping and noise).",
    )
    epsilon: float | None = Field(
        default=None,
        gt=0,
        description="Privacy budget ε: training stops before a step would exceed it. With noise_multiplier unset, the noise "
        "is calibrated so the planned run spends exactly this.",
    )
    delta: float = Field(default=1e-5, gt=0, lt=1, description="δ of (ε, δ)-DP (0 < δ < 1; well below 1/records).")
    clip_norm: float = Field(
        default=1.0, gt=0, description="L2 bound of one unit's contribution: a site's pseudo-gradient, or one example's gradient."
    )
    noise_multiplier: float | None = Field(
        default=None, ge=0, description="Noise std / clip_norm; unset: calibrated from epsilon (one of the two is needed)."
    )
    accountant: Literal["rdp", "prv"] = Field(default="rdp", description="Opacus privacy accountant.")


class PrivacyConfig(Section):
    secure_aggregation: bool = Field(
        default=False,
        description="Sum pseudo-gradients across sites with secure aggregation (pairwise masks; no site sees another's update).",
    )
    threshold: int | None = Field(
        default=None,
        ge=3,
        description="Shamir threshold t (at least 3): shares needed to remove a dropped site's masks; a round needs t "
        "survivors. Default: more than two thirds of each sharing set (2s/3 + 1), at least 3.",
    )
    graph: Literal["complete", "sparse"] = Field(
        default="complete", description="Masking graph: complete (Bonawitz et al.) or sparse (SecAgg+, O(log n) neighbours)."
    )
    update_bound: float = Field(
        default=100.0,
        gt=0,
        le=1e6,
        description="L2 bound a pseudo-gradient is clipped to before fixed-point encoding (with dp.unit=site: dp.clip_norm).",
    )
    dp: DPConfig = Field(default_factory=DPConfig, description="Differential privacy.")
    keys_dir: str | None = Field(
        default=None,
        description="Where each site keeps its Ed25519 audit signing key (<site>.key, 0600, kept across runs; <site>.pub "
        "to publish). Default: $GEOTRAIN_KEYS_DIR, else ~/.geotrain/keys: outside the output folder whose logs it signs, "
        "so whoever can write the logs does not also hold the key.",
    )
    inject: list[str] = Field(
        default_factory=list,
        description="Failure injection for tests: 'SITE@ROUND:drop' withdraws the site's update after key agreement, "
        "'SITE@ROUND:malformed' sends a malformed masked update.",
    )

    @field_validator("inject")
    @classmethod
    def _inject_form(cls, v: list[str]) -> list[str]:
        return check_site_at(v, ("drop", "malformed"))

    @model_validator(mode="after")
    def _dp_ok(self) -> PrivacyConfig:
        if self.dp.unit != "none" and self.dp.epsilon is None and self.dp.noise_multiplier is None:
            raise ValueError("dp.noise_multiplier: set it or dp.epsilon (to calibrate the noise) when dp.unit is not none")
        return self

    def injections(self) -> dict[tuple[str, int], str]:
        return {(site, rnd): kind for site, rnd, kind in map(parse_site_at, self.inject)}
