"""DFlash greedy decoding is lossless: it reproduces plain greedy decoding token for token.

Everything here runs on the real embedded target (SmolLM2-135M-Instruct). Each prompt's plain
greedy continuation is computed once (module-scoped cache) and every DFlash run is compared
against it:

(a) the randomly initialised drafter (almost every draft token is rejected),
(b) drafts forced to the target's own greedy continuation (everything is accepted),
(c) forced drafts corrupted at a chosen position, so every accepted length 0..B-1 occurs.

Forcing is done by a test-only Engine subclass that overrides `draft_block`; with forced
drafts the number of denoising steps plays no role, so (b) and (c) vary the block size only.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch

from dflash_core.config import GenerationConfig
from dflash_core.drafter import DFlashDrafter
from dflash_core.drafting import Draft
from dflash_core.engine import Engine, Prompt
from dflash_core.events import BlockEvent, Finished
from dflash_core.targets import Target
from dflash_core.verify import Sampler

REF_TOKENS = 24  # length of every plain greedy reference (and of the forced-draft runs)
RANDOM_TOKENS = 8  # the random drafter accepts ~nothing, so each of its runs costs one block per token
BLOCK_SIZES = (2, 4, 8, 16)
PAD = 0  # draft token used past the end of the reference

PROMPTS: dict[str, object] = {
    "chat": "Write a haiku about the sea.",
    "code": "Write a Python function that returns the factorial of n.",
    "maths": "What is 17 * 23? Show your working.",
    "list": "List five fruits, one per line.",
    "multi_turn": [
        {"role": "user", "content": "My name is Ada and I like chess."},
        {"role": "assistant", "content": "Nice to meet you, Ada! Chess is a great game."},
        {"role": "user", "content": "What is my name, and which game do I like?"},
    ],
    "french": "Écris une phrase sur le printemps.",
    "spanish": "Translate 'good morning' into Spanish.",
    "eos_quick": "What is 2+2? Answer with a number only.",
    "explain": "Explain what a hash map is in one sentence.",
    "sequence": "Continue the sequence: 2, 4, 8, 16,",
    "raw_ids": ("ids", "The capital of France is"),  # a plain token-id prompt, no chat template
}
EOS_PROMPT = "eos_quick"
# Corrupted-draft runs go through the prompts in this order until every accepted length occurred.
CORRUPT_ORDER = ["code", "multi_turn", "raw_ids", "french", "sequence", "chat", "list", "maths", "explain",
                 "spanish", "eos_quick"]
MIN_CORRUPT_RUNS = 3




def resolve(target: Target, spec: object) -> Prompt:
    if isinstance(spec, tuple) and spec[0] == "ids":
        return list(target.tokenizer(spec[1])["input_ids"])
    return spec  # type: ignore[return-value]


@dataclass
class Reference:
    prompt: Prompt
    prompt_len: int
    tokens: list[int]  # plain greedy, REF_TOKENS long or ending with EOS
    reason: str

    def expected(self, max_new: int) -> list[int]:
        """Plain greedy output for a shorter max_new_tokens: a prefix of the reference."""
        assert max_new <= REF_TOKENS
        return self.tokens[:max_new]


class References:
    def __init__(self, target: Target, engine: Engine) -> None:
        self.target, self.engine = target, engine
        self._cache: dict[str, Reference] = {}

    def __getitem__(self, name: str) -> Reference:
        if name not in self._cache:
            prompt = resolve(self.target, PROMPTS[name])
            events, fin = run(self.engine, prompt, GenerationConfig(max_new_tokens=REF_TOKENS), plain=True)
            plen = len(self.engine.prompt_ids(prompt))
            check_events(events, fin, prompt_len=plen, max_new=REF_TOKENS, block=1, eos=self.target.eos_ids)
            self._cache[name] = Reference(prompt, plen, fin.token_ids, fin.reason)
        return self._cache[name]


@pytest.fixture(scope="module")
def refs(target: Target, engine: Engine) -> References:
    return References(target, engine)


def run(engine: Engine, prompt: Prompt, cfg: GenerationConfig, plain: bool = False,
        cancel: threading.Event | None = None) -> tuple[list[BlockEvent], Finished]:
    items = list(engine.generate(prompt, cfg, plain=plain, cancel=cancel))
    *events, fin = items
    assert isinstance(fin, Finished)
    assert all(isinstance(e, BlockEvent) for e in events)
    return events, fin  # type: ignore[return-value]


def check_events(events: Sequence[BlockEvent], fin: Finished, *, prompt_len: int, max_new: int, block: int,
                 eos: set[int], steps: int | None = None, full: bool = True) -> bool:
    """Invariants every run must satisfy. Returns whether the last event was cut short by a stop.

    `full`: every block drafted and verified all B-1 positions; otherwise (adaptive verify
    length) a block may draft fewer and verify a prefix of its drafts.

    Each event commits its accepted drafts plus the target token, except that the engine cuts the
    last event exactly where plain decoding stops (max_new_tokens, EOS, stop string), so the
    committed tokens add up to the reply with no overshoot.
    """
    assert events, "no events before Finished"
    first = events[0]
    assert (first.index, first.start, first.draft, first.accepted) == (0, prompt_len, [], 0)
    assert first.committed == [first.target_token] and first.tokens_so_far == 1
    total: list[int] = list(first.committed)
    draft_blocks = 0
    cut = False
    for prev, ev in itertools.pairwise(events):
        assert not cut, "an event followed a cut one"
        assert ev.index == prev.index + 1
        assert ev.start == prompt_len + prev.tokens_so_far - 1  # the anchor is the newest committed token
        assert ev.tokens_so_far == prev.tokens_so_far + len(ev.committed) > prev.tokens_so_far
        if block == 1 or (not full and not ev.is_draft_block):  # plain decoding, or a step while drafting rests
            assert ev.draft == [] and ev.steps == [] and ev.accepted == 0
            committed_full = [ev.target_token]
        else:
            draft_blocks += 1
            drafted = len(ev.draft) + 1
            if full:
                assert drafted == block and ev.checked == block - 1
            assert 2 <= drafted <= block and 1 <= ev.checked <= len(ev.draft)
            assert 0 <= ev.accepted <= ev.checked
            committed_full = [*ev.draft[: ev.accepted], ev.target_token]
            assert ev.rejected == ev.draft[ev.accepted : ev.checked]
            assert ev.unverified == ev.draft[ev.checked :]
            assert ev.steps and ev.steps[-1].tokens == ev.draft and all(ev.steps[-1].fixed)
            if steps is not None:
                assert len(ev.steps) == min(steps, drafted - 1)
                for a, b in itertools.pairwise(ev.steps):  # once fixed, a position stays fixed and unchanged
                    assert all(fb for fa, fb in zip(a.fixed, b.fixed, strict=True) if fa)
                    assert all(tb == ta for ta, tb, fa in zip(a.tokens, b.tokens, a.fixed, strict=True) if fa)
        assert 1 <= len(ev.committed) <= len(committed_full)
        assert ev.committed == committed_full[: len(ev.committed)]
        cut = ev.committed != committed_full
        total.extend(ev.committed)
    assert len(total) == events[-1].tokens_so_far
    assert fin.blocks == len(events) - 1
    assert fin.prompt_tokens == prompt_len
    # The reply's drafting and verifying times are its blocks' (the prefill is apart)
    assert fin.draft_s == pytest.approx(sum(e.draft_ms for e in events[1:]) / 1e3)
    assert fin.verify_s == pytest.approx(sum(e.verify_ms for e in events[1:]) / 1e3)
    out = fin.token_ids
    assert total == out  # no overshoot: the last event was already cut where decoding stops
    assert len(out) <= max_new
    if cut:
        assert fin.reason in ("length", "context", "eos", "stop")
    if fin.reason in ("length", "context"):
        assert len(out) == max_new
        assert not eos & set(out)
    elif fin.reason == "eos":
        assert out[-1] in eos
    assert not eos & set(out[:-1])
    if block == 1:
        assert fin.tau == 1.0
    elif draft_blocks:
        assert fin.tau == pytest.approx(sum(e.accepted + 1 for e in events[1:] if e.is_draft_block) / draft_blocks)
    return cut


# ----- forced drafts -----


class ForcedEngine(Engine):
    """Drafts the known plain-greedy continuation, optionally corrupted at one position per block.

    `corrupt(k, available)` gives the position to corrupt in the k-th block (B-1 or more: none);
    `available` is how many of the block's draft tokens lie inside the reference.
    """

    def __init__(self, target: Target, drafter: DFlashDrafter, ref: Reference,
                 corrupt: Callable[[int, int], int] | None = None) -> None:
        super().__init__(target, drafter)
        self.ref = ref
        self.corrupt = corrupt
        self.planned: list[int | None] = []  # corruption position of each block
        self.available: list[int] = []  # how many of each block's draft tokens came from the reference

    def draft_block(self, anchor: int, start: int, context: torch.Tensor | None, cache: object, block: int,
                    steps: int, sampler: Sampler) -> Draft:
        ref = self.ref.tokens
        a = start - self.ref.prompt_len  # index of the anchor in the reply
        assert anchor == ref[a], f"engine diverged from plain greedy at reply position {a}"
        toks = [ref[a + 1 + i] if a + 1 + i < len(ref) else PAD for i in range(block - 1)]
        avail = min(block - 1, len(ref) - a - 1)
        self.available.append(avail)
        c = None if self.corrupt is None else self.corrupt(len(self.planned), avail)
        if c is not None and c < block - 1:
            toks[c] = (toks[c] + 1) % self.target.vocab_size
        self.planned.append(c)
        dev = self.target.device
        tokens = torch.tensor(toks, dtype=torch.long, device=dev)
        probs = torch.ones(block - 1, device=dev)
        fixed = torch.ones(block - 1, dtype=torch.bool, device=dev)
        return Draft(tokens=tokens, probs=probs, q=None, steps=[(tokens.clone(), probs.clone(), fixed.clone())])


# ----- (a) random drafter -----


@pytest.mark.parametrize("block", BLOCK_SIZES)
@pytest.mark.parametrize("name", list(PROMPTS))
def test_random_drafter_matches_plain(target: Target, engine: Engine, refs: References, name: str,
                                      block: int) -> None:
    # Steps alternate over (prompt, block) so every (prompt, B), (B, steps) and (prompt, steps) pair
    # occurs; the verify length alternates over pairs of block sizes, so every prompt and every B
    # runs with both.
    p, b = list(PROMPTS).index(name), BLOCK_SIZES.index(block)
    steps = 1 + (p + b) % 2
    verify = ("full", "adaptive")[(p + b // 2) % 2]
    ref = refs[name]
    cfg = GenerationConfig(max_new_tokens=RANDOM_TOKENS, block_size=block, steps=steps, verify=verify)
    events, fin = run(engine, ref.prompt, cfg)
    check_events(events, fin, prompt_len=ref.prompt_len, max_new=RANDOM_TOKENS, block=block,
                 eos=target.eos_ids, steps=steps, full=verify == "full")
    assert fin.token_ids == ref.expected(RANDOM_TOKENS)
    assert fin.text == target.decode(fin.token_ids)


# ----- (b) forced drafts: everything accepted -----


@pytest.mark.parametrize("block", BLOCK_SIZES)
@pytest.mark.parametrize("name", list(PROMPTS))
def test_forced_drafts_accept_everything(target: Target, random_drafter: DFlashDrafter, refs: References,
                                         name: str, block: int) -> None:
    ref = refs[name]
    eng = ForcedEngine(target, random_drafter, ref)
    # Without prompt lookup: its guesses may hang below a forced draft and be walked instead of the
    # forced chain past the reply's end (the target keeps choosing after EOS), so a block's walked
    # line would no longer be its B-1 forced drafts.
    cfg = GenerationConfig(max_new_tokens=REF_TOKENS, block_size=block, lookup=False)
    events, fin = run(eng, ref.prompt, cfg)
    check_events(events, fin, prompt_len=ref.prompt_len, max_new=REF_TOKENS, block=block, eos=target.eos_ids)
    assert fin.token_ids == ref.tokens
    assert fin.reason == ref.reason
    for ev, avail in zip(events[1:], eng.available, strict=True):
        assert ev.accepted >= avail  # every draft token taken from the reference is accepted
    assert fin.tau > 1
    if len(ref.tokens) == REF_TOKENS and ref.reason == "length":
        # Nothing is rejected before the end, so the block count is the minimum possible.
        assert fin.blocks == -(-(REF_TOKENS - 1) // block)


# ----- (c) forced drafts corrupted at a varying position -----


@pytest.mark.parametrize("block", BLOCK_SIZES)
def test_corrupted_drafts_cover_every_accepted_length(target: Target, random_drafter: DFlashDrafter,
                                                     refs: References, block: int) -> None:
    todo = set(range(block))  # accepted lengths not produced yet; B-1 means "no corruption"

    def corrupt(k: int, avail: int) -> int:
        # The longest still-missing length that fits in this block's reference tokens, else cycle.
        fits = [c for c in todo if c < avail or c == avail == block - 1]
        c = max(fits) if fits else k % block
        todo.discard(c)
        return c

    seen: set[int] = set()
    for n_run, name in enumerate(CORRUPT_ORDER):
        if n_run >= MIN_CORRUPT_RUNS and not todo:
            break
        ref = refs[name]
        eng = ForcedEngine(target, random_drafter, ref, corrupt=corrupt)
        # Drafter candidates only: prompt-lookup guesses could carry a block past the corrupted token.
        cfg = GenerationConfig(max_new_tokens=REF_TOKENS, block_size=block, lookup=False)
        events, fin = run(eng, ref.prompt, cfg)
        check_events(events, fin, prompt_len=ref.prompt_len, max_new=REF_TOKENS, block=block, eos=target.eos_ids)
        assert fin.token_ids == ref.tokens, name
        assert fin.reason == ref.reason
        for ev, c, avail in zip(events[1:], eng.planned, eng.available, strict=True):
            assert c is not None
            if c < avail:
                assert ev.accepted == c, (name, ev.index)  # accepted up to the corrupted token, not beyond
            else:
                assert ev.accepted >= avail
            seen.add(ev.accepted)
    assert seen == set(range(block)), f"accepted lengths seen: {sorted(seen)}"


# ----- stop conditions -----


def _both_modes(engine: Engine, ref: Reference, cfg: GenerationConfig) -> tuple[Finished, Finished]:
    plen = ref.prompt_len
    plain_events, plain = run(engine, ref.prompt, cfg, plain=True)
    check_events(plain_events, plain, prompt_len=plen, max_new=cfg.max_new_tokens, block=1,
                 eos=engine.target.eos_ids)
    events, fast = run(engine, ref.prompt, cfg)
    check_events(events, fast, prompt_len=plen, max_new=cfg.max_new_tokens, block=cfg.block_size or 16,
                 eos=engine.target.eos_ids, steps=cfg.steps, full=cfg.verify == "full")
    return plain, fast


def test_stop_string_same_in_both_modes(target: Target, engine: Engine, random_drafter: DFlashDrafter,
                                        refs: References) -> None:
    ref = refs["list"]
    full = target.decode(ref.tokens)
    # A stop string that first appears a few tokens into the reply.
    stop = target.decode(ref.tokens[5:7]).strip()
    assert stop and stop in full and stop not in target.decode(ref.tokens[:5])
    k = next(k for k in range(1, len(ref.tokens) + 1) if stop in target.decode(ref.tokens[:k]))
    cfg = GenerationConfig(max_new_tokens=REF_TOKENS, block_size=4, stop=(stop,))
    plain, fast = _both_modes(engine, ref, cfg)
    forced_events, forced = run(ForcedEngine(target, random_drafter, ref), ref.prompt, cfg.with_(block_size=8))
    for fin in (plain, fast, forced):
        assert fin.reason == "stop"
        assert fin.token_ids == ref.tokens[:k]  # the shortest prefix whose text contains the stop string
        assert fin.text == full[: full.index(stop)]
        assert stop not in fin.text
    # The forced run's last block went past the stop string and was cut there.
    assert check_events(forced_events, forced, prompt_len=ref.prompt_len, max_new=REF_TOKENS, block=8,
                        eos=target.eos_ids)


@pytest.mark.parametrize("max_new", [7, 13])
def test_max_new_tokens_same_in_both_modes(target: Target, engine: Engine, random_drafter: DFlashDrafter,
                                           refs: References, max_new: int) -> None:
    ref = refs["code"]
    assert ref.reason == "length"
    cfg = GenerationConfig(max_new_tokens=max_new, block_size=8)
    plain, fast = _both_modes(engine, ref, cfg)
    forced_events, forced = run(ForcedEngine(target, random_drafter, ref), ref.prompt, cfg)
    cut = check_events(forced_events, forced, prompt_len=ref.prompt_len, max_new=max_new, block=8,
                       eos=target.eos_ids)
    assert cut  # the last block would have overshot: the engine cut it at max_new_tokens
    for fin in (plain, fast, forced):
        assert fin.reason == "length"
        assert fin.token_ids == ref.tokens[:max_new]
        assert len(fin.token_ids) == max_new


def test_eos_same_in_both_modes(target: Target, engine: Engine, random_drafter: DFlashDrafter,
                                refs: References) -> None:
    ref = refs[EOS_PROMPT]
    assert ref.reason == "eos" and ref.tokens[-1] in target.eos_ids and len(ref.tokens) < REF_TOKENS
    cfg = GenerationConfig(max_new_tokens=REF_TOKENS, block_size=16)
    plain, fast = _both_modes(engine, ref, cfg)
    forced_events, forced = run(ForcedEngine(target, random_drafter, ref), ref.prompt, cfg)
    check_events(forced_events, forced, prompt_len=ref.prompt_len, max_new=REF_TOKENS, block=16,
                 eos=target.eos_ids)
    for fin in (plain, fast, forced):
        assert fin.reason == "eos"
        assert fin.token_ids == ref.tokens
        assert fin.text == target.decode(ref.tokens)


# ----- cancel -----


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "dflash"])
@pytest.mark.parametrize("flag_kind", ["event", "callable"])
def test_cancel_after_second_event(target: Target, engine: Engine, refs: References, plain: bool,
                                   flag_kind: str) -> None:
    ref = refs["code"]
    flag = threading.Event()
    cancel = flag if flag_kind == "event" else flag.is_set
    items = engine.generate(ref.prompt, GenerationConfig(max_new_tokens=REF_TOKENS, block_size=4),
                            plain=plain, cancel=cancel)
    seen: list[BlockEvent] = []
    after = 0
    fin = None
    for item in items:
        if isinstance(item, Finished):
            fin = item
            break
        if flag.is_set():
            after += 1
        seen.append(item)
        if len(seen) == 2:
            flag.set()
    assert fin is not None and fin.reason == "cancelled"
    assert after <= 1  # at most one more event once the flag is set
    committed = [t for ev in seen for t in ev.committed]
    assert fin.token_ids == committed
    assert fin.token_ids == ref.tokens[: len(fin.token_ids)]  # what was produced is still exact
    assert len(fin.token_ids) < REF_TOKENS


# ----- sampling -----


@pytest.fixture(scope="module")
def sampled(engine: Engine) -> dict[tuple[bool, int, int], list[int]]:
    """(plain, seed, repeat) -> tokens, at temperature 1 with top-p 0.95."""
    runs = {}
    for plain in (True, False):
        for seed, rep in ((11, 0), (11, 1), (12, 0)):
            cfg = GenerationConfig(max_new_tokens=12, block_size=4, temperature=1.0, top_p=0.95, seed=seed)
            _, fin = run(engine, PROMPTS["chat"], cfg, plain=plain)  # type: ignore[arg-type]
            runs[(plain, seed, rep)] = fin.token_ids
    return runs


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "dflash"])
def test_sampling_same_seed_same_tokens(sampled: dict[tuple[bool, int, int], list[int]], plain: bool) -> None:
    assert sampled[(plain, 11, 0)]
    assert sampled[(plain, 11, 0)] == sampled[(plain, 11, 1)]


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "dflash"])
def test_sampling_different_seed_different_tokens(sampled: dict[tuple[bool, int, int], list[int]],
                                                  plain: bool) -> None:
    assert sampled[(plain, 11, 0)] != sampled[(plain, 12, 0)]


class RecordingEngine(Engine):
    """Keeps every Draft the real drafter produced."""

    def __init__(self, target: Target, drafter: DFlashDrafter) -> None:
        super().__init__(target, drafter)
        self.drafts: list[Draft] = []

    def draft_block(self, *args: object, **kwargs: object) -> Draft:
        draft = super().draft_block(*args, **kwargs)  # type: ignore[arg-type]
        self.drafts.append(draft)
        return draft


@pytest.mark.parametrize("block", [4, 8])
def test_sampling_multi_step_draft_fixes_every_position(target: Target, random_drafter: DFlashDrafter,
                                                        block: int) -> None:
    eng = RecordingEngine(target, random_drafter)
    # Every draft verified: "auto" would pick the adaptive chain, whose length (and so q's rows)
    # follows this machine's measured pass costs, i.e. its load at the time.
    cfg = GenerationConfig(max_new_tokens=3, block_size=block, steps=2, temperature=1.0, seed=0, verify="full")
    events, _ = run(eng, PROMPTS["chat"], cfg)  # type: ignore[arg-type]
    assert eng.drafts
    for ev, draft in zip(events[1:], eng.drafts, strict=True):
        assert all(ev.steps[-1].fixed), ev.steps[-1].fixed
        assert draft.q is not None
        assert torch.allclose(draft.q.sum(-1), torch.ones(block - 1))  # a proposal distribution per position


def test_stop_string_and_eos_in_one_block(target: Target, engine: Engine, random_drafter: DFlashDrafter,
                                          refs: References) -> None:
    ref = refs[EOS_PROMPT]
    assert ref.reason == "eos"
    stop = target.decode(ref.tokens[-2:-1]).strip()  # the last word before EOS
    assert stop and stop not in target.decode(ref.tokens[:-2])
    cfg = GenerationConfig(max_new_tokens=REF_TOKENS, block_size=16, stop=(stop,))
    _, plain = run(engine, ref.prompt, cfg, plain=True)
    events, forced = run(ForcedEngine(target, random_drafter, ref), ref.prompt, cfg)
    assert len(events) == 2  # the whole reply, stop string and EOS, came in one block
    assert plain.reason == "stop" and plain.token_ids == ref.tokens[:-1]
    assert forced.token_ids == plain.token_ids and forced.text == plain.text
    assert forced.reason == plain.reason
    assert check_events(events, forced, prompt_len=ref.prompt_len, max_new=REF_TOKENS, block=16, eos=target.eos_ids)
