"""The newer z-lab drafter checkpoints (Qwen3.5 / Qwen3.6 / Qwen3-Coder-Next): sliding-window
layers, scaled RoPE, the draft window, and a reply token equal to the mask token.

What the published configs hold and how z-lab's reference applies them (z-lab/dflash
`dflash/model.py`, vLLM `qwen3_dflash.py`, SGLang `dflash.py`): `layer_types` per drafter layer;
a `sliding_attention` layer's query at position q sees keys k (context and block alike) with
q - k < sliding_window and, unless the config sets `is_causal`, only up to its own position
inside the block; `full_attention` layers see everything, the whole block both ways.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import finish
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from dflash_core.__main__ import build_parser, main
from dflash_core.config import GenerationConfig
from dflash_core.drafter import DFlashDrafter, init_weights, load_drafter
from dflash_core.drafter_config import DFlashConfig
from dflash_core.engine import Engine
from dflash_core.errors import DFlashError
from dflash_core.layers import apply_rope, rope_cos_sin, rope_frequencies
from dflash_core.targets import Target

S, F = "sliding_attention", "full_attention"

# z-lab/Qwen3.6-27B-DFlash's config.json, as published (transformers 5 layout), trimmed of
# fields nothing reads.
ZLAB_QWEN36_27B: dict[str, Any] = {
    "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "model_type": "qwen3", "dtype": "bfloat16", "block_size": 16,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
    "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 5, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 248320, "num_target_layers": 64,
    "rms_norm_eps": 1e-06, "max_position_embeddings": 262144, "max_window_layers": 5,
    "layer_types": [S, S, S, S, F], "sliding_window": 2048, "use_sliding_window": True,
    "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"}, "tie_word_embeddings": False,
}
# z-lab/Qwen3.5-122B-A10B-DFlash: block_size only inside dflash_config, more target layers than
# drafter layers, a 4096 window.
ZLAB_QWEN35_122B: dict[str, Any] = {
    **ZLAB_QWEN36_27B, "hidden_size": 3072, "intermediate_size": 9216, "num_hidden_layers": 6,
    "num_target_layers": 48, "max_window_layers": 6, "layer_types": [S] * 5 + [F], "sliding_window": 4096,
    "dflash_config": {"block_size": 16, "mask_token_id": 248077, "target_layer_ids": [1, 7, 14, 20, 26, 32, 39, 45]},
}
del ZLAB_QWEN35_122B["block_size"]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "beta_fast": 32, "beta_slow": 1}


def modelled(cfg: DFlashConfig) -> dict[str, Any]:
    """The fields a config models (`extra` gains the defaults to_dict writes)."""
    return {f: getattr(cfg, f) for f in DFlashConfig.__dataclass_fields__ if f != "extra"}


def test_published_configs_parse_and_round_trip() -> None:
    for raw, block, ids, window in ((ZLAB_QWEN36_27B, 16, 5, 2048), (ZLAB_QWEN35_122B, 16, 8, 4096)):
        cfg = DFlashConfig.from_dict(raw)
        n = cfg.num_hidden_layers
        assert (cfg.block_size, len(cfg.target_layer_ids), cfg.sliding_window) == (block, ids, window)
        assert cfg.rope_theta == 1e7 and cfg.rope_scaling is None
        assert [cfg.layer_window(i) for i in range(n)] == [window] * (n - 1) + [None]
        assert [cfg.layer_causal(i) for i in range(n)] == [True] * (n - 1) + [False]  # sliding: causal
        saved = cfg.to_dict()
        back = DFlashConfig.from_dict(saved)
        assert modelled(back) == modelled(cfg) and back.to_dict() == saved
        # z-lab's names, as transformers (which the reference and vLLM read through) understands them.
        assert saved["layer_types"] == raw["layer_types"] and saved["use_sliding_window"] is True
        hf = Qwen3Config(**saved)
        assert (hf.layer_types, hf.sliding_window) == (raw["layer_types"], window)
        assert saved["dflash_config"]["target_layer_ids"] == raw["dflash_config"]["target_layer_ids"]
    assert DFlashConfig.from_dict(ZLAB_QWEN35_122B).to_dict()["dflash_config"]["block_size"] == 16
    with torch.device("meta"):
        assert DFlashDrafter(DFlashConfig.from_dict(ZLAB_QWEN35_122B)).fc.weight.shape == (3072, 8 * 3072)


def test_explicit_causality_and_derived_layer_types() -> None:
    cfg = DFlashConfig.from_dict({**ZLAB_QWEN36_27B, "is_causal": False})  # DFlash2-style: bidirectional
    assert [cfg.layer_causal(i) for i in range(5)] == [False] * 5 and cfg.layer_window(0) == 2048
    assert cfg.to_dict()["is_causal"] is False and cfg.to_dict()["dflash_config"]["causal"] is False
    vllm = copy.deepcopy(ZLAB_QWEN36_27B)
    vllm["dflash_config"]["causal"] = True  # vLLM's override
    assert all(DFlashConfig.from_dict(vllm).layer_causal(i) for i in range(5))
    # No layer_types: transformers' Qwen3Config derives them from use_sliding_window / max_window_layers.
    raw = {k: v for k, v in ZLAB_QWEN36_27B.items() if k != "layer_types"}
    assert DFlashConfig.from_dict({**raw, "max_window_layers": 2}).layer_types == [F, F, S, S, S]
    assert DFlashConfig.from_dict({**raw, "use_sliding_window": False}).layer_types == [F] * 5
    assert Qwen3Config(**{**raw, "max_window_layers": 2}).layer_types == [F, F, S, S, S]


@pytest.mark.parametrize(("changes", "message"), [
    ({"layer_types": [S, "chunked_attention", S, S, F]}, r"'chunked_attention'.* not supported"),
    ({"layer_types": [S, F]}, r"layer_types has 2 entries for 5 layers"),
    ({"sliding_window": None}, r"sliding_attention layers need a positive integer sliding_window"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}}, r"RoPE scaling 'llama3'"),
    ({"rope_scaling": {"type": "linear"}}, r"'linear' needs a positive factor"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": -2}}, r"'yarn' needs a positive factor"),
    ({"partial_rotary_factor": 0.5}, r"partial rotary"),
    ({"is_causal": "yes"}, r"is_causal must be true or false"),
])
def test_unsupported_configs_are_named(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(DFlashError, match=message):
        DFlashConfig.from_dict({**ZLAB_QWEN36_27B, **changes})


# ----- RoPE: the same numbers transformers computes -----


@pytest.mark.parametrize("rope", [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 2.5},
    YARN,
    {"rope_type": "yarn", "factor": 8, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2,
     "truncate": False},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "attention_factor": 0.8},
    {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256, "mscale": 0.707,
     "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "factor": 2.0},  # original_max_position_embeddings: max_position_embeddings
], ids=["default", "linear", "yarn", "yarn-betas", "yarn-attention-factor", "yarn-mscale", "yarn-no-original"])
def test_rope_matches_transformers(rope: dict[str, Any]) -> None:
    theta, head_dim, max_pos = 50_000.0, 64, 512
    raw = {**ZLAB_QWEN36_27B, "head_dim": head_dim, "max_position_embeddings": max_pos,
           "rope_parameters": {**rope, "rope_theta": theta}}
    cfg = DFlashConfig.from_dict(raw)
    hf = Qwen3Config(**cfg.to_dict())  # what our saved config.json means to transformers
    kind = rope["rope_type"]
    inv, factor = rope_frequencies(head_dim, theta, cfg.rope_scaling, max_pos)
    if kind == "default":
        want_inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        want_factor = 1.0
    else:
        want_inv, want_factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    assert torch.equal(inv, want_inv)
    assert factor == pytest.approx(want_factor, rel=1e-12)
    assert (factor != 1.0) == (kind == "yarn")
    positions = torch.tensor([0, 1, 7, 100, 511, 4000])
    cos, sin = rope_cos_sin(positions, head_dim, theta, torch.float32, cfg.rope_scaling, max_pos)
    want_cos, want_sin = Qwen3RotaryEmbedding(hf)(torch.zeros(1, 1, dtype=torch.float32), positions[None])
    assert torch.allclose(cos, want_cos[0], atol=1e-6) and torch.allclose(sin, want_sin[0], atol=1e-6)


# ----- what a drafter layer attends to -----


def tiny_config(**changes: Any) -> DFlashConfig:
    raw = {**ZLAB_QWEN36_27B, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100,
           "num_target_layers": 8, "layer_types": [S, F, S], "sliding_window": 6,
           "rope_parameters": {**YARN, "rope_theta": 10_000.0, "original_max_position_embeddings": 16},
           "dflash_config": {"block_size": 4, "mask_token_id": 99, "target_layer_ids": [1, 6]}}
    return DFlashConfig.from_dict({**raw, **changes})


def reference_block(drafter: DFlashDrafter, context: torch.Tensor, block: torch.Tensor,
                    draft_window: int | None = None) -> torch.Tensor:
    """A block's hidden states the plain way: every layer attends over [all context ; block] under
    z-lab's rule on absolute positions (the reference's `_attention_mask`); a draft window drops
    the context older than the last N positions."""
    cfg, n, b = drafter.config, context.shape[0], block.shape[0]
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ctx = drafter.hidden_norm(drafter.fc(context))
    cos, sin = drafter._rope(torch.arange(n + b), torch.float32)
    q_pos, k_pos = torch.arange(n, n + b)[:, None], torch.arange(n + b)[None, :]
    h = block
    for i, layer in enumerate(drafter.layers):
        a = layer.self_attn
        sliding = cfg.layer_types[i] == S
        causal = sliding if cfg.is_causal is None else cfg.is_causal
        seen = torch.ones(b, n + b, dtype=torch.bool)
        if causal:
            seen &= k_pos <= q_pos
        if sliding:
            seen &= q_pos - k_pos < cfg.sliding_window
            if not causal:
                seen &= k_pos - q_pos < cfg.sliding_window
        if draft_window is not None:
            seen &= k_pos >= n - draft_window
        x = layer.input_layernorm(h)
        rows = torch.cat([ctx, x])
        q = apply_rope(a.q_norm(a.q_proj(x).view(b, nh, hd)).transpose(0, 1), cos[n:], sin[n:])
        k = apply_rope(a.k_norm(a.k_proj(rows).view(-1, nkv, hd)).transpose(0, 1), cos, sin)
        v = a.v_proj(rows).view(-1, nkv, hd).transpose(0, 1)
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        scores = (q @ k.transpose(1, 2) / math.sqrt(hd)).masked_fill(~seen, float("-inf"))
        out = torch.softmax(scores, -1) @ v
        h = h + a.o_proj(out.transpose(0, 1).reshape(b, nh * hd))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h)


@pytest.mark.parametrize(("changes", "window"), [({}, None), ({}, 9), ({"is_causal": False}, None),
                                                  ({"layer_types": [F, F, F]}, 5)],
                         ids=["sliding", "sliding+draft-window", "sliding-bidirectional", "full+draft-window"])
def test_step_attends_like_the_reference(changes: dict[str, Any], window: int | None) -> None:
    drafter = init_weights(DFlashDrafter(tiny_config(**changes)), std=0.1, seed=4).eval()
    drafter.draft_window = window
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(30, 2 * 64, generator=g)
    cache = drafter.new_cache(64)
    seen = 0
    for start in (20, 23, 23, 30):  # new context, more of it, a second denoising step, more again
        block = torch.randn(1, 4, 64, generator=g)
        out = drafter.step(block, start, cache, feats[None, seen:start] if start > seen else None)[0]
        seen = start
        want = reference_block(drafter, feats[:start], block[0], window)
        assert torch.allclose(out, want, atol=1e-5), float((out - want).abs().max())
    if window is not None:  # the window matters: without it the drafts differ
        drafter.draft_window = None
        assert not torch.allclose(drafter.step(block, 30, drafter.new_cache(64), feats[None, :30])[0], want, atol=1e-3)


def test_a_draft_window_bounds_the_drafters_memory_and_reads_the_same_keys() -> None:
    """A long conversation through a window of 9 positions: the buffer stays at the window plus a
    few blocks' room (its positions slide to the front as it fills), and every block's hidden
    states equal the reference's over the whole context."""
    drafter = init_weights(DFlashDrafter(tiny_config(layer_types=[F, S, F])), std=0.1, seed=6).eval()
    drafter.draft_window = 9
    g = torch.Generator().manual_seed(2)
    n = 600
    feats = torch.randn(n, 2 * 64, generator=g)
    cache = drafter.new_cache(n + 8)
    assert cache.max_len < 200  # not the conversation's 608 positions
    seen, start, slid = 0, 40, 0
    while start + 4 < n:
        block = torch.randn(1, 4, 64, generator=g)
        offset = cache.offset
        out = drafter.step(block, start, cache, feats[None, seen:start] if start > seen else None)[0]
        slid += cache.offset != offset
        want = reference_block(drafter, feats[:start], block[0], 9)
        assert torch.allclose(out, want, atol=1e-5), (start, float((out - want).abs().max()))
        seen, start = start, start + 1 + (start % 5)  # 1..5 tokens committed per block
    assert slid >= 3
    drafter.draft_window = 500  # wider than what the cache kept: refused, not read from dropped rows
    with pytest.raises(RuntimeError, match="cannot widen"):
        drafter.step(block, start, cache, feats[None, seen:start])


