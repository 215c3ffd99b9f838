"""Session-wide settings for the tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def _signing_keys_of_this_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The audit signing keys of the private runs the tests start (their processes inherit this
    environment) go to a folder of this session, not to ~/.geotrain/keys."""
    before = os.environ.get("GEOTRAIN_KEYS_DIR")
    os.environ["GEOTRAIN_KEYS_DIR"] = str(tmp_path_factory.mktemp("keys"))
    yield
    if before is None:
        os.environ.pop("GEOTRAIN_KEYS_DIR", None)
    else:
        os.environ["GEOTRAIN_KEYS_DIR"] = before
