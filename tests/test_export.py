"""A drafter exported to transformers' DFlash assistant layout runs in transformers' own DFlash:
`AutoModel.from_pretrained` loads it, `generate(assistant_model=..., speculation_type="dflash")`
drafts block for block what our engine drafts and writes what plain decoding writes, our loader
reads it back unchanged, and what the layout cannot express is refused in one line. The bench's
`hf-dflash` method counts transformers' acceptance as our engine does."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_targets import tiny_target
from transformers import AutoModel

import dflash_core.__main__ as cli
from dflash_core import bench
from dflash_core.config import GenerationConfig
from dflash_core.drafter import DFlashDrafter, init_weights, load_drafter
from dflash_core.drafter_config import FULL, SLIDING, DFlashConfig, config_for_target
from dflash_core.engine import Engine
from dflash_core.errors import DFlashError
from dflash_core.events import BlockEvent, Finished
from dflash_core.export import assistant_config, export_drafter
from dflash_core.targets import Target

CHAT = [{"role": "user", "content": "Tell me about the sea and the sky, please."}]
TOKENS, BLOCK = 24, 8
# A sliding layer beside a full one, with scaled RoPE: the window's off-by-one (transformers counts
# |q - k| <= W, z-lab < W) and the RoPE parameters both have to survive the trip.
SHAPES = {"full": {}, "sliding": dict(layer_types=[SLIDING, FULL], sliding_window=5, is_causal=False,
                                      rope_scaling={"rope_type": "linear", "factor": 2.0})}


@pytest.fixture(scope="module")
def tiny(target: Target) -> Target:
    return tiny_target("qwen3", target.tokenizer)


def random_drafter(t: Target, **changes: Any) -> DFlashDrafter:
    cfg = config_for_target(t.config, num_layers=2, block_size=BLOCK, mask_token_id=0)
    # Wider than the default init, so the drafts depend on the context (and differ between blocks).
    return init_weights(DFlashDrafter(dataclasses.replace(cfg, **changes)), std=0.08, seed=3).eval()


def transformers_dflash(t: Target, assistant: Any) -> tuple[list[int], list[list[int]]]:
    """transformers' own DFlash reply, and the drafts its target verified, block by block (the
    tokens after the anchor in every target forward but the prefill)."""
    passes: list[list[int]] = []
    hook = t.model.register_forward_hook(
        lambda _m, _a, kw, _o: passes.append(kw["input_ids"][0].tolist()), with_kwargs=True)
    ids = torch.tensor([t.encode_chat(CHAT)])
    try:
        out = t.model.generate(ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(ids.shape[1])[None],
                               assistant_model=assistant, speculation_type="dflash", max_new_tokens=TOKENS,
                               do_sample=False)
    finally:
        hook.remove()
    return out[0, ids.shape[1]:].tolist(), [p[1:] for p in passes[1:]]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_exported_drafter_runs_in_transformers_dflash(tiny: Target, tmp_path: Path, shape: str) -> None:
    drafter = random_drafter(tiny, **SHAPES[shape])
    assert export_drafter(drafter, tmp_path / "assistant", dtype=torch.float32) == []  # nothing left out
    raw = json.loads((tmp_path / "assistant" / "config.json").read_text())
    assert raw["model_type"] == "muse_glimmer_assistant" and raw["block_size"] == BLOCK
    assistant = AutoModel.from_pretrained(tmp_path / "assistant").eval()
    assert type(assistant).__name__ == "MuseGlimmerAssistantModel"

    engine = Engine(tiny, drafter)
    *_, plain = engine.generate(CHAT, GenerationConfig(max_new_tokens=TOKENS), plain=True)
    *events, ours = engine.generate(CHAT, GenerationConfig(max_new_tokens=TOKENS, block_size=BLOCK, verify="full"))
    assert isinstance(plain, Finished) and isinstance(ours, Finished) and ours.token_ids == plain.token_ids
    reply, their_drafts = transformers_dflash(tiny, assistant)
    assert reply == plain.token_ids
    our_drafts = [e.draft for e in events if isinstance(e, BlockEvent) and e.is_draft_block]
    assert len(their_drafts) == len(our_drafts) > TOKENS // 2
    # Near the token budget ours drafts shorter blocks and transformers' none (a plain step): whole blocks only.
    full = [i for i, d in enumerate(our_drafts) if len(d) == BLOCK - 1 and their_drafts[i]]
    assert len(full) >= len(our_drafts) - 2 and len({tuple(our_drafts[i]) for i in full}) > 1
    for i in full:
        assert their_drafts[i] == our_drafts[i], i

    # Our loader reads the layout back: the same drafter, window and RoPE included.
    back = load_drafter(tmp_path / "assistant", target=tiny)
    def shape(c: DFlashConfig) -> tuple[Any, ...]:
        return c.layer_types, c.rope_scaling, [(c.layer_window(i), c.layer_causal(i)) for i in range(2)]

    assert shape(back.config) == shape(drafter.config)
    block = tiny.embed(torch.tensor([[5] + [0] * (BLOCK - 1)]))
    context = torch.randn(1, 12, 2 * tiny.config.hidden_size, generator=torch.Generator().manual_seed(0))
    mine, theirs = (d.step(block, 12, d.new_cache(64), context) for d in (drafter, back))
    assert torch.equal(mine, theirs)


def refusal(cfg: DFlashConfig) -> str:
    with pytest.raises(DFlashError) as e:
        assistant_config(cfg)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_what_the_assistant_layout_cannot_express_is_refused(tiny: Target) -> None:
    cfg = random_drafter(tiny).config
    assert "DFlash 2" in refusal(dataclasses.replace(cfg, conv_kernel_size=3, conv_group_size=16, selector_top_k=4,
                                                     selector_rank=8))
    assert "layer(s) [0, 1] attend causally" in refusal(dataclasses.replace(cfg, is_causal=True))
    # z-lab's default for a sliding layer is causal inside the block
    assert "layer(s) [0] attend causally" in refusal(dataclasses.replace(cfg, layer_types=[SLIDING, FULL],
                                                                          sliding_window=4))
    assert "window of 1" in refusal(dataclasses.replace(cfg, layer_types=[SLIDING, FULL], sliding_window=1,
                                                        is_causal=False))
    for field, value in [("output_multiplier", 2.0), ("final_logit_softcapping", 30.0),
                         ("input_embedding_scale", 0.5)]:
        assert field in refusal(dataclasses.replace(cfg, **{field: value}))
    # the bench's hf-dflash method says so before any prompt runs
    v2 = DFlashDrafter(dataclasses.replace(cfg, conv_kernel_size=3, conv_group_size=16, selector_top_k=4,
                                           selector_rank=8))
    with pytest.raises(DFlashError, match=r"^bench method 'hf-dflash': cannot export .* a DFlash 2 drafter"):
        bench.make_methods(Engine(tiny, v2), ["plain", "hf-dflash", "dflash"])


def test_export_cli(tiny: Target, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    drafter = random_drafter(tiny)
    drafter.draft_vocab = torch.arange(100, 400)
    drafter.save(tmp_path / "zlab", dtype=torch.float32)
    rc = cli.main(["export", "--draft", str(tmp_path / "zlab"), "--to", "transformers-assistant",
                   "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 0, err
    # the draft vocabulary has no place in the layout: said, not silently dropped; the stored dtype kept
    assert "note: draft_vocab.json" in err and "(transformers-assistant layout, float32)" in err
    assistant = AutoModel.from_pretrained(tmp_path / "out")
    assert assistant.dtype == torch.float32
    assert torch.equal(assistant.encoder.fc.weight, drafter.fc.weight)
    capsys.readouterr()
    rc = cli.main(["export", "--draft", str(tmp_path / "zlab"), "--to", "transformers-assistant",
                   "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "not an empty folder" in err and err.count("\n") == 1


def test_hf_dflash_counts_acceptance_as_our_engine(target_fp32: Target) -> None:
    """The shipped drafter without its draft vocabulary (transformers drafts over the whole one), in
    float32: transformers' DFlash and ours draft the same blocks, so every block accepts as many."""
    drafter = load_drafter("assets/drafter", dtype=torch.float32)
    drafter.draft_vocab = None
    engine = Engine(target_fp32, drafter)
    config = GenerationConfig(max_new_tokens=48, block_size=16)
    methods = bench.make_methods(engine, ["plain", "hf-dflash", "dflash-b16-full"], config)
    assert [m.kind for m in methods] == ["plain", "hf-dflash", "dflash"] and methods[1].block_size == 16
    prompts = [["Write a Python function that returns the square of a number."]]
    results = bench.run_methods(prompts, methods, config, warmup=0, progress=False)[0]
    hf, ours = results["hf-dflash"], results["dflash-b16-full"]
    assert hf.ids == ours.ids == results["plain"].ids
    assert hf.accepted == ours.accepted and max(hf.accepted) > 0
    assert hf.tau == ours.tau > 1.0 and hf.blocks == len(hf.accepted)
    summary, _ = bench.summarize(prompts, [results], methods, primary="dflash-b16-full")
    s = summary["per_method"]["hf-dflash"]
    assert s["tau_hist"] is not None and sum(s["tau_hist"]) == len(hf.accepted)
    assert s["verify_ms_per_block"] is None  # transformers' passes are not timed by our engine's clocks
