"""How many draft tokens to send to the target: the whole block, or only the promising prefix.

On a GPU a 16-token verify pass costs about what a 1-token pass costs, so verifying the whole
block is free. On a CPU it is not: here a 16-token pass costs ~2.3 one-token passes, a 4-token
pass ~1.5. Then verifying draft tokens the drafter itself doubts is a loss, and the best length
changes from block to block with the drafter's confidence.

`choose_prefix` over `chain_scores` picks the number m of draft tokens that maximises the expected
tokens committed per second of the block's cycle,

    E(m) / (t_draft + t_verify(m + 1)),   E(m) = 1 + sum_{k<=m} prod_{j<=k} c_j,

where c_j is the drafter's first-step probability at position j (its confidence) and
t_verify(n) the measured cost of a target pass over n tokens (`VerifyCost`).

The drafted length adapts too (`next_draft_length`): drafting positions that will not be
verified costs drafter time, so the next block drafts a little past the longest prefix recently
worth verifying, and doubles when a whole drafted block was verified.

When drafted blocks do not pay at all (the drafter is often wrong on this text, or a pass costs
too much on this machine), `Pace` stops drafting for a while (`Pace.resting`): the step decodes
plain tokens, then drafts again to probe, resting twice as long each time the probe loses.

Why this stays exact: verification is unchanged; only fewer draft tokens reach it. Greedy
decoding commits the target's argmax whatever is verified. For speculative sampling the
choice must not depend on which tokens were drawn, or the accepted prefix would be biased;
c_j = max_v q_j(v) of the *first* denoising step is computed before any token is drawn, so
the length is fixed independently of the draws. Resting depends only on blocks already
committed: every token is still drawn from the target's distribution given the text before it.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .config import VERIFY_MODES
from .draft_tree import DraftTree, visibility

if TYPE_CHECKING:  # targets.py imports this module
    from .targets import Target

MIN_DRAFT_LENGTH = 4  # anchor + 3 drafts: a floor to grow back from; this short, the draft's fixed cost dominates
RECENT_BLOCKS = 8
TIMING_CONTEXT = 128  # tokens of context the verify passes are timed after
TIMING_REPEATS = 3
PAYING_WINDOW = 8  # drafted blocks judged together: one unlucky block is no verdict
LOSING = 0.9  # rest when the window committed under this share of plain steps' tokens in its time
FIRST_REST, LONGEST_REST = 8, 128  # plain tokens decoded while drafting rests


def resolve_mode(mode: str, device: torch.device | str, *, greedy: bool = False, tree_ok: bool = False) -> str:
    """"auto" is "full" on an accelerator, where a block's verify pass costs about one token's
    and a choice would only add a host round trip. On a CPU it is "tree" for greedy decoding
    where a tree pass can run (`tree_ok`: the fast forward, one denoising step), else
    "adaptive". Sampling keeps the chain: a tree's candidates are the drafter's top choices,
    not draws, so they can only be matched against the target's draw, which accepts less than
    speculative sampling of a chain (measured: τ 1.38 against 1.50 on GSM8K at T = 1)."""
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify mode must be one of {VERIFY_MODES}, got {mode!r}")
    if mode != "auto":
        return mode
    if torch.device(device).type != "cpu":
        return "full"
    return "tree" if greedy and tree_ok else "adaptive"


@dataclass(frozen=True)
class VerifyCost:
    """Measured target pass times (ms) at some token counts; linear in between and beyond."""

    sizes: tuple[int, ...]  # increasing, starting at 1
    ms: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.sizes or self.sizes[0] != 1 or list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"sizes must increase from 1, got {self.sizes}")
        if len(self.ms) != len(self.sizes) or any(m <= 0 for m in self.ms):
            raise ValueError("one positive time per size is needed")

    def __call__(self, n: int) -> float:
        """Time of a pass over n tokens (n >= 1)."""
        s, ms = self.sizes, self.ms
        if len(s) == 1:
            return ms[0] * n
        i = min(max(bisect_left(s, n), 1), len(s) - 1)  # the segment [s[i-1], s[i]] that holds n
        slope = (ms[i] - ms[i - 1]) / (s[i] - s[i - 1])
        return ms[i - 1] + slope * (n - s[i - 1])

    def relative(self) -> dict[int, float]:
        """Each measured size's time in one-token passes (what the README quotes)."""
        return {n: m / self.ms[0] for n, m in zip(self.sizes, self.ms, strict=True)}


