"""The drafter's side of a block: denoise positions 1..B-1 from the anchor and the target's features."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .dflash2 import Walk
from .draft_tree import BRANCHING
from .drafter import DFlashDrafter
from .events import DraftStep
from .packing import Linear, pack_weight
from .targets import Target
from .verify import Sampler, sample


@dataclass
class Draft:
    """What the drafter proposes for positions 1..B-1 of a block."""

    tokens: torch.Tensor  # [B-1]
    probs: torch.Tensor  # [B-1] the drafter's probability of each token
    q: torch.Tensor | None  # [B-1, V] proposal distributions (sampling only)
    steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (tokens, probs, fixed) per step
    # [B-1] first-step max probability per position, which picks the verify length; None: verify all
    confidence: torch.Tensor | None = None
    # First-step top-k probabilities and token ids [B-1, k], the candidates of a draft tree
    top: tuple[torch.Tensor, torch.Tensor] | None = None
    selector: Walk | None = None  # DFlash 2: the candidate selector's walk (`tokens` is its path, `top` its rows)

    def history(self) -> list[DraftStep]:
        """The denoising steps as plain lists, for the block's event (one transfer for them all)."""
        packed = torch.stack([torch.stack([t.float(), p.float(), f.float()]) for t, p, f in self.steps])
        return [DraftStep(tokens=[int(x) for x in t], probs=p, fixed=[bool(x) for x in f])
                for t, p, f in packed.tolist()]


def unmask_schedule(n_masked: int, steps: int) -> list[int]:
    """How many positions are final after each denoising step: evenly spread, all at the end."""
    return [math.ceil(s * n_masked / steps) for s in range(1, steps + 1)]


