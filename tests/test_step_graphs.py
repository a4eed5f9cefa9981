"""The static passes behind CUDA graphs (step_graphs.py, FastForward.static_forward).

No CUDA here, so the graphs themselves are not captured; `Target(graphs=True)` on a CPU runs the
very pass a graph would replay (positions as a device tensor, keys/values written with
index_copy_, attention over the whole buffer under a mask), with the same fixed input buffers,
re-binding and fallbacks. These tests check that it computes what the ordinary passes compute,
on tiny models of each supported family and through the engine on the embedded target.
"""

from __future__ import annotations

import pytest
import torch

from dflash_core import Engine, GenerationConfig
from dflash_core.drafter import load_drafter
from dflash_core.loading import SHIPPED_DRAFTER
from dflash_core.step_graphs import MAX_TOKENS
from dflash_core.targets import Target
from tests.conftest import finish
from tests.test_fast_forward import KINDS, assert_same, passes, tiny, wrap


def graphed(model: torch.nn.Module) -> Target:
    t = Target(model=model, tokenizer=None, name="tiny", device=torch.device("cpu"), dtype=torch.float32,
               graphs=True)
    assert t.step_graphs is not None and not t.step_graphs.capture, t.forward_note
    return t


@pytest.mark.parametrize("kind", KINDS)
def test_static_passes_match_transformers(kind: str) -> None:
    """Prefill (an ordinary pass: the cache has no buffers yet), then passes of 1, 4, 3 tokens
    after a rollback, and a last-only pass, all static; also taking turns with transformers'
    forward on one cache."""
    model = tiny(kind)
    ref = wrap(model, fast=False)
    target = graphed(model)
    assert_same(passes(ref, [0, 2]), passes(target, [0, 2]))
    assert target.step_graphs.captures == 4  # lengths 1, 4, 3, 2 (prefill is not one)
    assert_same(passes(ref, [1], prefill=40), passes(target, [1], prefill=40, other=ref))


def test_passes_fall_back_when_they_must() -> None:
    target = graphed(tiny("qwen3"))
    graphs = target.step_graphs
    gen = torch.Generator().manual_seed(3)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, 97, (1, n), generator=gen)

    cache = target.new_cache(24)
    assert graphs.forward(ids(5), cache) is None  # no buffers before the prompt's ordinary pass
    target.forward(ids(5), cache)
    assert graphs.forward(ids(20), cache) is None  # would overflow: the ordinary pass says so
    with pytest.raises(RuntimeError, match="overflow"):
        target.forward(ids(20), cache)
    assert cache.length == 5 and graphs.captures == 0
    big = target.new_cache(80)
    target.forward(ids(5), big)
    assert graphs.forward(ids(MAX_TOKENS + 1), big) is None  # too long (a prefill): an ordinary pass
    assert big.length == 5 and graphs.captures == 0


def test_a_new_reply_binds_new_passes_to_its_own_cache() -> None:
    """Passes replay on the cache they were bound to (as a graph replays on its captured
    addresses). A reply that ends frees its cache and its passes; the next reply's cache, of
    another length and possibly at the old one's address, gets passes of its own."""
    model = tiny("llama3-mqa")
    target, ref = graphed(model), wrap(model, fast=False)
    gen = torch.Generator().manual_seed(5)
    for size in (40, 64, 40, 52):
        cache, ref_cache = target.new_cache(size), ref.new_cache(size)
        for n in (6, 1, 4, 1, 4):
            step = torch.randint(0, 97, (1, n), generator=gen)
            got, _ = target.forward(step, cache)
            want, _ = ref.forward(step, ref_cache)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            if n == 4:
                cache.truncate(cache.length - 2)
                ref_cache.truncate(ref_cache.length - 2)
        torch.testing.assert_close(cache.layers[2].keys[:, :, : cache.length],
                                   ref_cache.layers[2].keys[:, :, : cache.length], rtol=1e-4, atol=1e-4)
        del cache, ref_cache
        assert not target.step_graphs._passes  # freed with the cache
    assert target.step_graphs.captures == 2 * 4  # lengths 1 and 4, bound again for each reply


def test_outputs_are_copies_that_the_next_pass_does_not_overwrite() -> None:
    target = graphed(tiny("llama"))
    cache = target.new_cache(32)
    target.forward(torch.tensor([[1, 2, 3]]), cache, [1])
    logits, feats = target.forward(torch.tensor([[4, 5]]), cache, [1])
    kept = logits.clone(), feats.clone()
    target.forward(torch.tensor([[6, 7]]), cache, [1])  # the same pass: the same output buffers
    torch.testing.assert_close(logits, kept[0], rtol=0, atol=0)
    torch.testing.assert_close(feats, kept[1], rtol=0, atol=0)


