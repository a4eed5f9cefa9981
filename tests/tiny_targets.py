"""Tiny random targets of every family DFlash drafters are published for, built from
transformers' own config classes (a few layers, hidden 64): no downloads, seconds on a CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_core.targets import Target
from dflash_core.text_side import muse_glimmer_causal_lm

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
# Three linear-attention (Gated DeltaNet) layers to one full-attention layer, as in Qwen3.5 / Qwen3-Next.
LINEAR = dict(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# Multi-head latent attention (DeepSeek-V3, Kimi-K2.5's text side): the cache holds a 32-wide latent as
# "keys" and the 16-wide rotary key as "values"; routed experts after one dense layer.
MLA = dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=16,
           v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1,
           topk_group=1, first_k_dense_replace=1, bos_token_id=None, eos_token_id=None)

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3": {},
    "qwen3_moe": dict(MOE, decoder_sparse_step=1, mlp_only_layers=[]),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"] * 2),
    "gemma4_text": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2),
    "qwen3_5_text": LINEAR,
    "qwen3_5_moe_text": dict(LINEAR, **MOE, shared_expert_intermediate_size=32),
    "qwen3_next": dict(LINEAR, **MOE, shared_expert_intermediate_size=32),
    "deepseek_v3": MLA,
    # DeepSeek-V3.2's sparse attention keeps the indexer's top 8 keys per query (fewer than a reply's
    # context). 16 indexer heads: with 2-4, a key's ReLU'd score is often exactly 0 on every head, and
    # transformers' own top-k then breaks such ties differently in a pass of one token and of several.
    "deepseek_v32": dict(MLA, index_topk=8, index_head_dim=16, index_n_heads=16),
    # NoPE full attention every 4th layer (the last), sliding layers, a logit multiplier and soft-cap.
    "muse_glimmer_text": dict(sliding_window=8, bos_token_id=None, eos_token_id=None),
}
HYBRID = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
# Families whose rollback is checked at every accepted length with forced drafts: recurrent states,
# and caches of more than one equal-width keys/values pair (MLA's latents, V3.2's indexer keys).
FORCED_ROLLBACK = (*HYBRID, "deepseek_v3", "deepseek_v32", "muse_glimmer_text")


def tiny_model(model_type: str, vocab_size: int, seed: int = 0, **overrides: Any) -> Any:
    cfg = AutoConfig.for_model(model_type, vocab_size=vocab_size, **{**SHAPE, **FAMILIES[model_type], **overrides})
    torch.manual_seed(seed)
    if model_type == "muse_glimmer_text":  # a vision-language model's text side: no Auto class of its own
        model = muse_glimmer_causal_lm()._from_config(cfg, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model = widen(model.eval())
    model.generation_config.eos_token_id = None
    return model


def widen(model: Any, std: float = 0.08, embeddings: bool = False) -> Any:
    """Weight matrices drawn wider than the default init (std 0.02), so greedy choices are far from
    ties: a near-tie that float rounding flips would test the float maths, not the decoding."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and (embeddings or "embed" not in name):
                p.normal_(0.0, std)
    return model


def tiny_target(model_type: str, tokenizer: Any, seed: int = 0, **overrides: Any) -> Target:
    model = tiny_model(model_type, len(tokenizer), seed, **overrides)
    return Target(model=model, tokenizer=tokenizer, name=f"tiny-{model_type}", device=torch.device("cpu"),
                  dtype=torch.float32)


def save_tiny(model_type: str, tokenizer: Any, folder: Path, seed: int = 0) -> Path:
    """A tiny model saved as a hub-style folder (config, safetensors, tokenizer)."""
    tiny_model(model_type, len(tokenizer), seed).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
