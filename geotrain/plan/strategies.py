"""Low-communication training across sites: bandwidth needed for a compute utilisation, and back.

A model of ``P`` parameters trains with step time ``T`` on every site; ``n`` sites are joined by
a link of bandwidth ``B`` (bit/s) and round-trip time ``rtt``. An all-reduce across sites moves
``V = 2 (n-1)/n * P * bits`` over each site's link (ring) with ``2 (n-1)`` latency steps
(``rtt / 2`` each). Utilisation = compute time / wall time.

- ``dp`` (data parallel across sites): every step, gradients at ``dp_bits``; the all-reduce
  overlaps the backward pass (2/3 of the step), the rest is exposed:
  ``u = T / (T + max(0, t_ar - 2T/3))``;
- ``diloco``: every ``H`` steps, pseudo-gradients at ``bits``, blocking:
  ``u = H T / (H T + t_ar)``;
- ``streaming`` (Streaming DiLoCo, Douillard et al. 2025): the model in ``F`` fragments (3 layers
  each), one fragment synced every ``H/F`` steps, its all-reduce overlapped with ``τ`` inner
  steps, the F all-reduces of a cycle sharing one link:
  ``u = H T / (H T + max(F max(0, t_frag - τ T), F t_frag - H T))`` (the second term binds when
  F τ > H: overlap windows that overlap cannot hide more than the cycle's compute);
- ``streaming_fp4``: the same with 4-bit pseudo-gradients (E3M0 as in the paper).

Required bandwidth for a target ``u`` inverts these: the allowed communication time minus the
latency, divided into ``V``. Their Table 4 simulated a DAG of per-layer compute and communication
on a discrete bandwidth grid; this closed form is printed beside it.

The same formula steers a running job (``sync.adapt``, :mod:`geotrain.round.adapt`):
:func:`achieved_bps` turns measured all-reduces (bytes, seconds, latency) into the link's
bandwidth in this model, :func:`streaming_effective_bps` turns Streaming DiLoCo's measured wait
into the bandwidth that explains it, and :func:`choose_round` picks H, codec and (streaming) the
fragment count for a link. With ``sites`` = :data:`STAR` the exchange is a star instead of a ring
(asynchronous quorum rounds: each site sends its update to the syncer and gets the model back over
its own link): ``V = 2 P bits`` (up, then down) and one round trip.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

# Streaming DiLoCo (arXiv 2501.18512) Table 4: Gbit/s for 90/95/99% utilisation; H=100, MFU 60%
STREAMING_TABLE4 = {
    "1B": {
        "step_s": 0.1,
        "dp": (184.2, 222.3, 569.0),
        "diloco": (13.3, 23.3, 86.8),
        "streaming": (6.2, 9.1, 11.0),
        "streaming_fp4": (1.7, 2.0, 3.0),
    },
    "10B": {
        "step_s": 0.8,
        "dp": (222.3, 268.3, 471.5),
        "diloco": (16.0, 33.9, 104.8),
        "streaming": (5.2, 6.2, 7.5),
        "streaming_fp4": (1.4, 1.4, 1.7),
    },
    "100B": {
        "step_s": 4.9,
        "dp": (390.7, 390.7, 471.5),
        "diloco": (23.3, 49.4, 184.2),
        "streaming": (4.3, 5.2, 5.2),
        "streaming_fp4": (1.1, 1.1, 1.4),
    },
}
ALGORITHMS = ("dp", "diloco", "streaming", "streaming_fp4")
TARGETS = (0.90, 0.95, 0.99)


STAR = 0  # ``sites`` for a star: each site sends its update to a hub and gets the model back (quorum rounds)


def _volume_latency(params: float, bits: float, sites: int, rtt_s: float, fragments: int = 1) -> tuple[float, float]:
    if sites == STAR:  # up, then down, on the site's own link: both ways' bytes, one round trip
        return 2 * params * bits / fragments, rtt_s
    vol = 2 * (sites - 1) / sites * params * bits / fragments
    return vol, 2 * (sites - 1) * rtt_s / 2


def _comm_allowed(alg: str, u: float, step_s: float, H: int, F: int, tau: int) -> float:
    """Communication time (per all-reduce) that still gives utilisation ``u``."""
    slack = (1 / u - 1) * step_s
    if alg == "dp":
        return 2 * step_s / 3 + slack
    if alg == "diloco":
        return H * slack
    return _streaming_exchange_time(H * slack, H, F, tau, step_s)


def _streaming_exchange_time(exposed: float, H: int, F: int, tau: int, step_s: float) -> float:
    """The longest exchange time t for which :func:`_streaming_exposed` stays within ``exposed``
    (both of its terms grow with t: the smaller of their inverses). Each exchange hides behind
    tau steps, and the F exchanges of a cycle share one link."""
    return min(tau * step_s + exposed / F, (exposed + H * step_s) / F)


def required_bps(
    alg: str,
    u: float,
    params: float,
    step_s: float,
    sites: int,
    rtt_s: float,
    H: int,
    fragments: int,
    tau: int,
    bits: dict[str, float],
) -> float:
    """Link bandwidth (bit/s) for utilisation ``u`` (inf when latency alone exceeds the allowance)."""
    F = fragments if alg.startswith("streaming") else 1
    vol, lat = _volume_latency(params, bits[alg], sites, rtt_s, F)
    t = _comm_allowed(alg, u, step_s, H, F, tau) - lat
    return vol / t if t > 0 else math.inf


def utilization(
    alg: str,
    bps: float,
    params: float,
    step_s: float,
    sites: int,
    rtt_s: float,
    H: int,
    fragments: int,
    tau: int,
    bits: dict[str, float],
) -> float:
    """Predicted compute utilisation on a link of ``bps``."""
    F = fragments if alg.startswith("streaming") else 1
    vol, lat = _volume_latency(params, bits[alg], sites, rtt_s, F)
    t = vol / bps + lat
    if alg == "dp":
        return step_s / (step_s + max(0.0, t - 2 * step_s / 3))
    if alg == "diloco":
        return H * step_s / (H * step_s + t)
    return H * step_s / (H * step_s + _streaming_exposed(t, H, F, tau, step_s))


def _streaming_exposed(t: float, H: int, F: int, tau: int, step_s: float) -> float:
    """Seconds per cycle of H steps that compute waits on Streaming DiLoCo's network: each of the F
    exchanges of ``t`` seconds hides behind tau steps, and at least the link's excess over the
    cycle's compute (the exchanges run one after another on one link: with F·tau > H their
    overlap windows overlap, and more fragments cannot hide more than the cycle's H steps)."""
    return max(F * max(0.0, t - tau * step_s), F * t - H * step_s, 0.0)


