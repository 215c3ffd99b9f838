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


@_jit
def _kth_largest(a: np.ndarray, k: int) -> np.float32:  # pragma: no cover - compiled
    """The k-th largest value of ``a`` (1-based), by quickselect in place (median-of-three pivots)."""
    lo = 0
    hi = a.size - 1
    target = a.size - k  # its index in ascending order
    while lo < hi:
        mid = (lo + hi) >> 1
        x, y, z = a[lo], a[mid], a[hi]
        pivot = max(min(x, y), min(max(x, y), z))
        i, j = lo, hi
        while i <= j:
            while a[i] < pivot:
                i += 1
            while a[j] > pivot:
                j -= 1
            if i <= j:
                a[i], a[j] = a[j], a[i]
                i += 1
                j -= 1
        if target <= j:
            hi = j
        elif target >= i:
            lo = i
        else:
            return a[target]
    return a[target]


@_jit
def sparse2_encode(
    x: np.ndarray, chunk: int, fraction: float, offset_bits: int, scales: np.ndarray, packed: np.ndarray
) -> float:  # pragma: no cover - compiled
    """SparseLoCo-style: per chunk of ``chunk`` values, the ``ceil(fraction * len)`` largest in
    magnitude (ties: lowest index first), each as a chunk-local offset of ``offset_bits`` bits and a
    2-bit code (sign, and whether its magnitude is at or above the kept values' mean). The chunk's
    two fp32 scales are the mean magnitude of each level (the mean itself for an empty level).
    Entries are bit-packed little-endian, in index order; each chunk starts on a byte.
    Returns the finiteness probe (NaN if any input is not finite).
    """
    n = x.size
    probe = 0.0
    tmp = np.empty(chunk, dtype=np.float32)
    kept = np.empty(chunk, dtype=np.int64)
    cidx = np.empty(chunk, dtype=np.int64)
    width = offset_bits + 2
    pos = 0  # byte where this chunk's entries start
    for base in range(0, n, chunk):
        c = base // chunk
        m = min(chunk, n - base)
        k = min(m, max(1, int(np.ceil(fraction * m))))
        # a lower bound on the threshold from a strided sample (2x oversampled), then one pass
        # that keeps only the candidates above it; the exact k-th largest is selected among them
        cand = np.float32(0.0)
        if m >= 1024:
            stride = m // 256
            for i in range(256):
                tmp[i] = abs(x[base + i * stride])
            cand = _kth_largest(tmp[:256], min(256, 2 * ((k * 256 + m - 1) // m) + 2))
        nb = 0
        for i in range(m):
            v = x[base + i]
            probe += v * 0.0
            a = abs(v)
            if a >= cand:
                cidx[nb] = i
                tmp[nb] = a
                nb += 1
        if probe != probe:
            return probe
        if nb < k:  # the sample overestimated the threshold: select among all values
            for i in range(m):
                cidx[i] = i
                tmp[i] = abs(x[base + i])
            nb = m
        thr = _kth_largest(tmp[:nb], k)
        got = 0
        total = 0.0
        for j in range(nb):  # the candidates are in index order
            a = abs(x[base + cidx[j]])
            if a > thr:
                kept[got] = cidx[j]
                got += 1
                total += a
        if got < k:  # values equal to the threshold fill the rest, lowest index first, in index order
            need = k - got
            got = 0
            total = 0.0
            for j in range(nb):
                a = abs(x[base + cidx[j]])
                if a > thr or (a == thr and need > 0):
                    if not a > thr:
                        need -= 1
                    kept[got] = cidx[j]
                    got += 1
                    total += a
        mean = np.float32(total / k)
        s_lo = 0.0
        s_hi = 0.0
        n_lo = 0
        n_hi = 0
        for j in range(k):
            a = abs(x[base + kept[j]])
            if a >= mean:
                s_hi += a
                n_hi += 1
            else:
                s_lo += a
                n_lo += 1
        scales[2 * c] = s_lo / n_lo if n_lo else mean
        scales[2 * c + 1] = s_hi / n_hi if n_hi else mean
        nbytes = (k * width + 7) >> 3
        for b in range(nbytes):
            packed[pos + b] = 0
        bit = 0
        for j in range(k):
            v = x[base + kept[j]]
            code = (kept[j] << 2) | (2 if v < 0 else 0) | (1 if abs(v) >= mean else 0)
            for t in range(width):
                if (code >> t) & 1:
                    packed[pos + ((bit + t) >> 3)] |= np.uint8(1 << ((bit + t) & 7))
            bit += width
        pos += nbytes
    return probe


@_jit
def sparse2_decode(
    packed: np.ndarray, scales: np.ndarray, chunk: int, fraction: float, offset_bits: int, out: np.ndarray
) -> int:  # pragma: no cover - compiled
    """Inverse of :func:`sparse2_encode`: zeros except the kept entries, each ± its level's scale.
    Returns the number of offsets that fell outside their chunk (left out: a payload no encoder
    makes, since an offset's bits can name positions past a chunk's end)."""
    n = out.size
    bad = 0
    width = offset_bits + 2
    mask = (1 << width) - 1
    for i in range(n):
        out[i] = 0.0
    pos = 0
    end = packed.size
    for base in range(0, n, chunk):
        c = base // chunk
        m = min(chunk, n - base)
        k = min(m, max(1, int(np.ceil(fraction * m))))
        bit = 0
        for _ in range(k):
            at = pos + (bit >> 3)
            window = np.int64(0)
            for b in range(min(5, end - at)):  # width <= 32 bits spans at most 5 bytes
                window |= np.int64(packed[at + b]) << (8 * b)
            code = (window >> (bit & 7)) & mask
            bit += width
            mag = scales[2 * c + (code & 1)]
            if (code >> 2) >= m:
                bad += 1
                continue
            out[base + (code >> 2)] = -mag if code & 2 else mag
        pos += (k * width + 7) >> 3
    return bad
