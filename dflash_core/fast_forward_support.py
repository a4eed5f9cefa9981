"""Which targets the fast forward (fast_forward.py) can run, and in words why not when it cannot."""

from __future__ import annotations

from typing import Any

import torch

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3")
# Rope variants whose cos/sin depend on the sequence seen so far, not just the position.
POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")


def unsupported_reason(model: Any) -> str | None:
    """Why `model` cannot take the fast forward (None when it can)."""
    reason = config_unsupported_reason(model.config)
    if reason is not None:
        return reason
    devices = set((getattr(model, "hf_device_map", None) or {}).values())
    if len(devices) > 1:
        return "the model is spread over several devices"
    inner = getattr(model, "model", None)
    for layer in getattr(inner, "layers", [None]):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = [(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        names += [(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        # Only plain float Linear layers: quantized, LoRA-wrapped or otherwise patched projections
        # compute something the fast forward would not.
        if not all(_plain_linear(getattr(owner, n, None)) for owner, n in names):
            return "projections that are not plain float nn.Linear layers (quantized or wrapped?)"
    if not _plain_linear(getattr(model, "lm_head", None)):
        return "an LM head that is not a plain float nn.Linear"
    return None


def config_unsupported_reason(cfg: Any) -> str | None:
    """What in a model's config alone rules the fast forward out (None: nothing), known before
    the weights are loaded."""
    kind = getattr(cfg, "model_type", None)
    if getattr(cfg, "kv_lora_rank", None):  # DeepSeek-V3/V3.2, Kimi-K2.5
        return (f"model type {kind!r} has multi-head latent attention (MLA: a compressed latent cached per "
                "token, keys and values expanded from it), which the fast forward does not implement")
    if kind not in SUPPORTED_TYPES:
        return f"model type {kind!r} (the fast forward covers {', '.join(SUPPORTED_TYPES)})"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if getattr(cfg, "use_sliding_window", False) or any(
        t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])
    ):
        return "sliding-window attention layers"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type in POSITION_DEPENDENT_ROPE:
        return f"rope type {rope_type!r}"
    if getattr(cfg, "quantization_config", None) is not None:
        return "a quantized model"
    return None


def _plain_linear(module: Any) -> bool:
    return type(module) is torch.nn.Linear and module.weight.is_floating_point()