class BlockDrafter:
    """Drafts blocks for one target. A drafter that ships a draft vocabulary drafts from those
    tokens' LM-head rows only (packed like the target's), so its softmax, sampling and q stay
    that small."""

    def __init__(self, drafter: DFlashDrafter, target: Target) -> None:
        self.drafter, self.target = drafter, target
        self.vocab: torch.Tensor | None = None
        self.head: Linear | None = None
        if drafter.draft_vocab is not None:
            weight, bias = target.lm_head_rows(drafter.draft_vocab)
            fast = target.fast_forward
            packed = pack_weight(weight) if fast is not None and (fast.packed or fast.invariant) else None
            self.vocab, self.head = drafter.draft_vocab.to(weight.device), Linear(weight, bias, packed)

    def new_cache(self, max_len: int) -> object:
        return self.drafter.new_cache(max_len)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [n, Vd] over the draft vocabulary (all V tokens without one)."""
        logits = (self.target.lm_head(hidden) if self.head is None else self.head(hidden)).float()
        return self.drafter.shape_logits(logits)

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Target token ids of indices into the draft vocabulary (the indices themselves without one)."""
        return index if self.vocab is None else self.vocab[index]

    def whole_vocab(self, q: torch.Tensor) -> torch.Tensor:
        """Proposal rows over the draft vocabulary as rows over the target's whole vocabulary,
        which the accept rule reads (zero outside the draft vocabulary)."""
        if self.vocab is None:
            return q
        return q.new_zeros(q.shape[0], self.target.vocab_size).index_copy_(1, self.vocab, q)

    @torch.inference_mode()
    def __call__(self, anchor: int, start: int, context: torch.Tensor | None, cache: object, length: int,
                 steps: int, sampler: Sampler) -> Draft:
        """Denoise positions 1..length-1 of the block that starts with `anchor` at `start`, after
        the target's features `context` of the positions the drafter has not seen yet.

        Step 1 sees the block fully masked (DFlash as published). With more steps, each step
        re-predicts the still-masked positions and fixes some of them for good: greedy fixes
        the most confident first; sampling fixes left to right, because fixing a position
        after (and dependent on) a later one would bias the speculative sampling test.
        """
        drafter, target = self.drafter, self.target
        dev = target.device
        n = length - 1
        tokens = torch.tensor([anchor] + [drafter.mask_token_id] * n, device=dev)
        if drafter.candidate_selector is not None:
            return self.walk(tokens, start, context, cache, sampler)
        if min(steps, n) == 1:
            return self.one_step(tokens, start, context, cache, sampler)
        chosen_p = torch.zeros(n, device=dev)
        q_sub = None  # the proposal rows, over the draft vocabulary, of the positions fixed so far
        fixed = torch.zeros(n, dtype=torch.bool, device=dev)
        history = []
        confidence = None
        top = None
        done = 0
        for n_fixed in unmask_schedule(n, min(steps, n)):
            hidden = drafter.step(target.embed(tokens[None]), start, cache, context)
            context = None  # the context is cached after the first step
            logits = self.logits(hidden[0, 1:])
            probs = torch.softmax(logits, -1) if sampler.greedy else sampler.probs(logits)
            if top is None:  # first step, before any token is drawn (see verify_length)
                top_p, top_i = probs.topk(min(BRANCHING, probs.shape[-1]), -1)
                top = (top_p, self.token_ids(top_i))
                confidence = top_p[:, 0]
                if sampler.greedy:
                    conf, pick = top_p[:, 0], top_i[:, 0]
            elif sampler.greedy:
                conf, pick = probs.max(-1)
            if not sampler.greedy:
                pick = sample(probs, sampler.generator)
                conf = probs.gather(-1, pick[:, None])[:, 0]
            guess = self.token_ids(pick)
            # greedy: the most confident unfixed first; sampling: left to right
            rank = conf if sampler.greedy else -torch.arange(n, device=dev, dtype=torch.float)
            order = torch.where(fixed, float("-inf"), rank)
            guess = torch.where(fixed, tokens[1:], guess)
            conf = torch.where(fixed, chosen_p, conf)
            newly = torch.zeros_like(fixed)
            newly[torch.topk(order, n_fixed - done).indices] = True
            newly &= ~fixed
            done = n_fixed
            tokens[1:] = torch.where(newly, guess, tokens[1:])
            chosen_p = torch.where(newly, conf, chosen_p)
            if not sampler.greedy:  # each row: q of the step that fixed its position (step 1 fills them all first)
                q_sub = probs if q_sub is None else torch.where(newly[:, None], probs, q_sub)
            fixed = fixed | newly
            history.append((guess, conf, fixed))  # fresh tensors each step: nothing changes them later
        q = None if q_sub is None else self.whole_vocab(q_sub)
        return Draft(tokens=tokens[1:].clone(), probs=chosen_p, q=q, steps=history, confidence=confidence, top=top)

    def one_step(self, tokens: torch.Tensor, start: int, context: torch.Tensor | None, cache: object,
                 sampler: Sampler) -> Draft:
        """DFlash as published: one pass fixes every position. Kept apart from the denoising loop
        in `__call__`, whose bookkeeping it does not need: a block's drafting Python runs cold after
        every target pass, where each call costs several times what it costs in a loop."""
        hidden = self.drafter.step(self.target.embed(tokens[None]), start, cache, context)
        logits = self.logits(hidden[0, 1:])
        probs = torch.softmax(logits, -1) if sampler.greedy else sampler.probs(logits)
        top_p, top_i = probs.topk(min(BRANCHING, probs.shape[-1]), -1)
        top_ids = self.token_ids(top_i)
        q = None
        if sampler.greedy:
            guess, conf = top_ids[:, 0], top_p[:, 0]
        else:
            pick = sample(probs, sampler.generator)
            guess, conf, q = self.token_ids(pick), probs.gather(-1, pick[:, None])[:, 0], self.whole_vocab(probs)
        fixed = torch.ones(len(guess), dtype=torch.bool, device=guess.device)
        return Draft(tokens=guess, probs=conf, q=q, steps=[(guess, conf, fixed)], confidence=top_p[:, 0],
                     top=(top_p, top_ids))

    def walk(self, tokens: torch.Tensor, start: int, context: torch.Tensor | None, cache: object,
             sampler: Sampler) -> Draft:
        """DFlash 2: one pass, then the path the candidate selector walks through each position's
        top-k (the engine refuses more denoising steps); trees read its walk (`selector`); when
        sampling, q is the selector's softmax on each position's candidates."""
        hidden = self.drafter.step(self.target.embed(tokens[None]), start, cache, context)[0, 1:]
        temperature = 0.0 if sampler.greedy else sampler.temperature
        w = self.drafter.candidate_selector.walk(hidden, self.logits(hidden), int(tokens[0]), self.vocab,
                                                  temperature, sampler.generator)
        chosen = w.probs.gather(1, w.chosen[:, None])[:, 0]
        q = None
        if w.q is not None:
            q = w.q.new_zeros(len(w.path), self.target.vocab_size).scatter_(1, w.candidates, w.q)
        return Draft(tokens=w.path, probs=chosen, q=q,
                     steps=[(w.path, chosen, torch.ones_like(w.path, dtype=torch.bool))],
                     confidence=w.probs[:, 0], top=(w.probs[:, :BRANCHING], w.candidates[:, :BRANCHING]),
                     selector=w)
