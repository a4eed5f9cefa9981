"""One block of decoding, three ways: plain (one token), chain (draft → verify → accept a prefix)
and tree (several candidates per position, verified in one pass). Each step owns its caches and
returns a `BlockResult`; the engine commits it and tells the step what was kept."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import kernels
from .corpus import CorpusNgrams
from .draft_tree import DRAFTER_CALIBRATION, DraftTree, grow_tree, visibility, walk
from .drafting import Draft
from .events import CandidateTree, DraftStep, TreeNode
from .lookup import LookupRates, NgramIndex, with_lookup
from .targets import Target
from .verify import Sampler, draw_uniforms
from .verify_length import Pace, chain_scores

DraftFn = Callable[[int, int, "torch.Tensor | None", object, int], Draft]  # (anchor, start, context, cache, length)


@dataclass
class BlockResult:
    """What one block proposes to commit, and what it showed and cost."""

    tokens: list[int]  # the accepted drafts, then the target's own token
    steps: list[DraftStep] = field(default_factory=list)  # what the view shows (a tree block: the walked line)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    verified: int | None = None  # candidates the target checked
    tree_nodes: int | None = None
    lookup: tuple[int, int] | None = None  # (lookup nodes in the tree, of them accepted)
    tree: CandidateTree | None = None  # a tree block's candidates, as plain data
    # DFlash 2: per drafted position, (candidate ids, their probabilities, the chosen index)
    choices: list[tuple[list[int], list[float], int]] | None = None

    @property
    def accepted(self) -> int:
        return len(self.tokens) - 1

    @property
    def drafted(self) -> bool:
        """A drafted block (not a plain step, nor a step taken while drafting rests)."""
        return bool(self.steps)


class PlainStep:
    """Plain autoregressive decoding: one target pass per token, the baseline."""

    layer_ids: list[int] | None = None  # the target layers whose features the drafter reads

    def __init__(self, target: Target, cache_len: int, sampler: Sampler, rollback: int = 0) -> None:
        self.target, self.sampler = target, sampler
        self.cache = target.new_cache(cache_len, rollback)  # passes of `rollback` tokens may be cut back

    def prefill(self, ids: list[int]) -> int:
        """Run the prompt through the target; its first token. Only the last row goes through the
        LM head, with features or without: plain and DFlash replies start from the same logits, and
        a long conversation's prompt rows cost no head GEMM whose logits nothing reads."""
        logits, feats = self.target.forward(torch.tensor([ids], device=self.target.device), self.cache,
                                            self.layer_ids, last_only=True)
        self.context = None if feats is None else feats[None]  # features the drafter has not seen yet
        return int(self.sampler.choose(logits[-1:])[0])

    def block(self, anchor: int, start: int) -> BlockResult:
        t0 = time.perf_counter()
        logits, _ = self.target.forward(torch.tensor([[anchor]], device=self.target.device), self.cache)
        tok = int(self.sampler.choose(logits)[0])
        return BlockResult([tok], verify_ms=(time.perf_counter() - t0) * 1e3)

    def committed(self, result: BlockResult, kept: list[int]) -> None:
        """What the reply kept of `result` (less where it stopped)."""

    @property
    def draft_s(self) -> float:
        """The reply's drafting time so far."""
        return 0.0


class DraftingStep(PlainStep):
    """What chain and tree steps share: the drafter's side of a block, the `pace` that sizes it,
    and plain steps (that still give the drafter the target's features) while drafting rests."""

    def __init__(self, target: Target, cache_len: int, sampler: Sampler, draft: DraftFn, draft_cache: object,
                 layer_ids: list[int], pace: Pace, rollback: int = 0) -> None:
        super().__init__(target, cache_len, sampler, rollback)
        self.draft, self.draft_cache, self.layer_ids, self.pace = draft, draft_cache, layer_ids, pace

    @property
    def draft_s(self) -> float:
        return self.pace.draft_s  # summed once, where block sizing reads its running mean

    def resting_block(self, anchor: int) -> BlockResult:
        t0 = time.perf_counter()
        logits, feats = self.target.forward(torch.tensor([[anchor]], device=self.target.device), self.cache,
                                            self.layer_ids)
        tok = int(self.sampler.choose(logits)[0])
        self.context = feats[None] if self.context is None else torch.cat([self.context, feats[None]], 1)
        self.pace.rested()
        return BlockResult([tok], verify_ms=(time.perf_counter() - t0) * 1e3)


