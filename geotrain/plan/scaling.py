"""Compute-optimal model size and tokens for a compute budget ``C = 6 N D``.

Laws (name them in a scenario with ``scaling.law``):

- ``hoffmann1``: Hoffmann et al. 2022 ("Chinchilla"), approach 1, ``N_opt = G C^0.50``, G fixed
  by their Table 3 (67B parameters for the Gopher budget 5.76e23 FLOPs);
- ``hoffmann2``: approach 2 (IsoFLOP profiles), ``N_opt ∝ C^0.49`` (Table 2), anchored at the
  same Table-3 point (67B at 5.76e23);
- ``hoffmann3``: approach 3, the parametric fit ``L(N, D) = E + A/N^α + B/D^β`` with E=1.69,
  A=406.4, B=410.7, α=0.34, β=0.28; minimising L under ``C = 6ND`` gives
  ``N_opt = G (C/6)^(β/(α+β))``, ``G = (αA/(βB))^(1/(α+β))`` (their eq. 4);
- ``epoch``: the Epoch AI re-fit of approach 3 (Besiroglu et al. 2024): E=1.8172, A=482.01,
  B=2085.43, α=0.3478, β=0.3658;
- ``tokens_per_param``: a fixed ratio ``D = r N`` (r = 20 is the usual Chinchilla rule), so
  ``N = sqrt(C / (6 r))``.

Parametric laws also predict the loss ``L(N_opt, D_opt)``.
"""

from __future__ import annotations

import math
from typing import Any

GOPHER_FLOPS = 5.76e23
PARAMETRIC = {
    "hoffmann3": {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28},
    "epoch": {"E": 1.8172, "A": 482.01, "B": 2085.43, "alpha": 0.3478, "beta": 0.3658},
}
POWER = {"hoffmann1": 0.50, "hoffmann2": 0.49}
LAWS = ("hoffmann1", "hoffmann2", "hoffmann3", "epoch", "tokens_per_param")


def loss(law: str, n: float, d: float) -> float:
    """``E + A/N^α + B/D^β`` for a parametric law."""
    p = PARAMETRIC[law]
    return p["E"] + p["A"] / n ** p["alpha"] + p["B"] / d ** p["beta"]


def optimal(law: str, compute_flops: float, tokens_per_param: float = 20.0) -> dict[str, Any]:
    """Compute-optimal parameters and tokens for ``compute_flops`` under ``law`` (module docstring)."""
    if compute_flops <= 0:
        raise ValueError("compute budget must be > 0")
    out: dict[str, Any] = {"law": law}
    if law in POWER:
        a = POWER[law]
        g = 67e9 / GOPHER_FLOPS**a
        n = g * compute_flops**a
        out["constants"] = {"a": a, "G": g, "anchor": "67B at 5.76e23 FLOPs (Hoffmann et al. Table 3)"}
    elif law in PARAMETRIC:
        p = PARAMETRIC[law]
        al, be = p["alpha"], p["beta"]
        g = (al * p["A"] / (be * p["B"])) ** (1 / (al + be))
        n = g * (compute_flops / 6) ** (be / (al + be))
        out["constants"] = dict(p)
    elif law == "tokens_per_param":
        n = math.sqrt(compute_flops / (6 * tokens_per_param))
        out["constants"] = {"tokens_per_param": tokens_per_param}
    else:
        raise ValueError(f"law must be one of {', '.join(LAWS)} (got {law!r})")
    d = compute_flops / (6 * n)
    out.update({"params": n, "tokens": d, "tokens_per_param": d / n, "loss": loss(law, n, d) if law in PARAMETRIC else None})
    return out
