"""Decoder-only transformer arithmetic (Kaplan et al. 2020, Table 1; Narayanan et al. 2021).

- parameters: ``12 L h^2`` in the blocks (attention 4h^2, MLP 8h^2 with a 4h hidden layer; biases
  and norms ignored) plus the ``V h`` token embedding (tied output);
- forward FLOPs of one layer over a sequence of ``s`` tokens: ``24 s h^2`` for the matrix
  multiplies plus ``4 s^2 h`` for attention scores and their weighted sum (Narayanan et al.
  2021, eq. 3 per layer);
- forward FLOPs per token of the whole model: ``2 N + 4 L s h`` (the ``2N`` rule plus attention);
  training is 3x forward (backward = 2x forward, as the founding paper assumes).
"""

from __future__ import annotations

from typing import Any


def architecture(layers: int, hidden: int, heads: int, vocab: int, seq_len: int) -> dict[str, Any]:
    notes = []
    if hidden % heads:  # the paper's 100T (192,000 / 280) and 50T (132,000 / 280) models are like this
        notes.append(f"hidden {hidden} is not divisible by heads {heads} (head size {hidden / heads:.1f}); counts are unaffected")
    block_params = 12 * hidden * hidden
    params = layers * block_params + vocab * hidden
    layer_fwd = 24 * seq_len * hidden * hidden + 4 * seq_len * seq_len * hidden
    return {
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "vocab": vocab,
        "seq_len": seq_len,
        "params": params,
        "params_per_layer": block_params,
        "layer_forward_flops": layer_fwd,
        "model_forward_flops_per_sequence": layers * layer_fwd,
        "forward_flops_per_token": 2 * params + 4 * layers * seq_len * hidden,
        "training_flops_per_token": 3 * (2 * params + 4 * layers * seq_len * hidden),
        "notes": notes,
    }
