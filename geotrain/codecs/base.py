"""The codec interface (:class:`Codec`) and what every codec shares; the codecs are in
:mod:`geotrain.codecs` (fixed formats, with numba kernels) and :mod:`geotrain.codecs.sparseloco`."""

from __future__ import annotations

import math
import os
from types import ModuleType
from typing import ClassVar, Literal

import numpy as np
import torch

from geotrain.errors import CorruptPayload, NonFiniteError

CODEC_NAMES = ("none", "bf16", "fp16", "int8", "fp4", "int4", "topk", "sparseloco", "powersgd")
FP16_MAX = 65504.0


def on_kernels(x: torch.Tensor) -> bool:
    """Whether ``x`` is encoded or decoded by the numba kernels (a CPU tensor) or by torch ops where it
    lives (:mod:`geotrain.codecs.torchops`). ``GEOTRAIN_CODEC_KERNELS=0`` in a process's environment
    sends its CPU tensors the torch-ops way too, the path of a GPU's tensors (tests, benchmarks); it
    is read at each call, as a rank forked from a zygote gets its environment after its imports."""
    return x.device.type == "cpu" and os.environ.get("GEOTRAIN_CODEC_KERNELS") != "0"


def kept(fraction: float, m: int) -> int:
    """How many of ``m`` values (m > 0) a sparse codec keeps: ``ceil(fraction · m)``, at least 1
    and at most m (top-k, and SparseLoCo per chunk; its numba kernels compute the same)."""
    return min(m, max(1, math.ceil(fraction * m)))


def _kernels() -> ModuleType:
    """The compiled kernels, imported on first use: numba's import costs every rank a third of a
    second at start (measured), and a run without codecs never needs it."""
    import geotrain.codecs.kernels as kernels  # the module, not the package's __init__ (which imports this one)

    return kernels


def _refuse_non_finite(name: str, x: torch.Tensor) -> None:
    bad = int((~torch.isfinite(x)).sum())
    raise NonFiniteError(f"{name} codec: refusing to encode {bad} non-finite value(s) out of {x.numel():,}")


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


class Codec:
    """Base class. Subclasses implement :meth:`encoded_nbytes`, :meth:`encode`, :meth:`decode`."""

    name: ClassVar[str] = "base"
    bits: ClassVar[float] = 32.0
    reduce: ClassVar[Literal["scatter", "gather"]] = "scatter"
    # gather codecs whose rounds average each coordinate over the sites that sent it (codecs.sparseloco)
    sender_mean: ClassVar[bool] = False

    def encoded_nbytes(self, n: int) -> int:
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: 1-D contiguous fp32 on any device. Returns a uint8 tensor of ``encoded_nbytes(x.numel())`` on that device."""
        raise NotImplementedError

    def decode(self, buf: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Inverse of :meth:`encode` into ``out`` (fp32, ``n`` values on ``buf``'s device; allocated if None). ``buf``
        may come from another site: its length and every position it names are checked before
        a kernel reads it (the compiled kernels do not check bounds).

        Raises:
            CorruptPayload: ``buf`` is not an encoding of ``n`` values by this codec.
        """
        return self._decode(buf, n, self._validate(buf, n, out))

    def _validate(self, buf: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
        """``out`` (allocated if None) once ``buf`` is known to be ``encoded_nbytes(n)`` bytes."""
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != self.encoded_nbytes(n):
            raise CorruptPayload(
                f"{self.name} codec: a payload of {buf.numel():,} {buf.dtype} values for {n:,} values "
                f"(its encoding is {self.encoded_nbytes(n):,} bytes)"
            )
        if out is not None and (out.numel() != n or out.dtype != torch.float32 or not out.is_contiguous()):
            raise ValueError(f"{self.name} codec: decoding {n:,} values into {out.numel():,} {out.dtype} values")
        if out is not None and out.device != buf.device:
            raise ValueError(f"{self.name} codec: decoding a payload on {buf.device} into a tensor on {out.device}")
        return torch.empty(n, dtype=torch.float32, device=buf.device) if out is None else out

    def _decode(self, buf: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` of a payload of the right length into ``out``."""
        raise NotImplementedError

    def _finite(self, x: torch.Tensor, encoded: tuple[torch.Tensor, bool]) -> torch.Tensor:
        """The buffer of a torch-ops encoding of ``x`` (:mod:`geotrain.codecs.torchops`: the
        buffer and whether ``x`` was finite), or the refusal of a non-finite ``x``."""
        buf, finite = encoded
        if not finite:
            _refuse_non_finite(self.name, x)
        return buf

    def warm(self, device: torch.device | str = "cpu") -> Codec:
        """Load this codec's compiled kernels now, for a CPU's tensors and for ``device``'s (numba's
        first call in a process loads them from its disk cache: 0.4 to 0.6 s for int8, int4, fp4
        and SparseLoCo, measured; on a GPU, torch.compile compiles the torch-ops cores), so that no
        exchange pays for it: an adapted run's first round with a newly chosen codec would time
        the load as network. (Under a GPU run, payloads that cross through the host, elastic rounds'
        and the syncer's, are encoded by the kernels.) Codecs hold no state, so this changes no result."""
        for where in dict.fromkeys([torch.device("cpu"), torch.device(device)]):
            x = torch.linspace(-1.0, 1.0, 8192, device=where)
            self.decode(self.encode(x), x.numel())
        return self

    def ratio(self, n: int) -> float:
        """fp32 bytes ÷ wire bytes for ``n`` values."""
        return 4 * n / max(1, self.encoded_nbytes(n))

    @staticmethod
    def _check(x: torch.Tensor) -> None:
        if x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous():
            raise ValueError("codecs encode 1-D contiguous fp32 tensors")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
