"""Small control values gathered across ranks as JSON, never as pickles.

torch's object collectives (``all_gather_object`` and friends) pickle what a rank sends and
unpickle it on every other: a peer that sends a crafted pickle runs code in every rank that
receives it. On groups that cross sites (the world group of a plain run spans organisations),
geotrain gathers its control values (end-of-run records, start hashes, checkpoint hashes and
verdicts) with :func:`all_gather_json` instead: each rank's value as UTF-8 JSON in a byte tensor,
padded to the longest, decoded with the standard ``json`` module, which builds only dicts,
lists, strings, numbers, booleans and None. A value that is too big or not JSON is refused on
the receiving rank, naming the sender.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

MAX_BYTES = 16 << 20  # one rank's value; control values are a few KB


def all_gather_json(value: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's ``value`` (anything ``json`` writes), in the group's rank order, on every rank.

    Collective over ``group`` (its tensors on this rank's GPU when the group is NCCL's).

    Raises:
        ValueError: a rank's value is larger than :data:`MAX_BYTES` or not JSON (names the rank).
    """
    data = json.dumps(value, separators=(",", ":")).encode()
    if len(data) > MAX_BYTES:
        raise ValueError(f"a control value of {len(data)} bytes, more than {MAX_BYTES}")
    n = dist.get_world_size(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=dev), group=group)
    lengths = [int(s.item()) for s in sizes]
    bad = [r for r, size in enumerate(lengths) if not 0 < size <= MAX_BYTES]
    if bad:
        raise ValueError(f"rank {bad[0]} of the group sent a control value of {lengths[bad[0]]} bytes (1..{MAX_BYTES})")
    longest = max(lengths)
    mine = torch.zeros(longest, dtype=torch.uint8, device=dev)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    parts = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(n)]
    dist.all_gather(parts, mine, group=group)
    out = []
    for r, (part, size) in enumerate(zip(parts, lengths, strict=True)):
        try:
            out.append(json.loads(part[:size].cpu().numpy().tobytes()))
        except ValueError:  # json.JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"rank {r} of the group sent a control value that is not JSON") from None
    return out
