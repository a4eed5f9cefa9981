"""The decoding loop: prefill, then per block draft → verify → accept → emit a BlockEvent.

Plain autoregressive decoding runs through the same loop and is the baseline that every
comparison uses. What a block does is a step (steps.py: plain, chain or tree), chosen once per
reply from the verify mode; the loop only commits, stops and reports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from . import threads
from .config import TREE_MODES, GenerationConfig
from .draft_tree import max_tree_nodes
from .drafter import DFlashDrafter
from .drafter_config import check_fit
from .drafting import BlockDrafter, Draft
from .errors import DFlashError
from .events import BlockEvent, Finished, SelectorChoice, tau
from .lookup import NgramIndex
from .steps import BlockResult, ChainStep, PlainStep, TreeStep
from .targets import Target
from .verify import Sampler
from .verify_length import Pace, PassCosts, VerifyCost, measure_verify_cost, resolve_mode

Prompt = str | Sequence[dict[str, str]] | Sequence[int]
Event = BlockEvent | Finished
CancelFlag = threading.Event | Callable[[], bool] | None


def _cancelled(flag: CancelFlag) -> bool:
    if flag is None:
        return False
    return flag.is_set() if isinstance(flag, threading.Event) else bool(flag())


class Engine:
    """A target with an optional DFlash drafter. `generate` yields events, then a `Finished`."""

    # Pass costs to size blocks with instead of this machine's measured ones (tests pin them).
    pinned_costs: ClassVar[PassCosts | None] = None
    # On a CPU, fit torch's thread count to the cores other programs leave free before each reply
    # (threads.py); tests turn it off, so that no verdict depends on what else the machine runs.
    fit_threads: ClassVar[bool] = True

    def __init__(self, target: Target, drafter: DFlashDrafter | None = None) -> None:
        self.target = target
        self.drafter = drafter
        self.warnings: list[str] = []  # load-time notes for the user (e.g. an untrained drafter)
        self.drafter_name = "none" if drafter is None else "custom"
        self.drafting: BlockDrafter | None = None
        if drafter is not None:
            check_fit(drafter.config, hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                      num_layers=target.num_layers)
            drafter.to(device=target.device, dtype=target.dtype).eval()
            self.drafting = BlockDrafter(drafter, target)

    # ----- the public loop -----

    def generate(self, prompt: Prompt, config: GenerationConfig | None = None, *, plain: bool = False,
                 cancel: CancelFlag = None) -> Iterator[Event]:
        """Yield one BlockEvent per block (per token when `plain`), then a Finished."""
        config = config or GenerationConfig()
        if not plain and self.drafter is None:
            raise DFlashError("DFlash decoding needs a drafter; load one or use plain decoding")
        if not plain and config.steps > 1 and self.drafter.config.version == 2:
            raise DFlashError(f"a DFlash 2 drafter drafts in one denoising step (its candidate selector walks the "
                              f"block once); use steps=1, not {config.steps}")
        ids = self.prompt_ids(prompt)
        ctx = self.target.max_context
        if len(ids) >= ctx:
            raise DFlashError(f"the prompt has {len(ids)} tokens but the target's context window is {ctx}; "
                              "shorten the prompt or the conversation")
        return self._run(ids, config, plain, cancel)

    def _run(self, ids: list[int], cfg: GenerationConfig, plain: bool, cancel: CancelFlag) -> Iterator[Event]:
        warnings: list[str] = []
        governed = self.fit_threads and self.target.device.type == "cpu" and threads.governed()
        if governed:
            n, most = threads.fit_threads()
            if n < most:
                warnings.append(f"other programs are keeping {most - n} of this machine's {most} cores busy: "
                                f"decoding on {n} thread{'s' if n > 1 else ''} (threads fighting for a core "
                                "are several times slower)")
        try:
            yield from self._blocks(ids, cfg, plain, cancel, warnings)
        finally:
            if governed:
                threads.rested()

    def _blocks(self, ids: list[int], cfg: GenerationConfig, plain: bool, cancel: CancelFlag,
                warnings: list[str]) -> Iterator[Event]:
        max_new = cfg.max_new_tokens
        room = self.target.max_context - len(ids)
        if max_new > room:
            warnings.append(f"max_new_tokens lowered from {max_new} to {room} to fit the context window")
            max_new = room
        stopper = _Stopper(self.target, max_new, "context" if max_new == room else "length", cfg.stop)
        t0 = time.perf_counter()
        step = self._step(ids, cfg, plain, max_new, warnings)
        first = step.prefill(ids)
        prefill_s = time.perf_counter() - t0
        out: list[int] = []
        tally = _Tally(prompt_tokens=len(ids), prefill_s=prefill_s, t0=t0, warnings=warnings)
        first_block = BlockResult([first], verify_ms=prefill_s * 1e3)
        kept, reason = stopper.commit(out, first_block.tokens)
        step.committed(first_block, kept)
        yield self._event(0, len(ids), first_block, kept, out)
        start = len(ids)  # position of the anchor: the newest committed token, not yet in the target's cache
        index = 0
        while reason is None:
            if _cancelled(cancel):
                reason = "cancelled"
                break
            index += 1
            result = step.block(out[-1], start)
            tally.add(result)
            kept, reason = stopper.commit(out, result.tokens)
            step.committed(result, kept)
            yield self._event(index, start, result, kept, out)
            start += len(result.tokens)
        yield tally.finish(reason, out, self.target, cfg.stop, step.draft_s)

    # ----- choosing a reply's step -----

    def _step(self, ids: list[int], cfg: GenerationConfig, plain: bool, max_new: int,
              warnings: list[str]) -> PlainStep:
        """The step every block of this reply runs, with caches sized for the reply."""
        sampler = Sampler(cfg, self.target.device)
        if plain:
            return PlainStep(self.target, len(ids) + max_new + 2, sampler)
        assert self.drafter is not None and self.drafting is not None
        block = cfg.block_size or self.drafter.block_size
        mode = self.verify_mode(cfg, warnings)
        tree = mode in TREE_MODES
        max_nodes = max_tree_nodes(block, sized=mode == "tree")
        cache_len = len(ids) + max_new + max(block, max_nodes + 1 if tree else 0) + 1
        cost = self.cost_table(mode, block)
        pinned = self.pinned_costs
        pace = Pace(cost, block, None if pinned is None else pinned.draft_ms, rest=pinned is None or pinned.rest)
        drafting = self.drafting

        def draft(anchor: int, start: int, context: torch.Tensor | None, cache: object, length: int) -> Draft:
            return self.draft_block(anchor, start, context, cache, length, cfg.steps, sampler)

        args = (self.target, cache_len, sampler, draft, drafting.new_cache(cache_len),
                self.drafter.config.target_layer_ids, pace)
        if tree:
            lookup = NgramIndex(ids) if cfg.lookup else None
            return TreeStep(*args, max_nodes, lookup, self.drafter.corpus)
        return ChainStep(*args, max_new)

    def verify_mode(self, cfg: GenerationConfig, warnings: list[str] | None = None) -> str:
        """The verify mode a DFlash reply with `cfg` runs ("auto" resolved for this target)."""
        target = self.target
        mode = resolve_mode(cfg.verify, target.device, greedy=cfg.greedy,
                            tree_ok=target.supports_tree and cfg.steps == 1)
        if mode in TREE_MODES and not target.supports_tree:
            fallback = "full" if mode == "tree-full" else "adaptive"
            why = ("this hybrid target's recurrent (linear-attention) layers carry one state along a "
                   "sequence, so a pass cannot show each tree row only its own ancestors"
                   if target.hybrid else f"it needs the fast forward ({target.forward_note})")
            if warnings is not None:
                warnings.append(f"verify={mode!r} checks a tree, but {why}; verified as {fallback!r} instead")
            mode = fallback
        return mode

    def draft_block(self, anchor: int, start: int, context: torch.Tensor | None, cache: object, length: int,
                    steps: int, sampler: Sampler) -> Draft:
        """The drafter's proposal for positions 1..length-1 of the block at `start` (tests force drafts here)."""
        assert self.drafting is not None
        return self.drafting(anchor, start, context, cache, length, steps, sampler)

    # ----- pass costs -----

    def verify_cost_for(self, block: int, upto: int | None = None, tree: bool = False) -> VerifyCost:
        """The target's measured pass times (`tree`: of tree passes), covering blocks up to at
        least `block` tokens (measured on first use, up to `upto` tokens: a few seconds; kept on
        the target for every engine; beyond the table the cost follows its last segment's slope)."""
        if self.pinned_costs is not None:
            return self.pinned_costs.tree if tree else self.pinned_costs.chain
        kind = "tree" if tree else "chain"
        cost = self.target.measured_costs.get(kind)
        if cost is None or cost.sizes[-1] < block:
            layer_ids = None if self.drafter is None else self.drafter.config.target_layer_ids
            cost = measure_verify_cost(self.target, layer_ids, max(block, upto or block, 16), tree=tree)
            self.target.measured_costs[kind] = cost
        return cost

    def cost_table(self, mode: str, block: int) -> VerifyCost | None:
        """The pass times a verify `mode` sizes its blocks with at block size `block` (None for
        the modes that verify everything): chain passes up to the block, tree passes up to the
        largest tree. launch.py calls it before the first reply, which then need not measure."""
        if mode == "adaptive":
            return self.verify_cost_for(block)
        if mode == "tree":
            return self.verify_cost_for(block, upto=max_tree_nodes(block, sized=True) + 1, tree=True)
        return None

    # ----- prompts -----

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """A string (one user turn), a list of chat messages, or token ids."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise DFlashError("the prompt is empty")
            return self.target.encode_chat([{"role": "user", "content": prompt}])
        prompt = list(prompt)
        if not prompt:
            raise DFlashError("the prompt is empty")
        if all(isinstance(t, int) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.target.vocab_size]
            if bad:
                raise DFlashError(f"token ids {bad[:5]} are outside the vocabulary (0..{self.target.vocab_size - 1})")
            return list(prompt)
        for m in prompt:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise DFlashError(f"chat messages must be {{'role': ..., 'content': ...}} dicts, got {m!r}")
        if not any(str(m["content"]).strip() for m in prompt):
            raise DFlashError("the prompt is empty")
        return self.target.encode_chat(list(prompt))

    # ----- events -----

    def _event(self, index: int, start: int, result: BlockResult, committed: list[int], out: list[int]) -> BlockEvent:
        target, lookup = self.target, result.lookup
        draft = result.steps[-1].tokens if result.steps else []
        return BlockEvent(
            index=index, start=start, steps=result.steps, draft=draft, accepted=result.accepted,
            target_token=result.tokens[-1], committed=committed, draft_ms=result.draft_ms,
            verify_ms=result.verify_ms, tokens_so_far=len(out), text=target.decode(out),
            committed_text=target.token_strings(committed), draft_text=target.token_strings(draft),
            verified=result.verified, tree_nodes=result.tree_nodes,
            lookup_nodes=None if lookup is None else lookup[0], lookup_accepted=None if lookup is None else lookup[1],
            tree=result.tree, selector=self._selector(result),
        )

    def _selector(self, result: BlockResult) -> list[SelectorChoice] | None:
        if result.choices is None:
            return None
        texts = iter(self.target.token_strings([t for ids, _, _ in result.choices for t in ids]))
        return [SelectorChoice(ids, [next(texts) for _ in ids], [round(p, 4) for p in probs], chosen)
                for ids, probs, chosen in result.choices]


class _Stopper:
    """Commits tokens and cuts them exactly where plain decoding would have stopped."""

    def __init__(self, target: Target, max_new: int, length_reason: str, stop: tuple[str, ...]) -> None:
        self.target, self.eos, self.max_new, self.length_reason, self.stop = (
            target, target.eos_ids, max_new, length_reason, stop)

    def commit(self, out: list[int], new: list[int]) -> tuple[list[int], str | None]:
        """Append `new` to `out` up to the first stop; return the tokens kept and why it stopped, if it did."""
        before = len(out)
        reason = None
        for t in new:
            out.append(t)
            if t in self.eos:
                reason = "eos"
                break
            if len(out) >= self.max_new:
                reason = self.length_reason
                break
        if self.stop and any(s in self.target.decode(out) for s in self.stop):
            # Keep the shortest reply that contains a stop string, as token-by-token decoding would.
            k = before + 1
            while not any(s in self.target.decode(out[:k]) for s in self.stop):
                k += 1
            del out[k:]
            reason = "stop"
        return out[before:], reason


@dataclass
class _Tally:
    prompt_tokens: int
    prefill_s: float
    t0: float
    warnings: list[str]
    verify_s: float = 0.0
    blocks: int = 0

    def __post_init__(self) -> None:
        self.accepted: list[int] = []

    def add(self, result: BlockResult) -> None:
        self.verify_s += result.verify_ms / 1e3
        self.blocks += 1
        if result.drafted:
            self.accepted.append(result.accepted)

    def finish(self, reason: str, ids: list[int], target: Target, stop: tuple[str, ...], draft_s: float) -> Finished:
        elapsed = time.perf_counter() - self.t0
        text = target.decode(ids)
        for s in stop:
            if s in text:
                text = text[: text.index(s)]
        return Finished(
            reason=reason, token_ids=ids, text=text, prompt_tokens=self.prompt_tokens, blocks=self.blocks,
            tau=tau(self.accepted), elapsed_s=elapsed, tokens_per_s=len(ids) / elapsed if elapsed > 0 else 0.0,
            draft_s=draft_s, verify_s=self.verify_s, prefill_s=self.prefill_s, warnings=self.warnings,
        )
