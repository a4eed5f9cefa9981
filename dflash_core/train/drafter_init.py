"""A fresh drafter for a target: shaped like the target's layers, initialised as asked.

`init`: "random" (small normal weights), "target-last" (copies of the target's last layers) or
"target:i,j" (copies of the target's layers i, j); `fc_init` "mean" starts `fc` as the mean of
the concatenated target layers instead of random. Which of these trains fastest is measured,
not assumed: see the README's training section.
"""

from __future__ import annotations

from typing import Any

import torch

from ..drafter import DFlashDrafter, config_for_target, init_weights


def init_from_target(drafter: DFlashDrafter, target_model: Any, layer_ids: list[int]) -> None:
    """Copy attention/MLP/norm weights of the target's layers `layer_ids` into the drafter's
    layers (Llama/Qwen names). q_norm/k_norm stay at 1 when the target has none (Llama)."""
    layers = target_model.model.layers
    if len(layer_ids) != len(drafter.layers):
        raise ValueError(f"{len(layer_ids)} target layers for {len(drafter.layers)} drafter layers")
    for dst, i in zip(drafter.layers, layer_ids, strict=True):
        src = dict(layers[i].named_parameters())
        with torch.no_grad():
            for name, p in dst.named_parameters():
                if name in src:
                    if src[name].shape != p.shape:
                        raise ValueError(f"target layer {i} {name}: shape {tuple(src[name].shape)} != {tuple(p.shape)}")
                    p.copy_(src[name].to(p.dtype))
                elif not name.endswith(("q_norm.weight", "k_norm.weight")):
                    raise ValueError(f"target layer {i} has no {name}")


def build_drafter(target: Any, layer_ids: list[int], *, num_layers: int = 2, block_size: int = 16,
                  mask_token_id: int = 0, init: str = "random", fc_init: str = "random",
                  seed: int = 0) -> DFlashDrafter:
    cfg = config_for_target(target.config, num_layers=num_layers, block_size=block_size,
                            mask_token_id=mask_token_id)
    cfg.target_layer_ids = list(layer_ids)
    drafter = init_weights(DFlashDrafter(cfg), seed=seed)
    if init == "target-last":
        init_from_target(drafter, target.model, list(range(target.num_layers - num_layers, target.num_layers)))
    elif init.startswith("target:"):
        init_from_target(drafter, target.model, [int(x) for x in init.split(":", 1)[1].split(",")])
    elif init != "random":
        raise ValueError(f"unknown init {init!r} (random, target-last or target:i,j)")
    if fc_init == "mean":
        n, h = len(layer_ids), cfg.hidden_size
        with torch.no_grad():
            drafter.fc.weight.copy_(torch.eye(h).repeat(1, n) / n)
    elif fc_init != "random":
        raise ValueError(f"unknown fc init {fc_init!r} (random or mean)")
    return drafter