def test_a_pass_that_cannot_be_captured_turns_graphs_off(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny("qwen2")
    target, ref = graphed(model), wrap(model, fast=False)
    cache, ref_cache = target.new_cache(32), ref.new_cache(32)
    prompt, step = torch.tensor([[3, 1, 4, 1, 5]]), torch.tensor([[9, 2, 6]])
    target.forward(prompt, cache)
    ref.forward(prompt, ref_cache)

    def cannot(*args: object) -> None:
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(target.step_graphs, "_run", cannot)
    got, _ = target.forward(step, cache)  # an ordinary pass instead, and the same result
    want, _ = ref.forward(step, ref_cache)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert cache.length == 8
    assert "turned off: capturing a 3-token pass failed: operation not permitted" in target.forward_note
    assert target.step_graphs.forward(step, cache) is None


def test_graphs_need_the_fast_forward() -> None:
    t = Target(model=tiny("llama"), tokenizer=None, name="tiny", device=torch.device("cpu"),
               dtype=torch.float32, fast=False, graphs=True)
    assert t.step_graphs is None and "no CUDA graphs" in t.forward_note
    assert wrap(tiny("llama"), fast=True).step_graphs is None  # off unless asked for


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh runs it)")
def test_captured_graphs_match_ordinary_passes_on_cuda() -> None:
    """The real capture: replays, rollbacks and a second reply's cache of another length."""
    model = tiny("qwen3").cuda()
    dev = torch.device("cuda")
    target = Target(model=model, tokenizer=None, name="tiny", device=dev, dtype=torch.float32, graphs=True)
    ref = Target(model=model, tokenizer=None, name="tiny", device=dev, dtype=torch.float32, fast=False)
    assert target.step_graphs is not None and target.step_graphs.capture
    gen = torch.Generator().manual_seed(7)
    for size in (48, 80):
        cache, ref_cache = target.new_cache(size), ref.new_cache(size)
        for n in (9, 1, 4, 1, 4, 4, 16):
            step = torch.randint(0, 97, (1, n), generator=gen).to(dev)
            got, fg = target.forward(step, cache, [0, 2])
            want, fw = ref.forward(step, ref_cache, [0, 2])
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
            torch.testing.assert_close(fg, fw, rtol=1e-3, atol=1e-3)
            if n == 4:
                cache.truncate(cache.length - 1)
                ref_cache.truncate(ref_cache.length - 1)
        assert target.step_graphs.disabled is None
        assert len(target.step_graphs._passes) == 3  # lengths 1, 4 and 16, each a captured graph
        assert all(p.graph is not None for p in target.step_graphs._passes.values())
        del cache, ref_cache


def test_embedded_target_decodes_the_same_through_static_passes(target_fp32: Target) -> None:
    """Plain and DFlash decoding (the shipped drafter, so blocks accept varying lengths; every
    draft verified at B = 4 and 16, and the adaptive verify length) through static passes give
    plain decoding's tokens through ordinary passes. Graphs serve the float32 (and CUDA) path;
    the batch-invariant bf16 CPU path has none."""
    base = target_fp32
    drafter = load_drafter(SHIPPED_DRAFTER, device="cpu", dtype=torch.float32)
    plain_engine = Engine(base, drafter)
    target = Target(model=base.model, tokenizer=base.tokenizer, name=base.name, device=base.device,
                    dtype=base.dtype, graphs=True)
    engine = Engine(target, drafter)
    prompts = ["Write a Python function that checks whether a number is prime.",
               "A train travels 60 km in 45 minutes. What is its speed in km/h?",
               "Give three tips for learning a new language."]
    cfg = GenerationConfig(max_new_tokens=48, temperature=0.0)
    accepted: set[int] = set()
    for prompt in prompts:
        want = finish(plain_engine.generate(prompt, cfg, plain=True)).token_ids
        assert len(want) >= 20
        assert finish(engine.generate(prompt, cfg, plain=True)).token_ids == want, prompt
        for block, verify in ((4, "full"), (16, "full"), (16, "adaptive")):
            events = list(engine.generate(prompt, GenerationConfig(max_new_tokens=48, temperature=0.0,
                                                                   block_size=block, verify=verify)))
            accepted.update(e.accepted for e in events[1:-1])
            assert events[-1].token_ids == want, (prompt, block, verify)
    assert max(accepted) >= 2  # blocks that kept several drafts were checked, not only rejections
    assert target.step_graphs.captures > 0