def test_training_pass_attends_like_the_reference() -> None:
    drafter = init_weights(DFlashDrafter(tiny_config()), std=0.1, seed=5).eval()
    g = torch.Generator().manual_seed(1)
    T, bs, anchors = 16, 4, [3, 11]
    feats, blocks = torch.randn(1, T, 2 * 64, generator=g), torch.randn(1, 2 * bs, 64, generator=g)
    positions = torch.cat([torch.arange(a, a + bs) for a in anchors])
    mask = torch.zeros(1, 1, 2 * bs, T + 2 * bs, dtype=torch.bool)
    for i, a in enumerate(anchors):  # the context before the anchor and the block itself
        mask[0, 0, i * bs:(i + 1) * bs, :a] = True
        mask[0, 0, i * bs:(i + 1) * bs, T + i * bs:T + (i + 1) * bs] = True
    with torch.no_grad():
        out = drafter.forward_train(feats, blocks, positions, mask)[0]
        for i, a in enumerate(anchors):
            want = reference_block(drafter, feats[0, :a], blocks[0, i * bs:(i + 1) * bs])
            assert torch.allclose(out[i * bs:(i + 1) * bs], want, atol=1e-5)


def test_draft_window_values() -> None:
    drafter = DFlashDrafter(tiny_config())
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(DFlashError, match="draft window must be a positive number"):
            drafter.draft_window = bad
    drafter.draft_window = 1
    assert copy.deepcopy(drafter).draft_window == 1


