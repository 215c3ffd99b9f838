"""The sum across sites over a link matrix: bytes per directed link and time, per exchange shape.

The arithmetic of :mod:`geotrain.comm.collectives` (ring) and :mod:`geotrain.comm.shapes` (tree,
hub) and of the encoded sum (:mod:`geotrain.comm.coded`), without torch, so ``geotrain place`` can
choose an order and a shape from a link matrix and tests can hold the prediction to the bytes a
run counts. Sites are indices into a square matrix of links; ``bw[a][b]`` is the bandwidth in
bit/s of the link from a to b and ``lat[a][b]`` its one-way latency in seconds. Each site pair is
its own link, as in the link emulation (a wide-area path between two datacenters); a site's
ranks share it.

For a vector of ``values`` fp32 values held by every site of ``order`` (sites in exchange order):

- ring: site ``order[i]`` sends every chunk but its own in the reduce-scatter and every chunk but
  its successor's in the all-gather (``tensor_split`` chunks), all to ``order[i+1]``; 2(n-1)
  steps, each as slow as the slowest link of the ring;
- tree: a binary heap over the order; every edge carries the vector up and then down; the time
  is twice the slowest root-to-leaf path;
- hub: the order's first site; every spoke carries the vector up and back; twice the slowest spoke;
- an encoded sum (``codec_bytes``: its payload for n values): every site sends its encoding of
  each other site's chunk, then its encoded chunk sum to every other site (fixed-width codecs), or
  its whole payload to every other site (``gather``: top-k, SparseLoCo); two phases of one hop.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

Matrix = Sequence[Sequence[float]]
SHAPES = ("ring", "tree", "hub")


def split(n: int, parts: int) -> list[int]:
    """Sizes of ``tensor_split(parts)`` of ``n`` values."""
    q, r = divmod(n, parts)
    return [q + 1] * r + [q] * (parts - r)


def _ring_bytes(order: Sequence[int], values: int, carriers: int) -> dict[tuple[int, int], int]:
    n, out = len(order), dict[tuple[int, int], int]()
    for a, b in zip(order, [*order[1:], order[0]], strict=True):
        out[(a, b)] = 0
    for shard in split(values, carriers):
        c = split(shard, n)
        for i in range(n):
            out[(order[i], order[(i + 1) % n])] += 4 * (2 * shard - c[i] - c[(i + 1) % n])
    return out


def tree_edges(order: Sequence[int]) -> list[tuple[int, int]]:
    """(parent, child) site pairs of the heap over ``order``."""
    return [(order[(k - 1) // 2], order[k]) for k in range(1, len(order))]


def link_bytes(shape: str, order: Sequence[int], values: int, carriers: int = 1) -> dict[tuple[int, int], int]:
    """Bytes each directed link (a, b) carries in one fp32 sum of ``values`` values (cut over
    ``carriers`` ranks per site, each summing its ``tensor_split`` shard in the same shape)."""
    if len(order) < 2 or values == 0:
        return {}
    if shape == "ring":
        return _ring_bytes(order, values, carriers)
    edges = tree_edges(order) if shape == "tree" else [(order[0], s) for s in order[1:]]
    out = {}
    for p, c in edges:
        out[(p, c)] = out[(c, p)] = 4 * values  # every carrier's shard, up and down: the whole vector
    return out


def coded_link_bytes(
    order: Sequence[int], values: int, codec_bytes: Callable[[int], int], gather: bool, carriers: int = 1
) -> dict[tuple[int, int], int]:
    """Bytes each directed link carries in one encoded sum (:func:`geotrain.comm.coded.coded_sum`)."""
    n, out = len(order), dict[tuple[int, int], int]()
    if n < 2:
        return {}
    for shard in split(values, carriers):
        chunks = split(shard, n)
        for i, a in enumerate(order):
            for j, b in enumerate(order):
                if a == b or shard == 0:
                    continue
                if gather:
                    add = codec_bytes(shard)
                else:  # a's encoding of b's chunk, then a's encoded chunk sum back to b
                    add = (codec_bytes(chunks[j]) if chunks[j] else 0) + (codec_bytes(chunks[i]) if chunks[i] else 0)
                out[(a, b)] = out.get((a, b), 0) + add
    return out


def sum_seconds(shape: str, order: Sequence[int], nbytes: float, bw: Matrix, lat: Matrix, codec: bool = False) -> float:
    """Predicted seconds of one sum of a vector of ``nbytes`` (per site) over ``order``
    (``codec``: an encoded sum of ``nbytes`` per payload, whatever ``shape``)."""
    n = len(order)
    if n < 2:
        return 0.0
    if codec:  # two one-hop phases over every pair
        return 2 * max(nbytes * 8 / bw[a][b] + lat[a][b] for a in order for b in order if a != b)
    if shape == "ring":
        hop = max(nbytes / n * 8 / bw[a][b] + lat[a][b] for a, b in zip(order, [*order[1:], order[0]], strict=True))
        return 2 * (n - 1) * hop
    if shape == "hub":
        return 2 * max(nbytes * 8 / bw[order[0]][s] + lat[order[0]][s] for s in order[1:])
    edge = {c: p for p, c in tree_edges(order)}

    def path(s: int) -> float:
        t = 0.0
        while s in edge:
            t, s = t + nbytes * 8 / bw[edge[s]][s] + lat[edge[s]][s], edge[s]
        return t

    return 2 * max(path(s) for s in order)


def best_order(
    shape: str, sites: Sequence[int], nbytes: float, bw: Matrix, lat: Matrix, limit: int = 40_320
) -> tuple[list[int], float]:
    """The order of ``sites`` with the least :func:`sum_seconds` for ``shape``: for a hub, every
    site as the hub; else every order up to ``limit`` (8 sites; rotations and, for a ring,
    reflections are one ring), beyond that a greedy ring that always goes to the fastest free link
    next and a root at the best-connected site."""
    sites = list(sites)
    if len(sites) < 3:
        return sites, sum_seconds(shape, sites, nbytes, bw, lat)
    if shape == "hub":  # only the hub matters: every site as the hub, the others in their given order
        hubs = ([h, *(s for s in sites if s != h)] for h in sites)
        best = min(hubs, key=lambda o: round(sum_seconds("hub", o, nbytes, bw, lat), 12))
        return best, sum_seconds("hub", best, nbytes, bw, lat)
    if math.factorial(len(sites)) <= limit:
        first, rest = sites[0], sites[1:]
        if shape == "ring":  # a ring is the same from any start: fix the first site
            cands = ([first, *p] for p in itertools.permutations(rest))
        else:
            cands = (list(p) for p in itertools.permutations(sites))
        best = min(cands, key=lambda o: (round(sum_seconds(shape, o, nbytes, bw, lat), 12), o))
        return best, sum_seconds(shape, best, nbytes, bw, lat)
    hubby = max(sites, key=lambda s: (min(bw[s][t] for t in sites if t != s), -sites.index(s)))
    order, free = [hubby], [s for s in sites if s != hubby]
    while free:
        nxt = max(free, key=lambda t: (bw[order[-1]][t], -lat[order[-1]][t], -free.index(t)))
        order.append(nxt)
        free.remove(nxt)
    return order, sum_seconds(shape, order, nbytes, bw, lat)


def clusters(sites: Sequence[int], lat: Matrix, factor: float = 4.0) -> list[list[int]]:
    """Sites grouped into regions by latency (single linkage): two sites share a region when a
    chain of links joins them, each under ``factor`` times the smallest latency among the sites'
    links (at least 1 ms). One group when no link is that much faster than the rest."""
    sites = list(sites)
    pairs = [lat[a][b] for a, b in itertools.combinations(sites, 2)]
    if not pairs:
        return [sites]
    cut = factor * max(min(pairs), 1e-3)
    home = {s: s for s in sites}

    def root(s: int) -> int:
        while home[s] != s:
            s = home[s]
        return s

    for a, b in itertools.combinations(sites, 2):
        if lat[a][b] < cut:
            home[root(b)] = root(a)
    groups: dict[int, list[int]] = {}
    for s in sites:
        groups.setdefault(root(s), []).append(s)
    return sorted(groups.values(), key=lambda g: sites.index(g[0]))
