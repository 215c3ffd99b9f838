"""The fp32 sum across sites in a tree or through one hub (``topology.exchange.shape``); the ring
is :meth:`geotrain.comm.collectives.Collectives._ring_sum` over the same order.

For n sites holding a vector of S bytes each (docs/PLACE.md):

- **tree**: a binary tree over the exchange order in heap layout (site k's children are 2k+1 and
  2k+2, the root the order's first site). Each site adds its children's sums to its own and
  sends the result to its parent; the root then sends the total down the same edges. Every edge
  carries S each way; the critical path is the deepest leaf's path, up and down.
- **hub**: every site sends its vector to the order's first site, which adds them in the order's
  order and sends the sum back. Every spoke carries S each way; two latencies in all.

Either way one site computes the sum and the others receive it: every rank ends bit-identical.
``p2p(sends, recvs)`` is :meth:`Collectives._p2p` on the group (it counts and paces the bytes);
``ranks`` are global ranks in exchange order, ``me`` among them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

P2P = Callable[[list[tuple[int, torch.Tensor, int | None]], list[tuple[int, torch.Tensor]]], None]


def tree_parent(k: int) -> int | None:
    """The heap parent of position ``k`` (None for the root)."""
    return (k - 1) // 2 if k else None


def tree_children(k: int, n: int) -> list[int]:
    """The heap children of position ``k`` among ``n`` positions."""
    return [c for c in (2 * k + 1, 2 * k + 2) if c < n]


def tree_sum(x: torch.Tensor, ranks: list[int], me: int, p2p: P2P) -> None:
    """Sum ``x`` over ``ranks`` in place: up a binary tree over their order, then down."""
    n, k = len(ranks), ranks.index(me)
    if n == 1 or not x.numel():
        return
    kids = [ranks[c] for c in tree_children(k, n)]
    parent = tree_parent(k)
    if kids:
        got = [torch.empty_like(x) for _ in kids]
        p2p([], list(zip(kids, got, strict=True)))
        for g in got:  # children in heap order: the same sum on every run
            x.add_(g)
    if parent is not None:
        p2p([(ranks[parent], x, None)], [])
        p2p([], [(ranks[parent], x)])
    if kids:
        p2p([(c, x, None) for c in kids], [])


def hub_sum(x: torch.Tensor, ranks: list[int], me: int, p2p: P2P) -> None:
    """Sum ``x`` over ``ranks`` in place through ``ranks[0]``, the hub."""
    n, hub = len(ranks), ranks[0]
    if n == 1 or not x.numel():
        return
    if me != hub:
        p2p([(hub, x, None)], [])
        p2p([], [(hub, x)])
        return
    got = [torch.empty_like(x) for _ in ranks[1:]]
    p2p([], list(zip(ranks[1:], got, strict=True)))
    for g in got:  # spokes in exchange order
        x.add_(g)
    p2p([(r, x, None) for r in ranks[1:]], [])