class ChainStep(DraftingStep):
    """DFlash as published: the target verifies one drafted chain (all of it, or the prefix
    `pace` finds worth a pass) and keeps the longest prefix its own rule accepts."""

    def __init__(self, target: Target, cache_len: int, sampler: Sampler, draft: DraftFn, draft_cache: object,
                 layer_ids: list[int], pace: Pace, max_new: int) -> None:
        super().__init__(target, cache_len, sampler, draft, draft_cache, layer_ids, pace, rollback=pace.block)
        # On CUDA the accept step runs as Triton kernels that also write the committed tokens into
        # a device-side buffer at a device-side length: the block's one sync then reads them too.
        self.fused = kernels.use_triton(target.device)
        if self.fused:
            self.committed_dev = torch.zeros(max_new + pace.block + 1, dtype=torch.long, device=target.device)
            self.committed_len = torch.zeros(1, dtype=torch.long, device=target.device)
            self.n_committed = 0  # the host's copy of committed_len, learnt at each block's sync

    def block(self, anchor: int, start: int) -> BlockResult:
        if self.pace.resting:
            result = self.resting_block(anchor)
            if self.fused:  # the device-side record of committed tokens stays whole
                self.committed_dev[self.n_committed] = result.tokens[0]
                self.committed_len += 1
                self.n_committed += 1
            return result
        t1 = time.perf_counter()
        draft = self.draft(anchor, start, self.context, self.draft_cache, self.pace.draft_length)
        tokens, q, depth = draft.tokens, draft.q, None
        if self.pace.cost is not None and draft.confidence is not None:  # verify only the promising prefix
            depth = self.pace.size(chain_scores(draft.confidence.tolist()), time.perf_counter() - t1)
            tokens, q = tokens[:depth], None if q is None else q[:depth]
        t2 = time.perf_counter()
        block_ids = torch.cat([torch.tensor([anchor], device=self.target.device), tokens]).unsqueeze(0)
        logits, feats = self.target.forward(block_ids, self.cache, self.layer_ids)
        if self.fused:
            new = self._accept_fused(tokens, q, logits)
        else:
            acc_t, tok_t = self.sampler.accept(tokens, q, logits)
            acc, tok, *drafted = torch.cat([acc_t[None], tok_t[None], tokens]).tolist()  # the block's one sync
            new = [*drafted[:acc], tok]
        t3 = time.perf_counter()
        self.cache.truncate(start + len(new))
        self.context = feats[None, : len(new)]
        self.pace.record(depth, t2 - t1, len(tokens), len(new))
        return BlockResult(new, draft.history(), (t2 - t1) * 1e3, (t3 - t2) * 1e3, verified=len(tokens),
                           choices=selector_choices(draft))

    def _accept_fused(self, tokens: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor) -> list[int]:
        s = self.sampler
        if s.greedy:
            acc_t, tok_t = kernels.greedy_accept_triton(tokens, logits, self.committed_dev, self.committed_len)
        else:  # the same uniforms Sampler.accept would draw: same tokens for a seed
            u = draw_uniforms(len(tokens), s.generator, self.target.device)
            acc_t, tok_t = kernels.speculative_accept_triton(tokens, q, s.probs(logits), u,
                                                             self.committed_dev, self.committed_len)
        window = self.committed_dev[self.n_committed : self.n_committed + len(tokens) + 1]
        acc, _tok, *written = torch.cat([acc_t[None], tok_t[None], window]).tolist()  # the block's one sync
        self.n_committed += acc + 1
        return written[: acc + 1]


