"""The fast forward (fast_forward.py) computes what transformers' forward computes.

Tiny random Llama / Qwen2 / Qwen3 models cover the architecture variants (attention bias, per-head
query/key norms, an explicit head_dim, grouped KV heads); the real embedded target covers the
shipped default, down to greedy decoding through the engine.
"""

from __future__ import annotations

import copy

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

from dflash_core import Engine, GenerationConfig, batch_invariant, cpu_kernels, packing
from dflash_core.fast_forward import FastForward
from dflash_core.fast_forward_support import unsupported_reason
from dflash_core.packing import (
    PACK_BATCH_HINT,
    Linear,
    PackingLinear,
    mkl_packing_works,
    onednn_fp32_works,
    pack_weight,
)
from dflash_core.targets import Target
from tests.conftest import finish


def packing_works() -> bool:
    """fp32 weights get laid out once here: for the compiled float32 kernel, oneDNN, or MKL."""
    return cpu_kernels.f32_kernel() is not None or onednn_fp32_works() or mkl_packing_works()

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
KINDS = ["llama", "llama-mha-yarn", "llama3-mqa", "qwen2", "qwen3"]


def tiny(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True))
    elif kind == "llama-mha-yarn":  # yarn is the rope variant whose attention scaling is not 1
        rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
        model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_key_value_heads": 4}, rope_parameters=rope))
    elif kind == "llama3-mqa":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 10000.0}
        model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_key_value_heads": 1}, rope_parameters=rope))
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


def fast_target(model: torch.nn.Module, pack: bool) -> Target:
    t = wrap(model, fast=False)
    t.fast_forward = FastForward(model, pack=pack)  # force the packing choice under test
    assert t.fast_forward.packed is pack
    return t


def passes(target: Target, layers: list[int], prefill: int = 9,
           other: Target | None = None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Prefill, one token, a block of 4 after it, then a rollback, a block of 3 and a last-only
    pass. With `other`, every second pass runs through `other` on the same cache."""
    gen = torch.Generator().manual_seed(1)
    cache = target.new_cache(prefill + 16)
    sizes = [prefill, 1, 4]
    out = []
    for k, n in enumerate(sizes):
        runner = other if other is not None and k % 2 else target
        out.append(runner.forward(torch.randint(0, 97, (1, n), generator=gen), cache, layers))
    cache.truncate(prefill + 2)
    out.append(target.forward(torch.randint(0, 97, (1, 3), generator=gen), cache, layers))
    runner = other if other is not None else target
    out.append(runner.forward(torch.randint(0, 97, (1, 2), generator=gen), cache, layers, last_only=True))
    assert cache.length == prefill + 7 and out[-1][0].shape[0] == 1
    return out


def assert_same(ref: list, got: list) -> None:
    for (a, fa), (b, fb) in zip(ref, got, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        if fa is None:
            assert fb is None
        else:
            torch.testing.assert_close(fb, fa, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pack", [False, True])
def test_tiny_models_match_transformers(kind: str, pack: bool) -> None:
    if pack and not packing_works():
        pytest.skip("no packed fp32 GEMM on this machine")
    model = tiny(kind)
    assert unsupported_reason(model) is None
    ref = wrap(model, fast=False)
    assert ref.fast_forward is None
    layers = [0, 2]  # the last layer too: transformers reports it after the final norm
    assert_same(passes(ref, layers), passes(fast_target(model, pack), layers))


@pytest.mark.parametrize("kind", ["llama-mha-yarn", "qwen3"])
def test_long_context_and_mixed_paths_on_one_cache(kind: str) -> None:
    """A 300-token prefill (the RoPE table grows past its first 256 rows; the packed GEMM runs
    with many rows), and the fast and transformers forwards taking turns on one cache."""
    model = tiny(kind)
    ref = wrap(model, fast=False)
    fast = fast_target(model, pack=packing_works())
    assert_same(passes(ref, [1], prefill=300), passes(fast, [1], prefill=300))
    assert_same(passes(ref, [1], prefill=300), passes(fast, [1], prefill=300, other=ref))


def test_bf16_target_stays_close_to_transformers_bf16() -> None:
    model = tiny("qwen3").to(torch.bfloat16)
    ref = Target(model=model, tokenizer=None, name="tiny", device=torch.device("cpu"), dtype=torch.bfloat16,
                 fast=False)
    fast = Target(model=model, tokenizer=None, name="tiny", device=torch.device("cpu"), dtype=torch.bfloat16,
                  fast=True)
    assert fast.fast_forward is not None and not fast.fast_forward.packed  # packing is fp32 only
    for (a, _), (b, _) in zip(passes(ref, [1]), passes(fast, [1]), strict=True):
        torch.testing.assert_close(b, a, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("library", ["MKL", "oneDNN"])
def test_packed_linear_matches_f_linear_for_every_row_count(library: str) -> None:
    if not (mkl_packing_works() if library == "MKL" else onednn_fp32_works()):
        pytest.skip(f"no packed {library} GEMM on this machine")
    torch.manual_seed(0)
    w, b = torch.randn(300, 128), torch.randn(300)
    layout = (torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_BATCH_HINT) if library == "MKL"
              else batch_invariant.onednn_weight(w))
    packed = Linear(w, b, layout)
    for m in [1, 2, 3, 5, 8, 15, 16, 17, 64]:
        x = torch.randn(m, 128)
        torch.testing.assert_close(packed(x), F.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_onednn_fp32_gives_a_row_the_same_bits_in_any_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where oneDNN's fp32 GEMM is chosen, a token's row does not depend on how many rows share
    the pass (verify blocks against plain steps); where oneDNN's check fails, MKL packs instead."""
    if not onednn_fp32_works():
        pytest.skip("oneDNN's fp32 GEMM is not used on this machine")
    monkeypatch.setattr(packing, "f32_layout", lambda weight: None)  # where the compiled kernel builds, it comes first
    torch.manual_seed(1)
    w, b = torch.randn(576, 1536), torch.randn(576)  # SmolLM2's down projection
    lin = Linear(w, b, pack_weight(w))
    assert lin.packed is not None and lin.packed.shape == w.shape  # oneDNN's layout
    x = torch.randn(32, 1536)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(32)])
    for m in (2, 4, 5, 16, 31, 32):
        assert torch.equal(lin(x[:m]), alone[:m]), m
    monkeypatch.setattr(packing, "onednn_fp32_works", lambda: False)
    other = pack_weight(w)
    assert other is None or other.shape != w.shape  # MKL's packed buffer, where MKL packs
    assert (other is not None) == mkl_packing_works()


