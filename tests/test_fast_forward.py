"""The lean forward (fast_forward.py) computes what transformers' forward computes.

Tiny random Llama / Qwen2 / Qwen3 models cover the architecture variants (attention bias, per-head
query/key norms, an explicit head_dim, grouped KV heads); the real embedded target covers the
shipped default, down to greedy decoding through the engine.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dflash_core import Engine, GenerationConfig
from dflash_core.fast_forward import PACK_BATCH_HINT, FastForward, Linear, mkl_packing_works, unsupported_reason
from dflash_core.targets import Target
from tests.conftest import finish

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def tiny(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**COMMON))
    elif kind == "qwen3":  # head_dim 24 is not hidden / heads (16), as in real Qwen3 configs
        model = Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=24))
    else:
        raise AssertionError(kind)
    with torch.no_grad():  # biases and norm scales away from their init, so each one matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def wrap(model: torch.nn.Module, fast: bool) -> Target:
    return Target(model=model, tokenizer=None, name="tiny", device=torch.device("cpu"),
                  dtype=torch.float32, fast=fast)


def passes(target: Target, layers: list[int]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Prefill, one token, a block of 4 after it, then a rollback and a different block of 3."""
    gen = torch.Generator().manual_seed(1)
    cache = target.new_cache(64)
    out = [target.forward(torch.randint(0, 97, (1, 9), generator=gen), cache, layers)]
    out.append(target.forward(torch.randint(0, 97, (1, 1), generator=gen), cache, layers))
    out.append(target.forward(torch.randint(0, 97, (1, 4), generator=gen), cache, layers))
    cache.truncate(11)
    out.append(target.forward(torch.randint(0, 97, (1, 3), generator=gen), cache, layers))
    out.append(target.forward(torch.randint(0, 97, (1, 2), generator=gen), cache, None, last_only=True))
    assert cache.length == 16
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("pack", [False, True])
def test_tiny_models_match_transformers(kind: str, pack: bool) -> None:
    if pack and not mkl_packing_works():
        pytest.skip("no MKL packed GEMM on this machine")
    model = tiny(kind)
    assert unsupported_reason(model) is None
    ref = wrap(model, fast=False)
    lean = wrap(model, fast=False)
    lean.fast_path = FastForward(model, pack=pack)  # force the packing choice under test
    assert ref.fast_path is None and lean.fast_path.packed is pack
    layers = [0, 2]  # the last layer too: transformers reports it after the final norm
    for (a, fa), (b, fb) in zip(passes(ref, layers), passes(lean, layers), strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        if fa is None:
            assert fb is None
        else:
            torch.testing.assert_close(fb, fa, rtol=1e-4, atol=1e-4)


def test_packed_linear_matches_f_linear_for_every_row_count() -> None:
    if not mkl_packing_works():
        pytest.skip("no MKL packed GEMM on this machine")
    torch.manual_seed(0)
    w, b = torch.randn(300, 128), torch.randn(300)
    packed = Linear(w, b, torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_BATCH_HINT))
    for m in [1, 2, 3, 5, 8, 15, 16, 17, 64]:
        x = torch.randn(m, 128)
        torch.testing.assert_close(packed(x), F.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_unsupported_models_fall_back_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=32))
    assert "gpt2" in unsupported_reason(gpt2)
    t = wrap(gpt2, fast=True)
    assert t.fast_path is None and "gpt2" in t.fast_path_note
    with pytest.raises(ValueError, match="no lean forward"):
        FastForward(gpt2)

    torch.manual_seed(0)
    sliding = Qwen2ForCausalLM(Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8,
                                           max_window_layers=0))
    assert "sliding" in unsupported_reason(sliding)
    dynamic = LlamaForCausalLM(LlamaConfig(**COMMON, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                      "rope_theta": 10000.0}))
    assert "dynamic" in unsupported_reason(dynamic)

    llama = tiny("llama")
    monkeypatch.setenv("DFLASH_FAST_TARGET", "0")
    assert wrap(llama, fast=None).fast_path is None
    monkeypatch.setenv("DFLASH_FAST_TARGET", "1")
    assert wrap(llama, fast=None).fast_path is not None
    monkeypatch.delenv("DFLASH_FAST_TARGET")
    assert wrap(llama, fast=None).fast_path is not None  # the default on a CPU
    assert wrap(llama, fast=False).fast_path is None


def test_embedded_target_takes_the_lean_path_and_decodes_the_same(target: Target) -> None:
    """Greedy plain decoding through the engine gives the same tokens with either forward."""
    assert target.fast_path is not None, target.fast_path_note
    hf = Target(model=target.model, tokenizer=target.tokenizer, name=target.name, device=target.device,
                dtype=target.dtype, fast=False)
    prompts = ["Write a Python function that reverses a list.",
               "Tom has 3 apples and buys 5 more. How many apples does he have?",
               "Name three colours of the rainbow."]
    cfg = GenerationConfig(max_new_tokens=40, temperature=0.0)
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt}]
        ids = torch.tensor([target.encode_chat(messages)])
        a, _ = hf.forward(ids, hf.new_cache(ids.shape[1]), [1, 27])
        b, _ = target.forward(ids, target.new_cache(ids.shape[1]), [1, 27])
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        lean_out = finish(Engine(target, None).generate(messages, cfg, plain=True)).token_ids
        hf_out = finish(Engine(hf, None).generate(messages, cfg, plain=True)).token_ids
        assert len(lean_out) >= 10
        assert lean_out == hf_out, prompt
