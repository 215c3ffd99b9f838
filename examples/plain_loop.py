"""A plain PyTorch training loop across sites, with geotrain's cross-site sync around it.

Two sites of one worker each, on this machine (every byte stays on 127.0.0.1)::

    torchrun --standalone --nproc-per-node 2 --local-addr 127.0.0.1 examples/plain_loop.py \
        --set 'topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}]' --set sync.H=10

It uses only geotrain's public API (``geotrain.load_config``, ``geotrain.Site``, ``Site.wrap``):
the model, the data, the optimizer and the loop are the user's own. Each rank prints one JSON
line with its losses, the rounds it synced and the hash of the global model it ended on.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

import geotrain

TEXT = b"the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 40


class BigramLM(nn.Module):
    """Predicts the next byte from the current one: the smallest language model there is."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.head = nn.Linear(width, 256)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.embed(x)).reshape(-1, 256), y.reshape(-1))


def batches(rank: int, steps: int, batch: int = 16, block: int = 32) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's own random windows of the text."""
    data = torch.tensor(list(TEXT))
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - block - 1, (batch,), generator=gen)
        window = data[starts[:, None] + torch.arange(block + 1)]
        yield window[:, :-1], window[:, 1:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="geotrain YAML config")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    try:
        cfg = geotrain.load_config(args.config, args.set)
    except geotrain.ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    with geotrain.Site(cfg) as site:
        torch.manual_seed(0)  # the same initial model on every rank
        model = BigramLM().to(site.device)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        with site.wrap(model, inner) as sync:
            for x, y in batches(site.rank, args.steps):
                loss = model(x.to(site.device), y.to(site.device))
                inner.zero_grad()
                loss.backward()
                inner.step()  # averages in the site; every H steps, an outer round across sites
                losses.append(loss.item())
            sync.finish()  # the last round: every site ends on the global model
            result = {
                "rank": site.rank,
                "site": site.site,
                "algorithm": sync.name,
                "first_loss": losses[0],
                "last_loss": losses[-1],
                "rounds": sync.rounds,
                "global_hash": sync.global_hash(),
                "inter_site_bytes": site.stats.inter_bytes,
            }
    # One write of the whole line: the ranks share torchrun's stdout, and print() writes the text
    # and its newline separately (two syscalls when stdout is unbuffered), so lines could interleave.
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