def choose_prefix(scores: list[float], cost: VerifyCost, draft_ms: float) -> int:
    """The number n (1..len(scores)) of candidates worth verifying, where scores[i] is the chance
    that candidate i is accepted (a chain's prefix products, or a draft tree's node scores, best
    first): it maximises expected tokens per block time, (1 + sum of the first n scores) /
    (draft_ms + cost(n + 1))."""
    if not scores:
        raise ValueError("no draft tokens to choose from")
    best, best_rate, expected = 1, -1.0, 1.0
    for n, s in enumerate(scores, start=1):
        expected += min(max(s, 0.0), 1.0)
        rate = expected / (draft_ms + cost(n + 1))
        if rate > best_rate:
            best, best_rate = n, rate
    return best


def next_draft_length(verified: list[int], current: int, block: int) -> int:
    """The next block's drafted length (anchor included, MIN_DRAFT_LENGTH..block), from the
    numbers of draft tokens verified in the blocks so far (`current` = this block's length)."""
    if not verified:
        return block
    if verified[-1] >= current - 1:  # everything drafted was worth verifying: room to grow
        return min(block, 2 * current)
    return min(block, max(MIN_DRAFT_LENGTH, max(verified[-RECENT_BLOCKS:]) + 2))


def timed_sizes(max_tokens: int) -> list[int]:
    return [n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if n < max_tokens] + [max_tokens]