def strategies(
    params: float,
    layers: int,
    step_s: float,
    sites: int,
    link_bps: float,
    rtt_s: float,
    H: int,
    tau: int,
    bits: dict[str, float],
    target: float,
) -> dict[str, Any]:
    """Required bandwidth per strategy and target, predicted utilisation on the link, a recommendation."""
    fragments = max(1, math.ceil(layers / 3))
    rows: list[dict[str, Any]] = []
    for alg in ALGORITHMS:
        rows.append(
            {
                "algorithm": alg,
                "bits": bits[alg],
                "H": 1 if alg == "dp" else H,
                "fragments": fragments if alg.startswith("streaming") else 1,
                "required_bps": {
                    f"{t:.2f}": required_bps(alg, t, params, step_s, sites, rtt_s, H, fragments, tau, bits) for t in TARGETS
                },
                "predicted_utilization": utilization(alg, link_bps, params, step_s, sites, rtt_s, H, fragments, tau, bits),
            }
        )
    ok = [r for r in rows if r["predicted_utilization"] >= target]
    # prefer the least departure from data parallel that meets the target: dp, diloco, streaming, fp4
    best = ok[0] if ok else max(rows, key=lambda r: r["predicted_utilization"])
    rec = {
        "algorithm": best["algorithm"],
        "H": best["H"],
        "fragments": best["fragments"],
        "codec": "fp4" if best["algorithm"] == "streaming_fp4" else ("bf16" if best["bits"] == 16 else f"{best['bits']:g}-bit"),
        "predicted_utilization": best["predicted_utilization"],
        "meets_target": bool(ok),
        "target": target,
    }
    if best["algorithm"] == "diloco":  # the smallest H that still meets the target: the least staleness
        for h in (1, 5, 10, 25, 50, 100, 250, 500, 1000):
            u_h = utilization("diloco", link_bps, params, step_s, sites, rtt_s, h, fragments, tau, bits)
            if u_h >= target:
                rec["H"], rec["predicted_utilization"] = h, u_h
                break
    return {"fragments": fragments, "tau": tau, "rows": rows, "recommendation": rec}


