"""The layering of geotrain (tests/layering.py) holds on the source tree, and each of its rules
fails on a small synthetic tree that breaks it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.layering import MAX_LINES, check


def test_geotrain_keeps_its_layering() -> None:
    assert check(REPO / "geotrain") == []


def _tree(root: Path, files: dict[str, str]) -> Path:
    """A package 'geotrain' under ``root`` with ``files`` (path -> source) and an __init__ in every folder."""
    pkg = root / "geotrain"
    for rel, src in {"__init__.py": "", **files}.items():
        f = pkg / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        for parent in f.relative_to(pkg).parents:
            init = pkg / parent / "__init__.py"
            if not init.exists():
                init.write_text("")
        f.write_text(src)
    return pkg


CLEAN = {
    "errors.py": "class RoundFailed(RuntimeError):\n    pass\n",
    "config/base.py": "import yaml\nfrom geotrain.errors import RoundFailed\n",
    "comm/groups.py": "import torch.distributed as dist\n\ndef build():\n    return dist.new_group([0])\n",
    "comm/collectives.py": "from geotrain.comm.groups import build\nfrom geotrain.codecs.int8 import encode\n",
    "codecs/int8.py": "import torch\n\ndef encode(x):\n    return x\n",
    "models/gpt.py": "import torch.nn as nn\nfrom geotrain.config.base import yaml\n",
    "sync/ddp.py": "from geotrain.comm.collectives import build\n",
    "cli.py": "from geotrain.sync.ddp import build\n",
    "__main__.py": "from geotrain.cli import build\n",
}


def test_a_clean_synthetic_tree_passes(tmp_path: Path) -> None:
    assert check(_tree(tmp_path, CLEAN)) == []


@pytest.mark.parametrize(
    "files,expect",
    [
        (  # a circle through a lazy import, inside one part
            {"sync/a.py": "from geotrain.sync.b import f\n", "sync/b.py": "def f():\n    from geotrain.sync.a import g\n"},
            "import circle between modules: sync.a -> sync.b -> sync.a",
        ),
        (  # a circle through a package's __init__: "from geotrain.codecs import kernels" runs it first
            {
                "codecs/__init__.py": "from geotrain.codecs.base import f\n",
                "codecs/base.py": "def f():\n    from geotrain.codecs import kernels\n",
                "codecs/kernels.py": "",
            },
            "import circle between modules: codecs -> codecs.base -> codecs",
        ),
        (  # a circle between parts (under TYPE_CHECKING, which counts too)
            {"comm/x.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from geotrain.sync.ddp import build\n"},
            "import circle between parts: sync -> comm -> sync",
        ),
        (  # an import against the direction, through importlib
            {"errors.py": "import importlib\n\ndef late():\n    return importlib.import_module('geotrain.config.base')\n"},
            "part 'errors' imports part 'config' (allowed: none)",
        ),
        ({"models/bad.py": "import torch.distributed as dist\n"}, "models/ must not import torch.distributed"),
        (  # ... also through a geotrain module it imports
            {"errors.py": "import torch.distributed\n", "models/bad.py": "from geotrain.errors import x\n"},
            "models/ must not import torch.distributed (through geotrain.errors)",
        ),
        ({"codecs/bad.py": "from torch.distributed import all_reduce\n"}, "codecs/ must not import torch.distributed"),
        ({"codecs/bad.py": "def f():\n    from geotrain.comm.groups import build\n"}, "codecs/ must not import comm/"),
        ({"config/bad.py": "def f():\n    import torch\n"}, "config/ must not import torch"),
        (
            {"plan/step.py": "from geotrain.config.bad import x\n", "config/bad.py": "import torch.nn\n"},
            "plan/ must not import torch",
        ),
        ({"netsim/run.py": "import torch\n"}, "netsim/ must not import torch"),
        ({"sync/bad.py": "from geotrain import cli\n"}, "imports the CLI"),
        ({"sync/bad.py": "import torch.distributed as dist\n\ndist.new_group([0, 1])\n"}, "calls new_group"),
        ({"elastic/bad.py": "import torch.distributed as dist\n\ndist.ProcessGroupGloo(None, 0, 1)\n"}, "calls ProcessGroupGloo"),
        (
            {"run/bad.py": "from torch.distributed.device_mesh import init_device_mesh\n\ninit_device_mesh('cpu', (2,))\n"},
            "calls init_device_mesh",
        ),
        ({"sync/long.py": "x = 1\n" * (MAX_LINES + 1)}, f"{MAX_LINES + 1} lines (at most {MAX_LINES})"),
        ({"newpart/x.py": "from geotrain.errors import RoundFailed\n"}, "part 'newpart' is not in the layering"),
    ],
    ids=[
        "module-circle-lazy",
        "package-init-circle",
        "part-circle-type-checking",
        "direction-importlib",
        "models-dist",
        "models-dist-through",
        "codecs-dist",
        "codecs-comm",
        "config-torch-lazy",
        "plan-torch-through",
        "netsim-torch",
        "imports-cli",
        "new-group",
        "process-group-gloo",
        "device-mesh",
        "long-module",
        "unknown-part",
    ],
)
def test_each_rule_can_fail(tmp_path: Path, files: dict[str, str], expect: str) -> None:
    bad = check(_tree(tmp_path, {**CLEAN, **files}))
    assert any(expect in b for b in bad), bad
