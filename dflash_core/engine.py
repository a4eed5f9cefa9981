"""The decoding loop: draft (1..S denoising steps) → verify → accept → emit a BlockEvent.

Plain autoregressive decoding runs through the same interface and is the baseline that
every comparison uses. Both loops keep one preallocated KV cache per model and roll back
rejected tokens by moving a length.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from . import kernels
from .config import TREE_MODES, GenerationConfig
from .draft_tree import BRANCHING, CALIBRATION, DraftTree, grow_tree, max_tree_nodes, visibility, walk
from .drafter import DFlashDrafter, check_fit
from .errors import DFlashError
from .events import BlockEvent, DraftStep, Finished
from .fast_forward import Linear, pack_weight
from .lookup import LookupRates, NgramIndex, with_lookup
from .targets import Target
from .verify import draw_uniforms, greedy_accept, greedy_choice, logits_to_probs, sample, speculative_accept
from .verify_length import (
    VerifyCost,
    choose_prefix,
    choose_verify_length,
    measure_verify_cost,
    next_draft_length,
    resolve_mode,
)

Prompt = str | Sequence[dict[str, str]] | Sequence[int]
Event = BlockEvent | Finished
CancelFlag = threading.Event | Callable[[], bool] | None


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


def unmask_schedule(n_masked: int, steps: int) -> list[int]:
    """How many positions are final after each denoising step: evenly spread, all at the end."""
    return [math.ceil(s * n_masked / steps) for s in range(1, steps + 1)]


def _cancelled(flag: CancelFlag) -> bool:
    if flag is None:
        return False
    return flag.is_set() if isinstance(flag, threading.Event) else bool(flag())


class Engine:
    """A target with an optional DFlash drafter. `generate` yields events, then a `Finished`."""

    def __init__(self, target: Target, drafter: DFlashDrafter | None = None) -> None:
        self.target = target
        self.drafter = drafter
        self.warnings: list[str] = []  # load-time notes for the user (e.g. an untrained drafter)
        self.drafter_name = "none" if drafter is None else "custom"
        if drafter is not None:
            check_fit(drafter.config, hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                      num_layers=target.num_layers)
            drafter.to(device=target.device, dtype=target.dtype).eval()
        self._draft_head = self._draft_vocab_head()

    def verify_cost_for(self, block: int, upto: int | None = None, tree: bool = False) -> VerifyCost:
        """The target's measured pass times (`tree`: of tree passes), covering blocks up to at
        least `block` tokens (measured on first use, up to `upto` tokens: a few seconds; kept on
        the target for every engine; beyond the table the cost follows its last segment's slope)."""
        cost = self.target.tree_cost if tree else self.target.verify_cost
        if cost is None or cost.sizes[-1] < block:
            layer_ids = None if self.drafter is None else self.drafter.config.target_layer_ids
            cost = measure_verify_cost(self.target, layer_ids, max(block, upto or block, 16), tree=tree)
            if tree:
                self.target.tree_cost = cost
            else:
                self.target.verify_cost = cost
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

    def _draft_vocab_head(self) -> tuple[torch.Tensor, Linear] | None:
        """(token ids, their LM-head rows as a layer, packed like the target's) when the
        drafter drafts from a vocabulary subset (`DFLASH_DRAFT_VOCAB=0` turns it off: draft over
        the whole vocabulary)."""
        vocab = None if self.drafter is None else self.drafter.draft_vocab
        if vocab is None or os.environ.get("DFLASH_DRAFT_VOCAB", "1") == "0":
            return None
        weight, bias = self.target.lm_head_rows(vocab)
        fast = self.target.fast_path
        packed = pack_weight(weight) if fast is not None and (fast.packed or fast.invariant) else None
        return vocab.to(weight.device), Linear(weight, bias, packed)

    def _draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 drafter logits [n, Vd] over the draft vocabulary (all V tokens without one).
        Drafts (greedy or sampled) come only from it; softmax, sampling and q stay that small."""
        if self._draft_head is None:
            return self.target.lm_head(hidden).float()
        return self._draft_head[1](hidden).float()

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

    # ----- the public loop -----

    def generate(self, prompt: Prompt, config: GenerationConfig | None = None, *, plain: bool = False,
                 cancel: CancelFlag = None) -> Iterator[Event]:
        """Yield one BlockEvent per block (per token when `plain`), then a Finished."""
        config = config or GenerationConfig()
        if not plain and self.drafter is None:
            raise DFlashError("DFlash decoding needs a drafter; load one or use plain decoding")
        ids = self.prompt_ids(prompt)
        ctx = self.target.max_context
        if len(ids) >= ctx:
            raise DFlashError(f"the prompt has {len(ids)} tokens but the target's context window is {ctx}; "
                              "shorten the prompt or the conversation")
        return self._run(ids, config, plain, cancel)

    def _run(self, ids: list[int], cfg: GenerationConfig, plain: bool, cancel: CancelFlag) -> Iterator[Event]:
        target = self.target
        dev = target.device
        warnings: list[str] = []
        max_new = cfg.max_new_tokens
        room = target.max_context - len(ids)
        if max_new > room:
            warnings.append(f"max_new_tokens lowered from {max_new} to {room} to fit the context window")
            max_new = room
        stopper = _Stopper(target, target.eos_ids, max_new, "context" if max_new == room else "length", cfg.stop)
        block = 1 if plain else (cfg.block_size or self.drafter.block_size)
        mode = None if plain else resolve_mode(cfg.verify, dev, greedy=cfg.greedy,
                                               tree_ok=target.supports_tree and cfg.steps == 1)
        if mode in TREE_MODES and not target.supports_tree:
            fallback = "full" if mode == "tree-full" else "adaptive"
            warnings.append(f"verify={mode!r} needs the lean forward ({target.fast_path_note}); "
                            f"verified as {fallback!r}")
            mode = fallback
        tree_mode = mode in TREE_MODES
        adaptive = mode in ("adaptive", "tree")
        tree_cap = max_tree_nodes(block, sized=adaptive)
        cost = None if mode is None else self.cost_table(mode, block)
        cache_len = len(ids) + max_new + max(block, tree_cap + 1 if tree_mode else 0) + 1
        tcache = target.new_cache(cache_len)
        gen = torch.Generator(device=dev).manual_seed(cfg.seed)
        layer_ids = None if plain else self.drafter.config.target_layer_ids
        draft_len = block  # adaptive: drafts only as far as recent blocks were worth verifying
        verified: list[int] = []
        t0 = time.perf_counter()

        logits, feats = target.forward(torch.tensor([ids], device=dev), tcache, layer_ids, last_only=plain)
        first = int(self._choose(logits[-1:], cfg, gen)[0])
        prefill_s = time.perf_counter() - t0
        out: list[int] = []
        state = _Tally(prompt_tokens=len(ids), prefill_s=prefill_s, t0=t0, warnings=warnings)
        kept, reason = stopper.commit(out, [first])
        # Tree modes may add lookup guesses to the drafter's candidates (lookup.py, corpus.py).
        ngrams = NgramIndex(ids + out) if tree_mode and cfg.lookup else None
        rates = LookupRates()
        yield self._event(0, len(ids), None, 0, first, kept, 0.0, prefill_s * 1e3, out)

        dcache = None if plain else self.drafter.new_cache(cache_len)
        # On CUDA the accept step runs as Triton kernels that also write the committed tokens into
        # a device-side buffer at a device-side length: the block's one sync then reads them too.
        fused = not plain and kernels.use_triton(dev)
        if fused:
            committed_dev = torch.zeros(max_new + block + 1, dtype=torch.long, device=dev)
            committed_len = torch.zeros(1, dtype=torch.long, device=dev)
            n_committed = 0  # the host's copy of committed_len, learnt at each block's sync
        pending = None if feats is None else feats[None]  # features the drafter has not seen yet
        start = len(ids)  # position of the anchor: the newest committed token, not yet in tcache
        index = 0
        while True:
            if reason is None and _cancelled(cancel):
                reason = "cancelled"
            if reason is not None:
                yield state.finish(reason, out, target, cfg.stop)
                return
            index += 1
            anchor = out[-1]
            if plain:
                t1 = time.perf_counter()
                logits, _ = target.forward(torch.tensor([[anchor]], device=dev), tcache)
                tok = int(self._choose(logits, cfg, gen)[0])
                verify_ms = (time.perf_counter() - t1) * 1e3
                state.verify_s += verify_ms / 1e3
                state.blocks += 1
                kept, reason = stopper.commit(out, [tok])
                yield self._event(index, start, None, 0, tok, kept, 0.0, verify_ms, out)
                start += 1
                continue
            t1 = time.perf_counter()
            draft = self.draft_block(anchor, start, pending, dcache, draft_len, cfg, gen)
            if tree_mode:
                tree = self._draft_tree(draft, tree_cap)
                guess_n, guess = 0, []
                if ngrams is not None:
                    tree, (guess_n, guess) = with_lookup(tree, ngrams, rates, block - 1,
                                                          corpus=self.drafter.corpus)
                tree = tree.prefix(tree_cap)
                if cost is not None:  # as many candidates as pay for their share of the pass
                    draft_ms = (state.draft_s + time.perf_counter() - t1) * 1e3 / (state.blocks + 1)
                    tree = tree.prefix(choose_prefix(tree.scores, cost, draft_ms))
                    verified.append(tree.drafter_depth)
                    draft_len = next_draft_length(verified, draft_len, block)
                t2 = time.perf_counter()
                rows, line, tok, feats = self._verify_tree(anchor, tree, tcache, layer_ids, cfg, gen)
                acc = len(rows) - 1
                t3 = time.perf_counter()
                pending = feats[None]
                state.draft_s += t2 - t1
                state.verify_s += t3 - t2
                state.blocks += 1
                state.accepted.append(acc)
                shown = self._walked_draft(tree, line, draft)
                new = [*shown.tokens[:acc].tolist(), tok]
                kept, reason = stopper.commit(out, new)
                if ngrams is not None:
                    rates.update(guess_n, guess, new)
                    ngrams.extend(kept)
                looked = (sum(tree.from_lookup), sum(tree.is_lookup(i) for i in line[:acc]))
                yield self._event(index, start, shown, acc, tok, kept, (t2 - t1) * 1e3, (t3 - t2) * 1e3,
                                  out, verified=len(line), tree_nodes=len(tree), lookup=looked)
                start += acc + 1
                continue
            tokens, q = draft.tokens, draft.q
            if cost is not None and draft.confidence is not None:  # verify only the promising prefix
                draft_ms = (state.draft_s + time.perf_counter() - t1) * 1e3 / (state.blocks + 1)  # mean so far
                m = choose_verify_length(draft.confidence.tolist(), cost, draft_ms)
                tokens, q = tokens[:m], None if q is None else q[:m]
                verified.append(m)
                draft_len = next_draft_length(verified, draft_len, block)
            t2 = time.perf_counter()
            block_ids = torch.cat([torch.tensor([anchor], device=dev), tokens]).unsqueeze(0)
            logits, feats = target.forward(block_ids, tcache, layer_ids)
            if cfg.greedy:
                if fused:
                    acc_t, tok_t = kernels.greedy_accept_triton(tokens, logits, committed_dev, committed_len)
                else:
                    acc_t, tok_t = greedy_accept(tokens, logits)
            else:
                p = logits_to_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)
                if fused:  # the same uniforms speculative_accept would draw: same tokens for a seed
                    u = draw_uniforms(len(tokens), gen, dev)
                    acc_t, tok_t = kernels.speculative_accept_triton(tokens, q, p, u, committed_dev, committed_len)
                else:
                    acc_t, tok_t = speculative_accept(tokens, q, p, gen)
            if fused:
                window = committed_dev[n_committed : n_committed + len(tokens) + 1]
                acc, tok, *written = torch.cat([acc_t[None], tok_t[None], window]).tolist()  # the block's one sync
                new = written[: acc + 1]
                n_committed += acc + 1
            else:
                acc, tok, *drafted = torch.cat([acc_t[None], tok_t[None], tokens]).tolist()  # one sync
                new = [*drafted[:acc], tok]
            t3 = time.perf_counter()
            tcache.truncate(start + acc + 1)
            pending = feats[None, : acc + 1]
            state.draft_s += t2 - t1
            state.verify_s += t3 - t2
            state.blocks += 1
            state.accepted.append(acc)
            kept, reason = stopper.commit(out, new)
            yield self._event(index, start, draft, acc, tok, kept, (t2 - t1) * 1e3, (t3 - t2) * 1e3, out,
                              verified=len(tokens))
            start += acc + 1

    # ----- tree verification -----

    @staticmethod
    def _draft_tree(draft: Draft, max_nodes: int) -> DraftTree:
        """The candidates of a block, best first. A draft without top-k candidates (a test's
        forced draft) is a chain: one candidate per position."""
        if draft.top is None:
            toks, probs = draft.tokens.tolist(), draft.probs.tolist()
            return grow_tree([[p**CALIBRATION] for p in probs], [[t] for t in toks], max_nodes)
        top_p, top_i = draft.top
        return grow_tree(top_p.pow(CALIBRATION).tolist(), top_i.tolist(), max_nodes)

    @staticmethod
    def _walked_draft(tree: DraftTree, line: list[int], draft: Draft) -> Draft:
        """What a tree block shows: the line the target walked (all verified), then the drafter's
        first choices at the deeper drafted positions (not verified), as one denoising step."""
        tokens = [tree.tokens[i] for i in line]
        # Each walked token's own probability: a node's score over its parent's (the drafter's
        # probability, or a lookup guess's running rate where that was higher; both calibrated,
        # see draft_tree.CALIBRATION and lookup.CALIBRATION).
        probs = [tree.scores[i] / max(tree.scores[tree.parents[i]], 1e-30) if tree.parents[i] >= 0
                 else tree.scores[i] for i in line]
        tokens += draft.tokens[len(line):].tolist()
        probs += draft.probs[len(line):].tolist()
        t, p = torch.tensor(tokens, dtype=torch.long), torch.tensor(probs)
        return Draft(tokens=t, probs=p, q=None, steps=[(t, p, torch.ones(len(tokens), dtype=torch.bool))])

    def _verify_tree(self, anchor: int, tree: DraftTree, tcache: object, layer_ids: list[int] | None,
                     cfg: GenerationConfig, gen: torch.Generator) -> tuple[list[int], list[int], int, torch.Tensor]:
        """One target pass over [anchor, tree]; the target's own choice at every node (argmax, or
        a draw from its distribution) decides the walk. Keeps the accepted rows in the cache.
        Returns the kept rows (0 = the anchor), the walked line (accepted nodes, then the
        best-scored nodes below), the target's token after the accepted nodes, and the kept
        rows' features."""
        dev = self.target.device
        ids = torch.tensor([[anchor, *tree.tokens]], device=dev)
        depths = torch.tensor([0, *tree.depths], device=dev)
        start = tcache.length
        logits, feats = self.target.tree_forward(ids, depths, visibility(tree, dev), tcache, layer_ids)
        if cfg.greedy:
            choice = greedy_choice(logits)
        else:  # one draw per node; only the walked nodes' draws are used, each exactly the target's
            choice = sample(logits_to_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p), gen)
        path, tok = walk(tree, choice.tolist())  # the block's one sync
        rows = [0, *(i + 1 for i in path)]
        tcache.keep_rows(start, rows)
        line = path + tree.main_line(path[-1] if path else -1)
        return rows, line, tok, feats[rows]

    # ----- drafting -----

    @torch.inference_mode()
    def draft_block(self, anchor: int, start: int, pending: torch.Tensor | None, dcache: object,
                    block: int, cfg: GenerationConfig, gen: torch.Generator) -> Draft:
        """Denoise positions 1..B-1 of the block that starts with `anchor` at `start`.

        Step 1 sees the block fully masked (DFlash as published). With more steps, each step
        re-predicts the still-masked positions and fixes some of them for good: greedy fixes
        the most confident first; sampling fixes left to right, because fixing a position
        after (and dependent on) a later one would bias the speculative sampling test.
        """
        drafter, target = self.drafter, self.target
        assert drafter is not None
        dev = target.device
        vocab = None if self._draft_head is None else self._draft_head[0]
        n = block - 1
        steps = min(cfg.steps, n)
        tokens = torch.full((block,), drafter.mask_token_id, device=dev, dtype=torch.long)
        tokens[0] = anchor
        chosen_p = torch.zeros(n, device=dev)
        q_sub = None  # the proposal rows, over the draft vocabulary, of the positions fixed so far
        fixed = torch.zeros(n, dtype=torch.bool, device=dev)
        history = []
        confidence = None
        top = None
        new_context = pending
        done = 0
        for n_fixed in unmask_schedule(n, steps):
            hidden = drafter.step(target.embed(tokens[None]), start, dcache, new_context)
            new_context = None  # the context is cached after the first step
            logits = self._draft_logits(hidden[0, 1:])
            if cfg.greedy:
                probs = torch.softmax(logits, -1)
                conf, pick = probs.max(-1)
                order = torch.where(fixed, float("-inf"), conf)  # most confident unfixed first
            else:
                probs = logits_to_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)
                pick = sample(probs, gen)
                conf = probs.gather(-1, pick[:, None])[:, 0]
                order = torch.where(fixed, float("-inf"), -torch.arange(n, device=dev, dtype=torch.float))
            if confidence is None:  # first step, before any token is drawn (see verify_length)
                confidence = conf if cfg.greedy else probs.max(-1).values
                top_p, top_i = probs.topk(min(BRANCHING, probs.shape[-1]), -1)
                top = (top_p, top_i if vocab is None else vocab[top_i])
            guess = pick if vocab is None else vocab[pick]
            guess = torch.where(fixed, tokens[1:], guess)
            conf = torch.where(fixed, chosen_p, conf)
            newly = torch.zeros_like(fixed)
            newly[torch.topk(order, n_fixed - done).indices] = True
            newly &= ~fixed
            done = n_fixed
            tokens[1:] = torch.where(newly, guess, tokens[1:])
            chosen_p = torch.where(newly, conf, chosen_p)
            if not cfg.greedy:  # each row: q of the step that fixed its position (step 1 fills them all first)
                q_sub = probs if q_sub is None else torch.where(newly[:, None], probs, q_sub)
            fixed = fixed | newly
            history.append((guess.clone(), conf.clone(), fixed.clone()))
        q = None
        if q_sub is not None:  # the accept rule reads q over the whole vocabulary
            q = q_sub if vocab is None else q_sub.new_zeros(n, target.vocab_size).index_copy_(1, vocab, q_sub)
        return Draft(tokens=tokens[1:].clone(), probs=chosen_p, q=q, steps=history, confidence=confidence, top=top)

    # ----- helpers -----

    @staticmethod
    def _choose(logits: torch.Tensor, cfg: GenerationConfig, gen: torch.Generator) -> torch.Tensor:
        if cfg.greedy:
            return greedy_choice(logits)
        return sample(logits_to_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p), gen)

    def _event(self, index: int, start: int, draft: Draft | None, accepted: int, token: int,
               committed: list[int], draft_ms: float, verify_ms: float, out: list[int],
               verified: int | None = None, tree_nodes: int | None = None,
               lookup: tuple[int, int] | None = None) -> BlockEvent:
        target = self.target
        steps: list[DraftStep] = []
        draft_ids: list[int] = []
        if draft is not None:
            # One transfer for the whole block's history.
            packed = torch.stack([torch.stack([t.float(), p.float(), f.float()]) for t, p, f in draft.steps])
            for t, p, f in packed.tolist():
                steps.append(DraftStep(tokens=[int(x) for x in t], probs=p, fixed=[bool(x) for x in f]))
            draft_ids = steps[-1].tokens
        return BlockEvent(
            index=index, start=start, steps=steps, draft=draft_ids, accepted=accepted, target_token=token,
            committed=committed, draft_ms=draft_ms, verify_ms=verify_ms, tokens_so_far=len(out),
            text=target.decode(out), committed_text=target.token_strings(committed),
            draft_text=target.token_strings(draft_ids), verified=verified, tree_nodes=tree_nodes,
            lookup_nodes=None if lookup is None else lookup[0], lookup_accepted=None if lookup is None else lookup[1],
        )


