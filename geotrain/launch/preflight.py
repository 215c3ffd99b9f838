"""Checks that need more than the config's own fields, run before any process starts, so bad
input is refused with one line and nothing is launched: the corpus can feed every rank, a
pretrained model fits the model section and the data's vocabulary, a checkpoint to resume from
verifies, the membership secret file is readable, codecs are not combined with the NCCL
backend, and ``train.compile`` on CPU has a C compiler.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from geotrain.comm.groups import choose_backend, gpus_for
from geotrain.comm.topology import Topology
from geotrain.config import Config
from geotrain.data import check_data, vocab_size
from geotrain.elastic.auth import optional_secret
from geotrain.errors import ConfigError, MembershipRefused
from geotrain.models import check_pretrained
from geotrain.report.trackers import check_tracker
from geotrain.run.checkpoint import Seal, verify


def preflight(cfg: Config, site: int | None = None) -> None:
    """Refuse ``cfg`` before launch if it cannot run here (``site``: only that site runs here, so
    only its private corpus is checked).

    Raises:
        ConfigError: with a one-line message naming the field.
        CheckpointError: ``checkpoint.resume`` names a checkpoint that does not verify.
    """
    topo = Topology.from_config(cfg.topology)
    try:
        check_data(cfg.data, topo.workers, cfg.model.block_size, [s.corpus for s in cfg.topology.sites], site)
        check_pretrained(cfg.model, vocab_size(cfg.data))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    secret = None
    if cfg.elastic.secret_file or not cfg.elastic.enabled:  # elastic mode's secret may live on the sites only
        try:
            secret = optional_secret(cfg.elastic)
        except MembershipRefused as exc:
            raise ConfigError(str(exc)) from None
    resume = cfg.checkpoint.resume
    if resume is not None and resume != "auto":
        sites = list(topo.site_names) if cfg.sync.within_site == "fsdp" else None  # sharded: any workers per site
        # the files on this machine: all of them in one folder, or each site's own in its folder
        # (a folder per site, or only this site runs here)
        here = [site] if site is not None else list(range(topo.num_sites)) if "{site}" in resume else [None]
        for s in here:
            path = resume if s is None else resume.replace("{site}", topo.site_names[s])
            part = None if s is None else _site_files(topo, s)
            verify(
                Path(path).expanduser(),
                topo.world_size,
                None,
                Seal.of(secret),
                cfg.checkpoint.allow_foreign,
                sites,
                part,
                names=list(topo.site_names),
            )
    check_tracker(cfg.report)
    if cfg.train.compile and choose_backend(cfg.run.backend) == "gloo" and not any(map(shutil.which, ("cc", "gcc", "clang"))):
        raise ConfigError("train.compile: on CPU torch.compile needs a C compiler (cc, gcc or clang); none is on PATH")
    local = topo.workers[site] if site is not None else topo.world_size  # the ranks this machine starts
    if why := gpus_for(local, cfg.run.backend):
        raise ConfigError(why)


def _site_files(topo: Topology, s: int) -> Callable[[str], bool]:
    """Whether a file a manifest lists belongs to site ``s``: its ranks' files, its DCP folder."""
    first, name = topo.first_rank(s), topo.site_names[s]
    own = {f"rank{r}.pt" for r in range(first, first + topo.workers[s])}
    return lambda f: f in own or f.startswith(f"site-{name}/")
