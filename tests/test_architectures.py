"""Every family DFlash drafters are published for decodes exactly, on tiny random models built
from transformers' own config classes: plain decoding through our loop equals transformers'
greedy `generate`, and DFlash equals plain for every block size, step count and verify mode the
target allows. Hybrid targets (Gated DeltaNet layers), MLA targets (DeepSeek-V3/V3.2: keys and
values of different widths, V3.2's indexer keys) and Muse Glimmer's text side also roll back to
every accepted length."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from tiny_targets import FAMILIES, FORCED_ROLLBACK, HYBRID, tiny_target

from dflash_core.config import VERIFY_MODES, GenerationConfig
from dflash_core.drafter import DFlashDrafter, init_weights
from dflash_core.drafter_config import config_for_target
from dflash_core.drafting import Draft
from dflash_core.engine import Engine
from dflash_core.events import BlockEvent, Finished
from dflash_core.targets import Target
from dflash_core.verify import Sampler

TOKENS = 24
CHAT = [{"role": "user", "content": "Tell me about the sea and the sky, please."}]
TURNS = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue, like the sea."},
    {"role": "user", "content": "And one more, with a reason?"},
]


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request: pytest.FixtureRequest, target: Target) -> Target:
    return tiny_target(request.param, target.tokenizer)


def drafter_for(t: Target, block: int = 16) -> DFlashDrafter:
    cfg = config_for_target(t.config, num_layers=1, block_size=block, mask_token_id=0)
    return init_weights(DFlashDrafter(cfg), seed=1).eval()


def run(engine: Engine, messages: list[dict[str, str]], plain: bool = False, **kw: object
        ) -> tuple[list[BlockEvent], Finished]:
    cfg = GenerationConfig(**{"max_new_tokens": TOKENS, **kw})  # type: ignore[arg-type]
    *events, fin = engine.generate(messages, cfg, plain=plain)
    assert isinstance(fin, Finished)
    return events, fin  # type: ignore[return-value]


def allowed_modes(t: Target) -> list[str]:
    return [m for m in VERIFY_MODES if m == "auto" or t.supports_tree or not m.startswith("tree")]


def test_plain_equals_transformers_generate(tiny: Target) -> None:
    ids = tiny.encode_chat(CHAT)
    ref = tiny.model.generate(torch.tensor([ids]), max_new_tokens=TOKENS, do_sample=False)[0, len(ids):].tolist()
    _, fin = run(Engine(tiny, None), CHAT, plain=True)
    assert fin.token_ids == ref


@pytest.mark.parametrize("block", [2, 4, 8, 16])
def test_dflash_equals_plain(tiny: Target, block: int) -> None:
    engine = Engine(tiny, drafter_for(tiny, block))
    _, plain = run(engine, CHAT, plain=True)
    for steps in (1, 2):
        for mode in allowed_modes(tiny):
            if mode.startswith("tree") and steps > 1:
                continue  # trees need one denoising step
            _, fin = run(engine, CHAT, block_size=block, steps=steps, verify=mode)
            assert fin.token_ids == plain.token_ids, (tiny.name, block, steps, mode)
            assert not fin.warnings, fin.warnings


def test_hybrid_verifies_chains_only(tiny: Target) -> None:
    hybrid = tiny.name.removeprefix("tiny-") in HYBRID
    assert tiny.hybrid == hybrid
    if not hybrid:
        return
    assert not tiny.supports_tree
    engine = Engine(tiny, drafter_for(tiny))
    assert engine.verify_mode(GenerationConfig()) in ("adaptive", "full")
    warnings: list[str] = []
    assert engine.verify_mode(GenerationConfig(verify="tree"), warnings) == "adaptive"
    assert len(warnings) == 1 and "recurrent" in warnings[0]
    _, fin = run(engine, CHAT, verify="tree-full")
    assert fin.warnings == [w.replace("'tree'", "'tree-full'").replace("'adaptive'", "'full'") for w in warnings]


class ForcedEngine(Engine):
    """Drafts the known plain reply, corrupted at the position `corrupt(k, room)` gives for block
    k (`room`: reference tokens after the anchor; block-1 or more: no corruption)."""

    def __init__(self, target: Target, drafter: DFlashDrafter, reply: list[int], prompt_len: int,
                 corrupt: Callable[[int, int], int]) -> None:
        super().__init__(target, drafter)
        self.reply, self.prompt_len, self.corrupt = reply, prompt_len, corrupt
        self.planned: list[tuple[int, int]] = []  # (corrupted position, room) per block

    def draft_block(self, anchor: int, start: int, context: torch.Tensor | None, cache: object, block: int,
                    steps: int, sampler: Sampler) -> Draft:
        a = start - self.prompt_len
        room = len(self.reply) - a - 1
        toks = [self.reply[a + 1 + i] if i < room else 0 for i in range(block - 1)]
        c = self.corrupt(len(self.planned), room)
        self.planned.append((c, room))
        if c < block - 1:
            toks[c] = (toks[c] + 1) % self.target.vocab_size
        tokens = torch.tensor(toks)
        ones = torch.ones(block - 1)
        return Draft(tokens=tokens, probs=ones, q=None, steps=[(tokens.clone(), ones.clone(), ones.bool())])


@pytest.mark.parametrize("block", [4, 16])
def test_rolls_back_to_every_accepted_length(tiny: Target, block: int) -> None:
    """The rollback's real test: a verify pass cut back after each accepted length 0..B-1, on
    several prompts and a multi-turn chat, and every reply still equal to plain decoding."""
    if tiny.name.removeprefix("tiny-") not in FORCED_ROLLBACK:
        pytest.skip("one keys/values pair per layer: rollback is moving a length (test_lossless.py)")
    todo = set(range(block))

    def corrupt(k: int, room: int) -> int:
        # The longest accepted length still missing that this block's reference tokens allow.
        fits = [c for c in todo if c < room or (c == block - 1 and room >= c)]
        c = max(fits) if fits else k % block
        todo.discard(c)
        return c

    seen: set[int] = set()
    for messages in [CHAT, TURNS, [{"role": "user", "content": "Count to twenty."}]]:
        _, plain = run(Engine(tiny, None), messages, plain=True, max_new_tokens=4 * block)
        engine = ForcedEngine(tiny, drafter_for(tiny, block), plain.token_ids, plain.prompt_tokens, corrupt)
        events, fin = run(engine, messages, max_new_tokens=4 * block, block_size=block, verify="full")
        assert fin.token_ids == plain.token_ids
        for ev, (c, room) in zip(events[1:], engine.planned, strict=True):
            if c < min(room, block - 1):
                assert ev.accepted == c  # up to the corrupted token, not beyond
                seen.add(c)
            elif room >= block - 1:
                assert ev.accepted == block - 1
                seen.add(block - 1)
    assert seen == set(range(block))
