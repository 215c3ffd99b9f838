"""The cross-site reducer: sums a vector that is identical on every rank of a site across
sites, encoded with the configured codec, keeping the codec's error-feedback state.

Byte codecs run on each carrying local rank's shard (hierarchical: only S/G per rank crosses the
slow links; unequal sites: G is the smallest site's size). PowerSGD needs matrices, so each local rank takes a contiguous run of whole tensors,
all-reduces their P and Q factors across sites, and the site all-gathers the runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from geotrain.codecs import Codec, Residual, build_codec
from geotrain.codecs.powersgd import PowerSGD
from geotrain.comm.collectives import Collectives
from geotrain.config import SyncConfig


def with_codec(cfg: SyncConfig, name: str) -> SyncConfig:
    """``cfg`` with the codec called ``name`` (adaptation's switch), its other codec keys kept."""
    return cfg if name == cfg.codec.name else cfg.model_copy(update={"codec": cfg.codec.model_copy(update={"name": name})})


def make_codec(cfg: SyncConfig, shapes: Sequence[torch.Size] | None = None, device: torch.device | None = None) -> Codec | None:
    """The byte codec of ``cfg`` (None: fp32 ring, or PowerSGD which is not a byte codec), its
    kernels loaded (:meth:`Codec.warm`: no round times their load as network); ``shapes``: the
    tensors a reduced vector concatenates (SparseLoCo's tiles)."""
    c = cfg.codec
    if c.name in ("none", "powersgd"):
        return None
    return build_codec(
        c.name,
        sigma_range=c.sigma_range,
        block_size=c.block_size,
        fraction=c.fraction,
        chunk=c.chunk,
        variant=c.variant,
        tile=c.tile,
        spread=c.spread,
        shapes=[tuple(s) for s in shapes or []],
    ).warm(device or torch.device("cpu"))


class Codecs(Mapping[str, "Codec | None"]):
    """The codecs a run may switch between (``sync.adapt.codecs``, else just ``sync.codec``), by
    name and by wire index (1-based in that order; 0 says fp32). Each is built (and warmed) the
    first time it is asked for, or by :meth:`build_all` on the ranks that encode: warming a numba
    codec takes about 0.5 s, which a rank that never encodes need not spend."""

    def __init__(
        self,
        cfg: SyncConfig,
        names: Sequence[str],
        shapes: Sequence[torch.Size] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.cfg, self.names, self.shapes, self.device = cfg, list(names), shapes, device
        self._built: dict[str, Codec | None] = {}

    def __getitem__(self, name: str) -> Codec | None:
        if name not in self.names:
            raise KeyError(name)
        if name not in self._built:
            self._built[name] = make_codec(with_codec(self.cfg, name), self.shapes, self.device)
        return self._built[name]

    @staticmethod
    def feeds_back(cfg: SyncConfig) -> bool:
        """Whether ``cfg``'s codec keeps error feedback (never with sync.adapt, whose codecs change)."""
        return Codecs.encodes(cfg.codec.name) and cfg.codec.uses_error_feedback and cfg.adapt is None

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def build_all(self) -> Codecs:
        """Build and warm every codec now (no round then times a codec's load as network)."""
        for name in self.names:
            self[name]
        return self

    def index(self, name: str) -> int:
        """``name``'s index on the wire."""
        return 1 + self.names.index(name)

    def at(self, index: int) -> Codec | None:
        """The codec of wire index ``index`` (≥ 1)."""
        return self[self.names[index - 1]]

    @staticmethod
    def encodes(name: str) -> bool:
        """Whether ``name`` is a byte codec (none and PowerSGD are not), without building it."""
        return name not in ("none", "powersgd")


def contiguous_split(sizes: Sequence[int], parts: int) -> list[int]:
    """Cut ``sizes`` (in order) into ``parts`` contiguous runs of near-equal total; the run totals."""
    total = sum(sizes)
    runs = [0] * parts
    acc = 0
    for n in sizes:
        j = min(parts - 1, (acc * parts) // max(1, total)) if total else 0
        # a tensor goes to the part its start falls in
        runs[j] += n
        acc += n
    return runs


class SiteReducer:
    """Sums a flat fp32 vector that is identical on every rank of a site across sites, encoded.

    Byte codecs run on each local rank's 1/G shard (:meth:`Collectives.all_reduce_across_sites`).
    PowerSGD needs matrices, so each local rank takes a contiguous run of whole tensors, all-reduces
    their P and Q factors across sites, and the site all-gathers the runs.
    """

    def __init__(
        self,
        cfg: SyncConfig,
        comm: Collectives,
        shapes: Sequence[torch.Size],
        seed: int = 0,
        sharded: bool = False,
        region: bool = False,
    ) -> None:
        self.comm = comm
        self.region = region  # sum over the sites of this rank's region only (multi-tier sync)
        self.codec = make_codec(cfg, shapes, comm.groups.device)
        self.residual = (
            Residual(decay=cfg.codec.error_decay) if (self.codec is not None and cfg.codec.uses_error_feedback) else None
        )
        self.shapes = list(shapes)
        self.sharded = sharded  # each rank holds its own FSDP shard (``shapes``: its shards' shapes)
        self.powersgd: PowerSGD | None = None
        if cfg.codec.name == "powersgd":
            self.powersgd = PowerSGD(cfg.codec.rank, cfg.codec.uses_error_feedback, seed)
            g = comm.groups
            numels = [int(s.numel()) for s in self.shapes]
            # the carrying local ranks take the runs (unequal sites: the smallest site's size of them)
            k = g.topology.carriers
            self.run_sizes = contiguous_split(numels, k) + [0] * (len(g.intra_ranks) - k)
            # which tensors this local rank owns: the run its index falls in
            start = sum(self.run_sizes[: g.me.local_rank])
            stop = start + self.run_sizes[g.me.local_rank]
            offsets = list(itertools.accumulate(numels, initial=0))[:-1]  # where each tensor starts
            self.mine = [i for i, (o, n) in enumerate(zip(offsets, numels, strict=True)) if start <= o < stop and n]
            if sharded:  # every rank factors its own shards (local rank i holds the same ones in every site)
                self.mine = [i for i, n in enumerate(numels) if n]

    @property
    def sender_mean(self) -> bool:
        """Whether a round averages each coordinate over the sites that sent it (SparseLoCo as published)."""
        return self.codec is not None and self.codec.sender_mean

    def __call__(self, flat: torch.Tensor, shares: Sequence[float] | None = None) -> None:
        """Replace ``flat`` by its sum over sites (every rank of every site ends with the same values);
        with ``shares`` (one per site, in site order) and a :attr:`sender_mean` codec, by the
        share-weighted mean over the sites that sent each coordinate."""
        if self.powersgd is None:
            self.comm.all_reduce_across_sites(
                flat, self.codec, self.residual, sharded=self.sharded, region=self.region, shares=shares
            )
            return
        g = self.comm.groups
        stats = self.comm.stats
        raw0 = stats.inter_raw_bytes
        views = [v.view(shape) for v, shape in zip(flat.split([s.numel() for s in self.shapes]), self.shapes, strict=True)]
        self.powersgd.all_reduce([views[i] for i in self.mine], self.comm.all_reduce_inter)
        # reference for the compression ratio: an fp32 ring all-reduce of the same tensors
        n, mine = len(g.inter_ranks), sum(views[i].numel() for i in self.mine)
        if mine:
            stats.inter_raw_bytes = raw0 + round(2 * (n - 1) / n * 4 * mine)
        if not self.sharded:
            self.comm.all_gather_intra(flat, self.run_sizes)

    def forget_residual(self) -> None:
        """Drop the error-feedback residual (a site left out of a round must send exactly nothing)."""
        if self.residual is not None:
            self.residual.tensor = None
        if self.powersgd is not None:
            self.powersgd.errors = [None] * len(self.powersgd.errors)

    def state_dict(self) -> dict[str, Any]:
        """Error-feedback / warm-start state: belongs to the site, goes into its checkpoint."""
        return {
            "residual": None if self.residual is None else self.residual.tensor,
            "powersgd": None if self.powersgd is None else self.powersgd.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.residual is not None:
            self.residual.tensor = state["residual"]
        saved = state["powersgd"]
        # a resharded resume (other FSDP shards) drops the warm start: Q is drawn again from the seed
        if self.powersgd is not None and saved is not None and saved["shapes"] in ([], [list(self.shapes[i]) for i in self.mine]):
            self.powersgd.load_state_dict(saved)