def test_draft_window_flag(capsys: pytest.CaptureFixture[str]) -> None:
    sub = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for name in ("generate", "bench"):
        help_text = " ".join(sub[name].format_help().split())
        assert "--draft-window N" in help_text and "(default: all of them)" in help_text
    rc = main(["generate", "--prompt", "hi", "--draft-window", "0", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: draft window must be a positive number") and err.count("\n") == 1


# ----- the real target: round trip and lossless decoding -----


def zlab_for(target: Target, **changes: Any) -> dict[str, Any]:
    """A z-lab-format config.json for a 3-layer drafter of the embedded target: two sliding layers
    with an 8-position window, YaRN, block_size inside dflash_config (as Qwen3.5's)."""
    tc = target.config
    raw = {**ZLAB_QWEN35_122B, "hidden_size": tc.hidden_size, "intermediate_size": 256, "num_hidden_layers": 3,
           "num_attention_heads": tc.num_attention_heads, "num_key_value_heads": tc.num_key_value_heads,
           "head_dim": tc.hidden_size // tc.num_attention_heads, "vocab_size": tc.vocab_size,
           "num_target_layers": tc.num_hidden_layers, "max_position_embeddings": 8192, "max_window_layers": 3,
           "layer_types": [S, S, F], "sliding_window": 8,
           "rope_parameters": {**YARN, "rope_theta": 100_000.0},
           "dflash_config": {"block_size": 16, "mask_token_id": 0, "target_layer_ids": [1, 14, 27]}}
    raw.update(changes)
    return raw


def zlab_drafter(target: Target, mask_token_id: int = 0) -> DFlashDrafter:
    raw = zlab_for(target)
    raw["dflash_config"] = {**raw["dflash_config"], "mask_token_id": mask_token_id}
    return init_weights(DFlashDrafter(DFlashConfig.from_dict(raw)), seed=3).eval()


PROMPTS = ["Write a haiku about the sea.", "List five fruits, one per line.", "What is 17 * 23?"]
MAX_NEW = 12


@pytest.fixture(scope="module")
def plain(target: Target) -> dict[str, list[int]]:
    engine = Engine(target, None)
    return {p: finish(engine.generate(p, GenerationConfig(max_new_tokens=MAX_NEW), plain=True)).token_ids
            for p in PROMPTS}


@pytest.fixture(scope="module")
def loaded(target: Target, tmp_path_factory: pytest.TempPathFactory) -> tuple[DFlashDrafter, DFlashDrafter, Path]:
    drafter = zlab_drafter(target)
    folder = tmp_path_factory.mktemp("zlab")
    drafter.save(folder, dtype=torch.float32)
    return drafter, load_drafter(folder), folder


def test_zlab_drafter_saves_and_loads_back_equal(loaded: tuple[DFlashDrafter, DFlashDrafter, Path]) -> None:
    drafter, back, folder = loaded
    assert modelled(back.config) == modelled(drafter.config)
    assert back.config.layer_types == [S, S, F] and back.config.rope_scaling == YARN
    saved = back.config.to_dict()
    assert {k: v for k, v in saved.items() if k != "dtype"} == {
        k: v for k, v in drafter.config.to_dict().items() if k != "dtype"}
    assert DFlashConfig.from_dict(saved).to_dict() == saved
    for k, v in drafter.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    raw = json.loads((folder / "config.json").read_text())
    assert (raw["layer_types"], raw["sliding_window"], raw["use_sliding_window"]) == ([S, S, F], 8, True)
    assert raw["rope_scaling"] == YARN and raw["rope_theta"] == 100_000.0
    assert raw["dflash_config"] == {"block_size": 16, "mask_token_id": 0, "target_layer_ids": [1, 14, 27]}
    hf = Qwen3Config(**raw)  # transformers reads the same RoPE from it
    cos, _ = Qwen3RotaryEmbedding(hf)(torch.zeros(1, 1), torch.arange(300)[None])
    assert torch.allclose(back._rope(torch.arange(300), torch.float32)[0], cos[0], atol=1e-6)


@pytest.mark.parametrize(("block", "verify", "steps"), [(4, "full", 1), (4, "full", 2), (16, "full", 1),
                                                         (16, "auto", 1)])
def test_zlab_drafter_is_lossless(target: Target, plain: dict[str, list[int]], block: int, verify: str, steps: int,
                                  loaded: tuple[DFlashDrafter, DFlashDrafter, Path]) -> None:
    drafter = loaded[1]
    drafter.draft_window = 12  # shorter than every prompt: the drafter sees only part of the context
    try:
        engine = Engine(target, drafter)
        cfg = GenerationConfig(max_new_tokens=MAX_NEW, block_size=block, verify=verify, steps=steps)
        for prompt in PROMPTS:
            assert len(engine.prompt_ids(prompt)) > 12
            assert finish(engine.generate(prompt, cfg)).token_ids == plain[prompt], prompt
    finally:
        drafter.draft_window = None


def test_reply_token_equal_to_mask_token_survives(target: Target, plain: dict[str, list[int]]) -> None:
    """A drafter's mask token is an ordinary token of the reply: z-lab's first reference loop cut
    every mask-id token out of its output; committed tokens and text here stay plain decoding's."""
    prompt = PROMPTS[1]
    reply = plain[prompt]
    mask = next(t for t in reply[1:] if t not in target.eos_ids)
    engine = Engine(target, zlab_drafter(target, mask_token_id=mask))
    assert engine.drafter is not None and engine.drafter.mask_token_id == mask
    base = finish(Engine(target, None).generate(prompt, GenerationConfig(max_new_tokens=MAX_NEW), plain=True))
    for block in (4, 16):
        fin = finish(engine.generate(prompt, GenerationConfig(max_new_tokens=MAX_NEW, block_size=block)))
        assert fin.token_ids == reply and mask in fin.token_ids
        assert fin.text == base.text