def test_unsupported_models_fall_back_with_a_reason() -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=32))
    assert "gpt2" in unsupported_reason(gpt2)
    t = wrap(gpt2, fast=True)
    assert t.fast_forward is None and "gpt2" in t.forward_note
    with pytest.raises(ValueError, match="no fast forward"):
        FastForward(gpt2)

    torch.manual_seed(0)
    sliding = Qwen2ForCausalLM(Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8,
                                           max_window_layers=0))
    assert "sliding" in unsupported_reason(sliding)
    dynamic = LlamaForCausalLM(LlamaConfig(**COMMON, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                      "rope_theta": 10000.0}))
    assert "dynamic" in unsupported_reason(dynamic)

    class Adapted(torch.nn.Linear):  # stands for a LoRA / quantized layer: a Linear that computes more
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2.0

    wrapped = tiny("llama")
    old = wrapped.model.layers[1].mlp.up_proj
    wrapped.model.layers[1].mlp.up_proj = Adapted(old.in_features, old.out_features, bias=old.bias is not None)
    assert "not plain float nn.Linear" in unsupported_reason(wrapped)
    assert wrap(wrapped, fast=True).fast_forward is None
    wrapped.config.quantization_config = {"quant_method": "gptq"}
    assert "quantized" in unsupported_reason(wrapped)

    fast = wrap(tiny("llama"), fast=True)
    with pytest.raises(ValueError, match="batch size 1"):
        fast.forward(torch.zeros((2, 3), dtype=torch.long), fast.new_cache(8))
    with pytest.raises(ValueError, match="out of range"):
        fast.forward(torch.zeros((1, 3), dtype=torch.long), fast.new_cache(8), [3])

    llama = tiny("llama")
    assert wrap(llama, fast=None).fast_forward is not None  # the default on a CPU
    assert wrap(llama, fast=False).fast_forward is None


def test_embedded_target_takes_the_fast_forward_and_decodes_the_same(target_fp32: Target) -> None:
    """Greedy plain decoding through the engine gives the same tokens with either forward (in
    float32: in bf16 the two forwards round differently, which only the fast forward's own rows
    need to avoid; test_batch_invariant.py checks those)."""
    target = target_fp32
    assert target.fast_forward is not None, target.forward_note
    assert target.fast_forward.packed == packing_works()
    library = ("compiled" if cpu_kernels.f32_kernel() is not None else "oneDNN" if onednn_fp32_works()
               else "MKL" if mkl_packing_works() else None)
    assert target.fast_forward.packed_by == library
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
        # 30 layers of fp32 GEMMs from two libraries (oneDNN here, MKL in transformers' path)
        # drift apart by ~1e-4 in logits of magnitude ~10; the tokens below must still agree.
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-3)
        fast_out = finish(Engine(target, None).generate(messages, cfg, plain=True)).token_ids
        hf_out = finish(Engine(hf, None).generate(messages, cfg, plain=True)).token_ids
        assert len(fast_out) >= 10
        assert fast_out == hf_out, prompt


def test_packing_linear_tracks_its_weight_and_trains_like_nn_linear() -> None:
    """The drafter's layers: packed at inference, re-packed after an optimizer step changes the
    weight in place (training evaluates the live drafter), plain autograd while training."""
    torch.manual_seed(0)
    layer = PackingLinear(32, 48, bias=True)
    x = torch.randn(2, 8, 32)  # 16 rows: the packed path where fp32 packing works
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-4, atol=1e-4)
        assert (layer._packed[1] is not None) == packing_works()
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    loss = layer(x).square().mean()
    loss.backward()  # autograd through the plain path
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
    opt.step()
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-4, atol=1e-4)
        y = layer(x[:, :1])  # 2 rows: below the packed path's minimum, same maths
        torch.testing.assert_close(y, F.linear(x[:, :1], layer.weight, layer.bias))
        twin = copy.deepcopy(layer)  # the opaque packed copy is left behind, and rebuilt
        torch.testing.assert_close(twin(x), layer(x), rtol=1e-4, atol=1e-4)