class TreeStep(DraftingStep):
    """The target checks a tree of candidates in one pass: the drafter's likeliest tokens per
    position, prompt-lookup and n-gram guesses (`lookup`), as many as pay on this machine
    (`pace`), and walks it with its own choices (draft_tree.py explains why that is exact)."""

    def __init__(self, target: Target, cache_len: int, sampler: Sampler, draft: DraftFn, draft_cache: object,
                 layer_ids: list[int], pace: Pace, max_nodes: int, lookup: NgramIndex | None,
                 corpus: CorpusNgrams | None) -> None:
        super().__init__(target, cache_len, sampler, draft, draft_cache, layer_ids, pace)
        self.max_nodes, self.lookup, self.corpus = max_nodes, lookup, corpus
        self.rates = LookupRates()
        self.guess: tuple[int, list[int]] = (0, [])

    def block(self, anchor: int, start: int) -> BlockResult:
        if self.pace.resting:
            self.guess = (0, [])  # no lookup guess was made for this token
            return self.resting_block(anchor)
        t1 = time.perf_counter()
        draft = self.draft(anchor, start, self.context, self.draft_cache, self.pace.draft_length)
        tree = candidate_tree(draft, self.max_nodes)
        if self.lookup is not None:
            tree, self.guess = with_lookup(tree, self.lookup, self.rates, self.pace.block - 1, corpus=self.corpus,
                                           keep=self.max_nodes)
        depth = None
        if self.pace.cost is not None:  # as many candidates as pay for their share of the pass
            tree = tree.prefix(self.pace.size(tree.scores, time.perf_counter() - t1))
            depth = tree.drafter_depth
        t2 = time.perf_counter()
        rows, line, tok = self.verify(anchor, tree)
        t3 = time.perf_counter()
        shown = walked_step(tree, line, draft)
        acc = len(rows) - 1
        looked = (sum(tree.from_lookup), sum(tree.is_lookup(i) for i in line[:acc]))
        picture = self.picture(tree, line[:acc], tok, draft)
        self.pace.record(depth, t2 - t1, len(tree), len(rows))
        return BlockResult([*shown.tokens[:acc], tok], [shown], (t2 - t1) * 1e3, (t3 - t2) * 1e3,
                           verified=len(line), tree_nodes=len(tree), lookup=looked, tree=picture,
                           choices=selector_choices(draft))

    def picture(self, tree: DraftTree, walked: list[int], tok: int, draft: Draft) -> CandidateTree:
        """The checked tree as plain data for the block's event: what the app draws."""
        texts = dict(zip(tree.tokens, self.target.token_strings(tree.tokens), strict=True))
        ranked = drafter_ranks(draft)
        path = draft.tokens.tolist() if draft.selector is not None else []
        nodes: list[TreeNode] = []
        for i, (t, parent, depth, score) in enumerate(zip(tree.tokens, tree.parents, tree.depths, tree.scores,
                                                          strict=True)):
            prob, rank = ranked.get((depth, t), (None, None))
            on_path = depth <= len(path) and t == path[depth - 1] and (parent < 0 or nodes[parent].selector_path)
            nodes.append(TreeNode(parent, depth, t, texts[t], tree.source(i), score, prob, rank, on_path))
        return CandidateTree(nodes, list(walked), self.target.token_strings([tok])[0])

    def verify(self, anchor: int, tree: DraftTree) -> tuple[list[int], list[int], int]:
        """One target pass over [anchor, tree]; the target's own choice at every node (argmax, or
        a draw from its distribution) decides the walk. Keeps the accepted rows in the cache and
        their features as the drafter's next context. Returns the kept rows (0 = the anchor), the
        walked line (accepted nodes, then the best-scored nodes below) and the target's token
        after the accepted nodes."""
        dev = self.target.device
        ids = torch.tensor([[anchor, *tree.tokens]], device=dev)
        depths = torch.tensor([0, *tree.depths], device=dev)
        start = self.cache.length
        logits, feats = self.target.tree_forward(ids, depths, visibility(tree, dev), self.cache, self.layer_ids)
        # Sampling draws at every node; only the walked nodes' draws are used, each exactly the target's.
        path, tok = walk(tree, self.sampler.choose(logits).tolist())  # the block's one sync
        rows = [0, *(i + 1 for i in path)]
        self.cache.keep_rows(start, rows)
        self.context = feats[rows][None]
        return rows, path + tree.main_line(path[-1] if path else -1), tok

    def committed(self, result: BlockResult, kept: list[int]) -> None:
        if self.lookup is not None:
            self.rates.update(*self.guess, result.tokens)
            self.lookup.extend(kept)


