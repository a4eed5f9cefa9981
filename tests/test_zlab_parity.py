"""Parity with z-lab's own package (`dflash` 0.1.0, MIT; a test-only dependency): the same
checkpoint folder, saved here, runs in `dflash.model.dflash_generate` and in our engine, and
gives the same reply and the same draft tokens block by block (z-lab shortens its last blocks
to the token budget, so only blocks both drafted at full size are compared).

Two adaptations of the reference, both outside its maths: on a hybrid target its cache needs
`activate_past_recording(recurrent_states_to_keep=B)` (transformers' own DFlash generator
passes it; z-lab's CPU path does not), and its DFlash 2 convolution fails on a block shorter
than its kernel (an F.pad of an empty slice), so such a block is padded after its end, which a
causal convolution never reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from drafters import perturbed_upgrade
from tiny_targets import tiny_target

from dflash_core.config import GenerationConfig
from dflash_core.dflash2 import dflash2_config
from dflash_core.drafter import DFlashDrafter, init_weights, load_drafter
from dflash_core.drafter_config import config_for_target
from dflash_core.engine import Engine
from dflash_core.events import BlockEvent, Finished
from dflash_core.loading import SHIPPED_DRAFTER
from dflash_core.targets import Target

zm = pytest.importorskip("dflash.model", reason="z-lab's dflash package is missing (scripts/setup.sh --test "
                                                "installs it --no-deps)")
TOKENS = 64
BLOCK = 16
CHAT = "Tell me about the sea and the sky, please."
PROMPTS = ["What are three tips for staying productive when working from home?",
           "Write a Python function that returns the n-th Fibonacci number."]


@pytest.fixture(autouse=True)
def zlab_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import DynamicCache

    def make_cache(config: object) -> DynamicCache:
        cache = DynamicCache(config=config)
        cache.activate_past_recording(recurrent_states_to_keep=BLOCK)
        return cache

    convolve = zm._grouped_dynamic_convolve

    def padded(hidden: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group: int) -> torch.Tensor:
        length, taps = hidden.shape[1], base.shape[0]
        if length >= taps:
            return convolve(hidden, dynamic, base, group)
        dynamic = dynamic.reshape(*dynamic.shape[:2], -1)
        pad = (0, 0, 0, taps - length)
        return convolve(F.pad(hidden, pad), F.pad(dynamic, pad), base, group)[:, :length]

    monkeypatch.setattr(zm, "_make_cache", make_cache)
    monkeypatch.setattr(zm, "_grouped_dynamic_convolve", padded)


def zlab_reply(folder: Path, version: int, model: torch.nn.Module, ids: list[int], stop: list[int]
               ) -> tuple[list[int], list[list[int]]]:
    """z-lab's reply to `ids` with the drafter in `folder`, and each block's draft tokens."""
    cls = zm.DFlash2DraftModel if version == 2 else zm.DFlashDraftModel
    drafter = cls.from_pretrained(folder, dtype=torch.float32).eval()
    drafts: list[list[int]] = []
    if version == 2:
        propose = drafter.propose

        def recorded(*a: object, **k: object) -> tuple:
            out = propose(*a, **k)
            drafts.append(out[0][0].tolist())
            return out
        drafter.propose = recorded
    else:
        logits_of = drafter.compute_logits

        def recorded(*a: object, **k: object) -> torch.Tensor:
            out = logits_of(*a, **k)
            drafts.append(out.argmax(-1)[0].tolist())
            return out
        drafter.compute_logits = recorded
    out = zm.dflash_generate(drafter, model, torch.tensor([ids]), TOKENS, stop_token_ids=stop)
    return out[0, len(ids):].tolist(), drafts


def assert_same(target: Target, drafter: DFlashDrafter, folder: Path, prompt: str, min_accepted: int = 0) -> None:
    drafter.save(folder, torch.float32)
    ours = load_drafter(folder, target=target)
    ours.draft_vocab = None  # z-lab drafts over the whole vocabulary
    ids = target.encode_chat([{"role": "user", "content": prompt}])
    *events, fin = Engine(target, ours).generate(ids, GenerationConfig(max_new_tokens=TOKENS, verify="full"))
    assert isinstance(fin, Finished)
    blocks = [e for e in events if isinstance(e, BlockEvent) and e.draft]
    reply, drafts = zlab_reply(folder, drafter.config.version, target.model, ids, list(target.eos_ids))
    assert fin.token_ids == reply[: len(fin.token_ids)] and len(fin.token_ids) in (len(reply), len(reply) - 1)
    pairs = [(e.draft, z) for e, z in zip(blocks, drafts, strict=False) if len(e.draft) == len(z) == BLOCK - 1]
    assert len(pairs) >= min(len(blocks), len(drafts)) - BLOCK and pairs
    assert all(a == b for a, b in pairs), next((a, b) for a, b in pairs if a != b)
    assert sum(e.accepted for e in blocks) >= min_accepted


def random_drafter(t: Target, version: int) -> DFlashDrafter:
    cfg = config_for_target(t.config, num_layers=2, block_size=BLOCK, mask_token_id=0)
    if version == 2:
        cfg = dflash2_config(cfg, kernel_size=4, group_size=16, top_k=8, rank=16)
    return init_weights(DFlashDrafter(cfg), seed=1, std=0.1).eval()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
@pytest.mark.parametrize("version", [1, 2])
def test_random_drafters_on_tiny_targets(target: Target, family: str, version: int, tmp_path: Path) -> None:
    tiny = tiny_target(family, target.tokenizer)
    assert_same(tiny, random_drafter(tiny, version), tmp_path, CHAT)


@pytest.mark.parametrize("version", [1, 2])
def test_trained_drafters_on_the_embedded_target(target_fp32: Target, version: int, tmp_path: Path) -> None:
    """Real acceptance (several tokens per block), so the drafter's context after accepted
    tokens is compared too. DFlash 2: the shipped drafter upgraded, its new parts randomised."""
    drafter = load_drafter(SHIPPED_DRAFTER)
    if version == 2:
        drafter = perturbed_upgrade(drafter)
    # The randomised DFlash 2 parts cost acceptance; a few accepted tokens still exercise the context after them.
    assert_same(target_fp32, drafter, tmp_path, PROMPTS[version - 1], min_accepted=8 if version == 1 else 3)