class _Stopper:
    """Commits tokens and cuts them exactly where plain decoding would have stopped."""

    def __init__(self, target: Target, eos: set[int], max_new: int, length_reason: str,
                 stop: tuple[str, ...]) -> None:
        self.target, self.eos, self.max_new, self.length_reason, self.stop = target, eos, max_new, length_reason, stop

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
    draft_s: float = 0.0
    verify_s: float = 0.0
    blocks: int = 0

    def __post_init__(self) -> None:
        self.accepted: list[int] = []

    def finish(self, reason: str, ids: list[int], target: Target, stop: tuple[str, ...]) -> Finished:
        elapsed = time.perf_counter() - self.t0
        text = target.decode(ids)
        for s in stop:
            if s in text:
                text = text[: text.index(s)]
        tau = sum(a + 1 for a in self.accepted) / len(self.accepted) if self.accepted else 1.0
        return Finished(
            reason=reason, token_ids=ids, text=text, prompt_tokens=self.prompt_tokens, blocks=self.blocks,
            tau=tau, elapsed_s=elapsed, tokens_per_s=len(ids) / elapsed if elapsed > 0 else 0.0,
            draft_s=self.draft_s, verify_s=self.verify_s, prefill_s=self.prefill_s, warnings=self.warnings,
        )
