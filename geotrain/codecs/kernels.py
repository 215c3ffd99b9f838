"""Fused single-pass CPU kernels for the quantising codecs (numba, one thread).

Why numba: a straightforward torch-ops quantiser makes 6-10 passes over memory (abs, max,
divide, round, clamp, cast, pack, ...), each allocating a full-size temporary, and runs at
~0.1 GB/s encode on one core. These loops read each value once per pass, keep a block in L1
while computing its scale and codes, and write only the packed result. numba compiles them
to vectorised machine code without a C++ toolchain at install time and caches the result on
disk (``cache=True``); torch.compile needs a C++ compiler at run time and has a long warm-up.

Every kernel takes 1-D contiguous numpy views of torch tensors (zero-copy) and writes into
preallocated outputs. Non-finite inputs are detected in the same pass (``v * 0.0`` is NaN
exactly when ``v`` is NaN or ±inf) and reported by a flag, never encoded.
"""

from __future__ import annotations

import numba
import numpy as np

# Only value-preserving fast-math flags: reassociation lets sums vectorise; NaN/inf semantics
# are kept (no 'nnan'/'ninf') so non-finite detection still works.
_jit = numba.njit(nogil=True, cache=True, fastmath={"reassoc", "contract", "nsz", "arcp"}, boundscheck=False)


@_jit
def moments(x: np.ndarray) -> tuple[float, float, float]:  # pragma: no cover - compiled
    """(sum, sum of squares, finiteness probe) accumulated in float64; probe is NaN if any value is not finite."""
    s = 0.0
    ss = 0.0
    probe = 0.0
    for i in range(x.size):
        v = np.float64(x[i])
        s += v
        ss += v * v
        probe += v * 0.0
    return s, ss, probe


@_jit
def int8_encode(x: np.ndarray, lo: float, inv_step: float, codes: np.ndarray, table: np.ndarray) -> None:  # pragma: no cover
    """Bucket index of each value in 256 uniform buckets from ``lo``; ``table`` gets each bucket's mean.

    Values outside the range fall into the end buckets. A bucket nobody fell into keeps its centre.
    Four interleaved accumulators break the store-to-load chain when neighbours share a bucket.
    """
    sums = np.zeros((4, 256), dtype=np.float64)
    counts = np.zeros((4, 256), dtype=np.int64)
    n = x.size
    lo32 = np.float32(lo)
    inv32 = np.float32(inv_step)
    for i in range(n):
        v = x[i]
        t = (v - lo32) * inv32  # fp32, as the torch reference computes it
        if t < 0:
            t = np.float32(0)
        elif t > 255:
            t = np.float32(255)
        q = int(t)
        codes[i] = q
        lane = i & 3
        sums[lane, q] += v
        counts[lane, q] += 1
    step = 1.0 / inv_step
    for b in range(256):
        c = counts[0, b] + counts[1, b] + counts[2, b] + counts[3, b]
        if c > 0:
            table[b] = (sums[0, b] + sums[1, b] + sums[2, b] + sums[3, b]) / c
        else:
            table[b] = lo + (b + 0.5) * step


@_jit
def lookup_decode(codes: np.ndarray, table: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    for i in range(codes.size):
        out[i] = table[codes[i]]


@_jit
def block4_encode(x: np.ndarray, block: int, is_fp4: bool, scales: np.ndarray, packed: np.ndarray) -> float:  # pragma: no cover
    """4-bit codes, two per byte (low nibble first), with one fp32 scale per block.

    int4: uniform, scale = max|x| / 7, code = round(x / scale) + 8 in 1..15.
    fp4 (E3M0): sign bit + 3-bit exponent e, value = sign * scale * 2^(e-7) for e >= 1, 0 for
    e = 0, scale = max|x|; the nearest of those values is chosen (thresholds at the midpoints).
    Returns the finiteness probe (NaN if any input is not finite).
    """
    n = x.size
    nblocks = scales.size
    probe = 0.0
    codes = np.empty(block + 1, dtype=np.uint8)
    for b in range(nblocks):
        start = b * block
        stop = min(start + block, n)
        m = np.float32(0)
        for i in range(start, stop):
            a = abs(x[i])
            probe += a * 0.0
            if a > m:
                m = a
        scales[b] = m
        length = stop - start
        if m == 0:
            for j in range(length):
                codes[j] = 8 if not is_fp4 else 0
        elif is_fp4:
            # e = how many of the 7 midpoints |v| reaches: 2^-7 (between 0 and 2^-6), then
            # 0.75 * 2^(k-7) for k = 2..7 (between 2^(k-8) and 2^(k-7)); all relative to m
            t1 = m * np.float32(0.0078125)
            t2 = m * np.float32(0.0234375)
            t3 = m * np.float32(0.046875)
            t4 = m * np.float32(0.09375)
            t5 = m * np.float32(0.1875)
            t6 = m * np.float32(0.375)
            t7 = m * np.float32(0.75)
            for j in range(length):
                v = x[start + j]
                a = abs(v)
                e = (
                    np.int64(a >= t1)
                    + np.int64(a >= t2)
                    + np.int64(a >= t3)
                    + np.int64(a >= t4)
                    + np.int64(a >= t5)
                    + np.int64(a >= t6)
                    + np.int64(a >= t7)
                )
                codes[j] = e | (np.int64(v < 0 and e > 0) << 3)
        else:
            inv = np.float32(7) / m
            for j in range(length):
                q = x[start + j] * inv
                codes[j] = np.int64(np.floor(q + np.float32(0.5))) + 8
        if length & 1:
            codes[length] = 0
        base = start // 2
        for j in range(0, length, 2):
            packed[base + j // 2] = np.int64(codes[j]) | (np.int64(codes[j + 1]) << 4)
    return probe


@_jit
def block4_decode(packed: np.ndarray, scales: np.ndarray, block: int, is_fp4: bool, out: np.ndarray) -> None:  # pragma: no cover
    n = out.size
    lut = np.empty(16, dtype=np.float32)
    for b in range(scales.size):
        s = scales[b]
        for c in range(16):
            if is_fp4:
                e = c & 7
                mag = 0.0 if e == 0 else s * 2.0 ** (e - 7)
                lut[c] = -mag if c & 8 else mag
            else:
                lut[c] = (c - 8) * (s / 7.0)
        start = b * block
        stop = min(start + block, n)
        base = start >> 1
        pairs = (stop - start) >> 1
        for j in range(pairs):
            byte = np.int64(packed[base + j])
            out[start + 2 * j] = lut[byte & 15]
            out[start + 2 * j + 1] = lut[byte >> 4]
        if (stop - start) & 1:
            out[stop - 1] = lut[np.int64(packed[base + pairs]) & 15]
