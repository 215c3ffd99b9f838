"""The shipped configs: one per mode, each referenced from the README and valid. (What each mode
runs is tested where the mode is: test_privacy, test_wan/test_codecs, test_elastic, test_netns, test_hetero.)"""

from __future__ import annotations

from geotrain.config import load_config
from tests.helpers import REPO

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
MODES = {"default", "cross_org", "elastic", "streaming_int4", "kernel_links", "regions"}


def test_one_config_per_mode_is_shipped_and_referenced_from_the_readme() -> None:
    assert {p.stem for p in CONFIGS} == MODES
    readme = (REPO / "README.md").read_text()
    for p in CONFIGS:
        assert f"configs/{p.name}" in readme, p.name
        load_config(p)
