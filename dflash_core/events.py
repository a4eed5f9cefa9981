"""What the engine tells the world: plain dataclasses of ints, floats and strings.

The UI and the benchmark read nothing else, so nothing here holds a tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


def tau(accepted: Iterable[int]) -> float:
    """Mean tokens committed per target forward: each block commits its accepted drafts plus
    the target's own token (1.0 for no blocks, as plain decoding)."""
    counts = [a + 1 for a in accepted]
    return sum(counts) / len(counts) if counts else 1.0


@dataclass
class DraftStep:
    """One denoising step of the drafter over the block's positions 1..B-1."""

    tokens: list[int]  # the drafter's choice at every position after this step
    probs: list[float]  # the drafter's probability of that choice
    fixed: list[bool]  # positions whose token is final after this step


SOURCES = ("drafter", "lookup", "ngram")  # who proposed a tree node (see TreeNode.source)


@dataclass
class TreeNode:
    """One candidate of a tree block, as the target checked it."""

    parent: int  # index of the parent node in CandidateTree.nodes; -1: the anchor
    depth: int  # block position, 1..B-1
    token: int
    text: str
    # "drafter": one of the drafter's top-k tokens at this position; "lookup": a prompt-lookup guess
    # (what followed the same tokens earlier in the text); "ngram": the drafter's n-gram table's guess
    source: str
    score: float  # the tree's estimate that the target walks through this node: why it was checked
    # The drafter's own probability of this token at this position and its rank there (0: its first
    # choice); None for a guess outside the drafter's top-k
    prob: float | None = None
    rank: int | None = None
    selector_path: bool = False  # DFlash 2: on the path the candidate selector walked (its chain)


@dataclass
class CandidateTree:
    """Every candidate a tree block's verify pass checked, and the target's walk through them."""

    nodes: list[TreeNode]  # best first: a parent always comes before its children
    walked: list[int]  # indices of the accepted nodes, from the anchor's child down
    target_text: str  # the target's own token after them (BlockEvent.target_token), decoded


@dataclass
class SelectorChoice:
    """DFlash 2, one drafted position: the candidate selector's top candidates there, best score
    first given the tokens it chose before, and the one it chose (the draft's token)."""

    tokens: list[int]
    texts: list[str]
    probs: list[float]  # softmax of the selector's scores over its candidates
    chosen: int  # index into tokens


@dataclass
class BlockEvent:
    """One draft → verify → accept cycle (or one plain decoding step, with no draft)."""

    index: int  # 0-based block number within the reply
    start: int  # position (in the whole sequence) of the block's first token, the anchor
    steps: list[DraftStep]  # empty for plain decoding and for the prefill token
    draft: list[int]  # final draft tokens for positions 1..B-1 (empty without a drafter)
    accepted: int  # how many draft tokens the target kept
    target_token: int  # token the target supplied: correction, bonus, or plain-decoding token
    committed: list[int]  # tokens this event added to the reply (accepted drafts + target token)
    draft_ms: float
    verify_ms: float
    tokens_so_far: int  # reply length after this event
    text: str  # decoded reply so far
    committed_text: list[str] = field(default_factory=list)  # one string per committed token
    draft_text: list[str] = field(default_factory=list)  # one string per draft token
    # How many draft tokens (a prefix of `draft`) the target checked; None: all of them. With the
    # adaptive verify length the rest were drafted but not worth a verify pass on this machine.
    verified: int | None = None
    # Tree verification (draft_tree.py): how many candidate tokens the target checked in the
    # block's pass. `draft` then starts with the line it walked (the accepted drafts, then the
    # best-scored candidates below the last one: the `verified` prefix), followed by the drafter's
    # first choices at deeper positions. None: a chain, `draft` as drafted.
    tree_nodes: int | None = None
    # Of those candidates, how many only prompt lookup proposed (lookup.py), and how many of the
    # accepted drafts were such guesses. None: a chain.
    lookup_nodes: int | None = None
    lookup_accepted: int | None = None
    # A tree block's candidates and the target's walk through them (what the app draws); None: a
    # chain, drawn from `draft`, `accepted` and `verified`.
    tree: CandidateTree | None = None
    # DFlash 2: each drafted position's candidates and the selector's choice; None: DFlash 1
    selector: list[SelectorChoice] | None = None

    @property
    def pass_tokens(self) -> int:
        """Tokens in the block's verify pass (the anchor included)."""
        return 1 + (self.checked if self.tree_nodes is None else self.tree_nodes)

    @property
    def checked(self) -> int:
        """Draft tokens the target verified."""
        return len(self.draft) if self.verified is None else self.verified

    @property
    def rejected(self) -> list[int]:
        """Verified draft tokens after the accepted prefix (the first one disagreed)."""
        return self.draft[self.accepted : self.checked]

    @property
    def unverified(self) -> list[int]:
        return self.draft[self.checked :]

    @property
    def is_draft_block(self) -> bool:
        return bool(self.draft)


@dataclass
class Finished:
    """The reply is complete. `reason` is one of: eos, stop, length, cancelled, context."""

    reason: str
    token_ids: list[int]
    text: str
    prompt_tokens: int
    blocks: int  # target forwards after the prefill
    tau: float  # mean committed tokens per draft block (accepted + 1); 1.0 for plain decoding
    elapsed_s: float
    tokens_per_s: float
    draft_s: float
    verify_s: float
    prefill_s: float
    warnings: list[str] = field(default_factory=list)
