"""A fresh drafter for a target: shaped like the target's layers, initialised as asked.

`init`: "random" (small normal weights), "target-last" (copies of the target's last layers)
or "from:DIR" (a warm start from an earlier drafter of the same shape, or a shallower one grown
to the new depth, or one on fewer target layers widened to more (see `widen_fc`): its fp32
`train_state.pt` when DIR is a training run, else its checkpoint).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..dflash2 import dflash2_config, upgrade
from ..drafter import DFlashDrafter, init_weights
from ..drafter_config import V2_FIELDS, config_for_target


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


def warm_start(drafter: DFlashDrafter, folder: Path) -> None:
    """Load an earlier drafter's weights; its shape and target layers must be the new one's,
    except that the new drafter may be deeper (growth, see `grow`)."""
    from ..drafter import load_drafter

    src = load_drafter(folder)
    extra = len(drafter.layers) - len(src.layers)
    depth = {"num_hidden_layers", "layer_types", "max_window_layers"} if extra > 0 else set()
    upgrading = src.config.version == 1 and drafter.config.version == 2
    if upgrading:  # DFlash 1 -> 2: the new parts are the only difference allowed
        depth |= {"architectures", *(f"dflash_config.{k}" for k in V2_FIELDS)}
    src_ctx, new_ctx = list(src.config.target_layer_ids), list(drafter.config.target_layer_ids)
    wider = src_ctx != new_ctx and set(src_ctx) < set(new_ctx)
    if wider:
        depth.add("dflash_config.target_layer_ids")
    # The saved dtype is how the weights were exported, not the drafter's shape.
    have, want = ({k: v for k, v in _flat(c.to_dict()).items() if not k.endswith("dtype") and k not in depth}
                  for c in (src.config, drafter.config))
    if have != want:
        diff = ", ".join(f"{k} {have.get(k)} (want {want.get(k)})" for k in sorted(set(have) | set(want))
                         if have.get(k) != want.get(k))
        raise ValueError(f"--init from:{folder}: a different drafter shape: {diff}")
    state = src.state_dict()
    run_state = folder / "train_state.pt"
    if run_state.is_file():  # fp32 master weights beat the bf16 export
        state = torch.load(run_state, map_location="cpu", weights_only=False)["model"]
    if wider:
        state = dict(state, **{"fc.weight": widen_fc(state["fc.weight"], src_ctx, new_ctx)})
    if upgrading:
        if extra > 0:
            raise ValueError(f"--init from:{folder}: grow a DFlash drafter and make it DFlash 2 in two runs")
        src.load_state_dict(state)
        upgrade(src, drafter)
    elif extra > 0:
        grow(drafter, state, len(src.layers))
    else:
        drafter.load_state_dict(state)


def widen_fc(weight: torch.Tensor, src_layers: list[int], new_layers: list[int]) -> torch.Tensor:
    """`fc` for more target layers than a drafter was trained on: each old layer's columns move
    to that layer's new place and the added layers' columns start at zero, so the wider drafter
    computes exactly what the old one did until training finds a use for the new features."""
    width = weight.shape[1] // len(src_layers)
    out = weight.new_zeros((weight.shape[0], width * len(new_layers)))
    for k, layer in enumerate(src_layers):
        j = new_layers.index(layer)
        out[:, j * width:(j + 1) * width] = weight[:, k * width:(k + 1) * width]
    return out


def grow(drafter: DFlashDrafter, state: dict[str, torch.Tensor], n_src: int) -> None:
    """A deeper drafter from a shallower one's `state` (`n_src` layers), computing exactly what it
    computed: the old layers come first, and each new layer, appended before the final norm, starts
    with zero output projections (attention `o_proj`, MLP `down_proj`), so its residual branches
    add nothing until training moves them. Training then starts exactly where the shallower one stood."""
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    new = {f"layers.{i}." for i in range(n_src, len(drafter.layers))}
    if unexpected or any(not k.startswith(tuple(new)) for k in missing):
        raise ValueError(f"cannot grow from this state: unexpected {unexpected[:3]}, missing {missing[:3]}")
    with torch.no_grad():
        for layer in drafter.layers[n_src:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def build_drafter(target: Any, layer_ids: list[int], *, num_layers: int = 2, block_size: int = 16,
                  mask_token_id: int = 0, init: str = "random", seed: int = 0, version: int = 1) -> DFlashDrafter:
    cfg = config_for_target(target.config, num_layers=num_layers, block_size=block_size,
                            mask_token_id=mask_token_id)
    cfg.target_layer_ids = list(layer_ids)
    if version == 2:
        cfg = dflash2_config(cfg)
    drafter = init_weights(DFlashDrafter(cfg), seed=seed)
    if init == "target-last":
        init_from_target(drafter, target.model, list(range(target.num_layers - num_layers, target.num_layers)))
    elif init.startswith("from:"):
        warm_start(drafter, Path(init.split(":", 1)[1]))
    elif init != "random":
        raise ValueError(f"unknown init {init!r} (random, target-last or from:DIR)")
    return drafter
