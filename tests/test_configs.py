"""The shipped configs: one per mode, each referenced from the README, each valid, and each runs
(shortened: a tiny model, a few rounds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from geotrain.comm.emulate import kernel as netns
from geotrain.config import load_config
from tests.helpers import REPO, read_summary, train_cli

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
MODES = {"default", "cross_org", "elastic", "streaming_int4", "kernel_links"}


def test_one_config_per_mode_is_shipped_and_referenced_from_the_readme() -> None:
    assert {p.stem for p in CONFIGS} == MODES
    readme = (REPO / "README.md").read_text()
    for p in CONFIGS:
        assert f"configs/{p.name}" in readme, p.name
        load_config(p)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["cross_org", "streaming_int4"])  # elastic, kernel: runs in test_elastic, test_netns
def test_each_shipped_config_runs(tmp_path: Path, name: str) -> None:
    if name == "kernel_links" and netns.unavailable():
        pytest.skip(f"kernel emulation unavailable: {netns.unavailable()}")
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    H = cfg.sync.H if cfg.sync.algorithm != "ddp" else 1
    overrides = [f"train.steps={3 * H}", "train.eval_every=0", "checkpoint.every=0"]
    out = tmp_path / name
    train_cli(out, overrides, (REPO / "configs" / f"{name}.yaml").read_text(), timeout=280)
    s = read_summary(out)
    assert s["steps"] == 3 * H and s["algorithm"] == cfg.sync.algorithm
    if name == "elastic":
        assert s["consistent"] and s["survivors"] == ["A", "B", "C"]
    if name == "cross_org":
        assert s["secagg"] and s["dp_unit"] == "site"
    if name == "streaming_int4":
        assert s["codec"] == "int4"
    if name == "kernel_links":
        assert s["link_emulation"] == "kernel"