def timing_tree(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(depths [n], visible [n, n]) of an n-row tree pass to time: the anchor, then two
    interleaved lines (a main line and its alternatives, as best-first trees from a drafter's
    marginals mostly are), about n/2 deep."""
    parents = [-1 if i < 2 else i - 2 for i in range(n - 1)]  # node i's parent; -1: the anchor
    depths = [i // 2 + 1 for i in range(n - 1)]
    tree = DraftTree(list(range(n - 1)), parents, depths, [1.0] * (n - 1), [False] * (n - 1))
    return torch.tensor([0, *depths], device=device), visibility(tree, device)


@torch.inference_mode()
def measure_verify_cost(target: Target, layer_ids: list[int] | None, max_tokens: int,
                        tree: bool = False) -> VerifyCost:
    """Time the target's passes over 1..max_tokens tokens after a short context, as the engine
    calls them (with the drafter's feature layers; `tree`: tree passes, which may cost more
    than a chain of as many tokens). Sizes are interleaved over the repeats, so a change in the
    machine's load lands on all of them alike; the fastest repeat is kept. About 30 target
    passes: a few seconds for a small target on a CPU."""
    sizes = timed_sizes(max(1, max_tokens))
    dev = target.device
    vocab = target.vocab_size
    context = torch.arange(TIMING_CONTEXT, device=dev)[None] * 7919 % vocab
    cache = target.new_cache(TIMING_CONTEXT + max(sizes), rollback=max(sizes))
    target.forward(context, cache, layer_ids)
    shapes = {n: timing_tree(n, dev) for n in sizes} if tree else {}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(TIMING_REPEATS + 1):  # the first round warms up and is not kept
        for n in sizes:
            ids = context[:, :n]
            cache.truncate(TIMING_CONTEXT)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            if n in shapes:
                logits, _ = target.tree_forward(ids, *shapes[n], cache, layer_ids)
            else:
                logits, _ = target.forward(ids, cache, layer_ids)
            logits[-1, 0].item()  # wait for the pass, as the engine's block sync does
            if rep:
                times[n].append((time.perf_counter() - t0) * 1e3)
    ms = [min(times[n]) for n in sizes]  # the least disturbed pass: another job on the machine only adds
    # Timing noise must not make a longer pass look cheaper than a shorter one.
    for i in range(1, len(ms)):
        ms[i] = max(ms[i], ms[i - 1])
    return VerifyCost(tuple(sizes), tuple(ms))


@dataclass(frozen=True)
class PassCosts:
    """Pass times to size blocks with instead of measuring them on this machine: chain and tree
    pass tables and a drafting time per block. Tests pin one, so their verdicts never depend on
    how busy the machine is."""

    chain: VerifyCost
    tree: VerifyCost
    draft_ms: float
    rest: bool = False  # whether `Pace` may stop drafting (most tests keep every block drafted)


# Pass costs of the embedded target measured once on a 2-core AMD EPYC (bf16, 2 threads): what
# `bench --pinned-costs` sizes blocks with, so that drafters compare by tau whatever the load.
REFERENCE_CPU_COST = VerifyCost((1, 2, 4, 16, 32), (33.0, 36.0, 40.0, 52.0, 75.0))
REFERENCE_CPU_COSTS = PassCosts(chain=REFERENCE_CPU_COST, tree=REFERENCE_CPU_COST, draft_ms=6.0, rest=True)


class Pace:
    """Sizes one reply's blocks: how many candidates a block verifies (those that pay for their
    share of the pass, `choose_prefix`) and how far the next block drafts (`next_draft_length`).
    `cost` None verifies every drafted candidate; the drafting time is the reply's running mean
    unless `draft_ms` fixes it.

    With `rest`, it also stops drafting when the last `PAYING_WINDOW` drafted blocks committed
    under `LOSING` times the tokens plain steps (`cost(1)` each) would have in the blocks' time:
    the next `FIRST_REST` tokens are plain steps, then blocks are drafted again; a probe that
    loses doubles the rest (up to `LONGEST_REST`), one that pays resets it. A block's time is its
    drafting (as timed, or a fixed `draft_ms` with pinned costs, in tests) plus its pass's cost
    from `cost`, the same table the plain steps are judged by: a busy moment (a browser rendering
    on the same cores) slows plain steps as much as blocks, and timed blocks against a quiet
    table's `cost(1)` rested while blocks still paid."""

    def __init__(self, cost: VerifyCost | None, block: int, draft_ms: float | None = None,
                 rest: bool = True) -> None:
        self.cost, self.block, self.fixed_draft_ms = cost, block, draft_ms
        self.draft_length = block  # anchor included
        self.verified: list[int] = []
        self.draft_s, self.blocks = 0.0, 0
        self.rest = rest and cost is not None
        self.recent: list[tuple[int, float]] = []  # (tokens committed, ms) of the last drafted blocks
        self.resting, self.next_rest = 0, FIRST_REST

    def size(self, scores: list[float], drafting_s: float) -> int:
        """How many of the candidates, scored best first, to verify (all without a cost table);
        `drafting_s`: this block's drafting so far."""
        if self.cost is None:
            return len(scores)
        draft_ms = self.fixed_draft_ms
        if draft_ms is None:
            draft_ms = (self.draft_s + drafting_s) * 1e3 / (self.blocks + 1)
        return choose_prefix(scores, self.cost, draft_ms)

    def record(self, verified_depth: int | None, draft_s: float, verified: int = 0, committed: int = 0) -> None:
        """After a block: how deep its drafter candidates were verified (None: not sized), what
        its drafting cost, how many candidates the pass checked and how many tokens it committed."""
        self.draft_s += draft_s
        self.blocks += 1
        if verified_depth is not None and self.cost is not None:
            self.verified.append(verified_depth)
            self.draft_length = next_draft_length(self.verified, self.draft_length, self.block)
        if self.rest and self.cost is not None:
            draft_ms = draft_s * 1e3 if self.fixed_draft_ms is None else self.fixed_draft_ms
            ms = draft_ms + self.cost(verified + 1)
            self.recent = [*self.recent[1 - PAYING_WINDOW :], (committed, ms)]
            if len(self.recent) == PAYING_WINDOW:
                tokens, ms = sum(t for t, _ in self.recent), sum(m for _, m in self.recent)
                if tokens * self.cost(1) < LOSING * ms:  # plain steps would clearly have committed more
                    self.resting, self.recent = self.next_rest, []
                    self.next_rest = min(2 * self.next_rest, LONGEST_REST)
                else:
                    self.next_rest = FIRST_REST

    def rested(self) -> None:
        """A plain step was taken instead of a block."""
        self.resting -= 1


def chain_scores(confidence: list[float]) -> list[float]:
    """Each draft's chance of being accepted along with every draft before it."""
    chain, scores = 1.0, []
    for c in confidence:
        chain *= min(max(float(c), 0.0), 1.0)
        scores.append(chain)
    return scores
