"""PowerSGD (Vogels et al., NeurIPS 2019): rank-r approximation by one power iteration per round.

For each matrix M (a tensor reshaped to rows × rest) every participant computes P = M Q with a
shared Q, the Ps are summed (PowerSGD is linear in P and Q, so the factors are all-reduced
directly, in fp32), P is orthonormalised, Q = Mᵀ P is summed, and Σ M ≈ P Qᵀ. Q is kept for the
next round (warm start: the power iteration continues across rounds) and, with error feedback,
what the local projection missed (M − P Pᵀ M) is added to the next round's M.

Tensors where rank r would not compress by at least ``min_compression`` (vectors, small or thin
matrices) are summed uncompressed in one fp32 buffer. The functions take a ``sum_`` callable, so
the same code runs over a process group or, with an identity, on one process (tests, bench).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def orthonormalize_(p: torch.Tensor) -> None:
    """Orthonormal columns spanning ``p`` (reduced QR; deterministic, same on every rank)."""
    q, _ = torch.linalg.qr(p, mode="reduced")
    p.copy_(q)


class PowerSGD:
    """PowerSGD state for one fixed list of tensor shapes (one per participant slot).

    Args:
        rank: approximation rank r.
        error_feedback: carry what the local projection missed into the next round.
        seed: seeds the initial Q; identical on every participant, so their Qs agree.
        min_compression: compress a matrix only if n·m ≥ min_compression · r·(n+m).
    """

    def __init__(self, rank: int = 4, error_feedback: bool = True, seed: int = 0, min_compression: float = 2.0) -> None:
        if rank < 1:
            raise ValueError("rank must be >= 1")
        self.rank = rank
        self.error_feedback = error_feedback
        self.seed = seed
        self.min_compression = min_compression
        self.qs: list[torch.Tensor | None] = []
        self.errors: list[torch.Tensor | None] = []
        self._shapes: list[torch.Size] | None = None

    def compressed(self, shape: Sequence[int]) -> bool:
        if len(shape) < 2:
            return False
        n = int(shape[0])
        m = int(torch.Size(shape).numel()) // max(1, n)
        r = min(self.rank, n, m)
        return n * m >= self.min_compression * r * (n + m)

    def wire_floats(self, shapes: Sequence[Sequence[int]]) -> int:
        """Floats all-reduced per round: P and Q for compressed matrices, the rest in full."""
        total = 0
        for s in shapes:
            numel = int(torch.Size(s).numel())
            if self.compressed(s):
                n = int(s[0])
                m = numel // n
                total += min(self.rank, n, m) * (n + m)
            else:
                total += numel
        return total

    def _init(self, tensors: Sequence[torch.Tensor]) -> None:
        shapes = [t.shape for t in tensors]
        if self._shapes is None:
            self._shapes = shapes
            gen = torch.Generator().manual_seed(self.seed)
            self.qs = []
            for s in shapes:
                if self.compressed(s):
                    n = int(s[0])
                    m = int(s.numel()) // n
                    self.qs.append(torch.randn(m, min(self.rank, n, m), generator=gen, dtype=torch.float32))
                else:
                    self.qs.append(None)
            self.errors = [None] * len(shapes)
        elif shapes != self._shapes:
            raise ValueError("PowerSGD state was built for different tensor shapes")

    @torch.no_grad()
    def all_reduce(self, tensors: Sequence[torch.Tensor], sum_: Callable[[torch.Tensor], None]) -> None:
        """Replace each tensor (fp32) by its sum over participants: approximate for compressed ones."""
        self._init(tensors)
        plain = [i for i, q in enumerate(self.qs) if q is None]
        comp = [i for i, q in enumerate(self.qs) if q is not None]
        if plain:
            flat = torch.cat([tensors[i].reshape(-1) for i in plain])
            sum_(flat)
            for i, v in zip(plain, flat.split([tensors[i].numel() for i in plain]), strict=True):
                tensors[i].copy_(v.view_as(tensors[i]))
        if not comp:
            return
        ms = []
        for i in comp:
            m = tensors[i].reshape(tensors[i].shape[0], -1).clone()
            err = self.errors[i]
            if err is not None:
                m.add_(err)
            ms.append(m)
        qs = [self.qs[i].to(m.device) for i, m in zip(comp, ms, strict=True)]  # type: ignore[union-attr]
        ps = [m @ q for m, q in zip(ms, qs, strict=True)]  # type: ignore[operator]
        flat_p = torch.cat([p.reshape(-1) for p in ps])
        sum_(flat_p)
        ps = [v.view_as(p).clone() for v, p in zip(flat_p.split([p.numel() for p in ps]), ps, strict=True)]
        for p in ps:
            orthonormalize_(p)
        new_qs = [m.t() @ p for m, p in zip(ms, ps, strict=True)]
        if self.error_feedback:
            for i, m, p, q in zip(comp, ms, ps, new_qs, strict=True):
                self.errors[i] = m - p @ q.t()  # local projection's miss (q is still local here)
        flat_q = torch.cat([q.reshape(-1) for q in new_qs])
        sum_(flat_q)
        for i, v, p, q in zip(comp, flat_q.split([q.numel() for q in new_qs]), ps, new_qs, strict=True):
            qsum = v.view_as(q).clone()
            self.qs[i] = qsum  # warm start
            tensors[i].copy_((p @ qsum.t()).view_as(tensors[i]))

    def state_dict(self) -> dict[str, object]:
        """Warm-start Qs and error-feedback residuals (part of the site's checkpoint)."""
        return {"shapes": [list(s) for s in self._shapes or []], "qs": list(self.qs), "errors": list(self.errors)}

    def load_state_dict(self, state: dict[str, object]) -> None:
        shapes = state["shapes"]
        assert isinstance(shapes, list)
        self._shapes = [torch.Size(s) for s in shapes] if shapes else None
        self.qs = list(state["qs"])  # type: ignore[call-overload]
        self.errors = list(state["errors"])  # type: ignore[call-overload]