def achieved_bps(nbytes: float, seconds: float, sites: int, rtt_s: float, exchanges: int = 1) -> float:
    """The bandwidth (bit/s) measured cross-site all-reduces achieved in this model: a site sent
    ``nbytes`` in ``seconds`` over ``exchanges`` all-reduces, each paying the model's latency term,
    which is not transfer time. (At least a twentieth of the time is counted as transfer, so a
    latency overestimate cannot make it infinite.)"""
    _, lat = _volume_latency(0.0, 0.0, sites, rtt_s)
    return 8 * nbytes / max(seconds - exchanges * lat, seconds / 20, 1e-9)


def streaming_effective_bps(
    exposed_s: float, params: float, bits: float, step_s: float, sites: int, rtt_s: float, H: int, F: int, tau: int
) -> float:
    """The bandwidth (bit/s) at which :func:`utilization`'s streaming formula predicts that a cycle
    of H steps at these settings leaves compute waiting ``exposed_s`` seconds: the formula inverted
    on a measured wait, as :func:`achieved_bps` inverts DiLoCo's on a measured all-reduce (inf when
    nothing was exposed)."""
    if exposed_s <= 0:
        return math.inf
    t = _streaming_exchange_time(exposed_s, H, F, tau, step_s)
    vol, lat = _volume_latency(params, bits, sites, rtt_s, F)
    return vol / max(t - lat, t / 20, 1e-9)


def choose_round(
    bps: float,
    params: float,
    step_s: float,
    sites: int,
    rtt_s: float,
    H_min: int,
    H_max: int,
    codec_bits: dict[str, float],
    target: float,
    fragments: Sequence[int] = (),
    tau: int = 0,
    current: tuple[str, int, int] | None = None,
    hold: float = 0.0,
) -> dict[str, Any]:
    """H, codec and fragment count for a link of ``bps`` and ``rtt_s``: the least compression
    (most bits) that reaches ``target`` with some H <= ``H_max``, with the smallest such H (the
    least staleness), then the fewest fragments that reach it there; when no codec reaches it, the
    most compressed at ``H_max`` with the fragment count of highest utilisation (the fewest of
    equals). ``fragments`` empty: DiLoCo (one exchange per round, no overlap); else Streaming
    DiLoCo with these fragment counts to choose from and ``tau`` steps of overlap. With ``hold``
    above 0, the ``current`` (codec, H, fragments) are kept, ``held``, while they are predicted
    between ``target`` and ``target + hold`` (hysteresis: a change has a cost of its own). Returns
    {codec, H, fragments (streaming only), predicted_utilization, meets_target[, held]}."""
    counts = sorted(fragments) or [1]
    alg = "streaming" if fragments else "diloco"

    def u(bits: float, H: int, F: int) -> float:
        return utilization(alg, bps, params, step_s, sites, rtt_s, H, F, tau, {alg: bits})

    if current is not None and hold > 0:
        name, H, F = current
        pu = u(codec_bits[name], H, F)
        if target <= pu <= target + hold:
            return {
                "codec": name,
                "H": H,
                **({"fragments": F} if fragments else {}),
                "predicted_utilization": pu,
                "meets_target": True,
                "held": True,
            }

    def best_F(bits: float, H: int) -> int:
        return max(counts, key=lambda F: (u(bits, H, F), -F))

    def result(name: str, bits: float, H: int) -> dict[str, Any]:
        F = best_F(bits, H)
        if u(bits, H, F) >= target:  # the fewest fragments that reach the target
            F = next(f for f in counts if u(bits, H, f) >= target)
        pu = u(bits, H, F)
        return {
            "codec": name,
            "H": H,
            **({"fragments": F} if fragments else {}),
            "predicted_utilization": pu,
            "meets_target": pu >= target,
        }

    by_bits = sorted(codec_bits.items(), key=lambda kv: -kv[1])  # stable: equal widths keep the given order
    for name, bits in by_bits:
        if u(bits, H_max, best_F(bits, H_max)) >= target:
            lo, hi = H_min, H_max  # the best u grows with H: the smallest H that reaches the target
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if u(bits, mid, best_F(bits, mid)) >= target else (mid + 1, hi)
            return result(name, bits, lo)
    name, bits = by_bits[-1]
    return result(name, bits, H_max)