def selector_choices(draft: Draft) -> list[tuple[list[int], list[float], int]] | None:
    """A DFlash 2 draft's candidates per position and the selector's pick, as plain data."""
    w = draft.selector
    if w is None:
        return None
    return list(zip(w.candidates.tolist(), w.probs.tolist(), w.chosen.tolist(), strict=True))


def candidate_tree(draft: Draft, max_nodes: int) -> DraftTree:
    """The candidates of a block, best first. A draft without top-k candidates (a test's forced
    draft) is a chain: one candidate per position. A DFlash 2 draft ranks each node's children
    after the node's own token, so its selector's path is the tree's main line."""
    if draft.top is None:
        toks, probs = draft.tokens.tolist(), draft.probs.tolist()
        return grow_tree([[p**DRAFTER_CALIBRATION] for p in probs], [[t] for t in toks], max_nodes)
    if draft.selector is not None:
        given = draft.selector.given.pow(DRAFTER_CALIBRATION)
        return grow_tree(given[:, 0].tolist(), draft.selector.ids.tolist(), max_nodes, given=given.tolist())
    top_p, top_i = draft.top
    return grow_tree(top_p.pow(DRAFTER_CALIBRATION).tolist(), top_i.tolist(), max_nodes)


def drafter_ranks(draft: Draft) -> dict[tuple[int, int], tuple[float, int]]:
    """(block position, token) -> the drafter's probability of it there and its rank (0: first
    choice), over the drafter's top-k candidates (its one choice per position without them)."""
    if draft.top is None:
        pairs = zip(draft.tokens.tolist(), draft.probs.tolist(), strict=True)
        return {(d, t): (p, 0) for d, (t, p) in enumerate(pairs, start=1)}
    top_p, top_i = draft.top
    out: dict[tuple[int, int], tuple[float, int]] = {}
    for d, (ps, ids) in enumerate(zip(top_p.tolist(), top_i.tolist(), strict=True), start=1):
        for r, (p, t) in enumerate(zip(ps, ids, strict=True)):
            out.setdefault((d, t), (p, r))
    return out


def walked_step(tree: DraftTree, line: list[int], draft: Draft) -> DraftStep:
    """What a tree block shows, as one denoising step: the line the target walked (all
    verified), then the drafter's first choices at the deeper drafted positions (not verified)."""
    tokens = [tree.tokens[i] for i in line]
    # Each walked token's own probability: a node's score over its parent's (the drafter's
    # calibrated probability, or a lookup guess's calibrated running rate where that was higher).
    probs = [tree.scores[i] / max(tree.scores[tree.parents[i]], 1e-30) if tree.parents[i] >= 0
             else tree.scores[i] for i in line]
    tokens += draft.tokens[len(line):].tolist()
    probs += draft.probs[len(line):].tolist()
    return DraftStep(tokens=tokens, probs=probs, fixed=[True] * len(tokens))
