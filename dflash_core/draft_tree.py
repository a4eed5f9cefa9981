"""Tree verification: the target checks several draft candidates per position in one pass.

A DFlash drafter predicts every block position at once, so it gives a full distribution at
each position, not just one token. While the drafter is weak, its second or third choice is
often the target's: the shipped SmolLM2 drafter's first choice at position 1 is the target's
44 % of the time, one of its top four 67 %. A chain of B-1 drafts
wastes that; a tree spends the same verify tokens on the likeliest alternatives
(Medusa-style trees from parallel marginals, grown best-first by estimated probability as in
EAGLE-2's dynamic trees).

A node's score is the product of the drafter's calibrated probabilities along its path: its
estimate that the target walks through the node, so the sum of the scores of a tree is its
expected number of accepted drafts. The drafter's raw probabilities are a little overconfident
(measured on the shipped drafter, HumanEval and GSM8K prompts 6-20: a candidate
given 0.39 where its parent was walked was walked 31 % of the time, one given 0.81, 73 %), so
each is raised to the power `DRAFTER_CALIBRATION` first (0.39 -> 0.29, 0.81 -> 0.76); overrated nodes
would make trees larger than pays. Best-first growth adds nodes
in non-increasing score order, so every prefix of the node list is itself a tree (a parent
always comes before its children) and sizing a tree is choosing a prefix length, by the same
rule as the adaptive chain length (`verify_length.choose_prefix`).

The target reads [anchor, node 1, ..., node n] in one pass: node i sits at position
start + depth(i) and attends to the committed context, the anchor and its own ancestors
(`visibility`). Why this stays exact:
- greedy: the walk follows the child whose token is the target's argmax at the current node,
  and commits that argmax where no child matches; every committed token is the target's
  choice after the committed prefix, as in plain decoding;
- sampling: the target draws a token at every node from its own distribution there, and the
  walk follows the child equal to the draw (sample-and-match); every committed token is a
  draw from the target's distribution given the committed prefix, whatever the tree was.
Which nodes are drafted never depends on a target draw, so nothing is biased.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

BRANCHING = 8  # children tried per node: the top-8 tokens at the next position
DRAFTER_CALIBRATION = 1.3  # power on the drafter's probabilities (see the module text)


def max_tree_nodes(block: int, sized: bool) -> int:
    """Draft nodes a pass may verify: a block's worth for `tree-full`; twice that for the sized
    `tree`, whose cost table decides how many pay (where a pass of 32 tokens costs little more
    than one, as bf16 on AMX CPUs, wide trees do)."""
    return 2 * block - 1 if sized else block - 1


@dataclass(frozen=True)
class DraftTree:
    """Draft nodes in best-first order (a parent always before its children)."""

    tokens: list[int]
    parents: list[int]  # index of the parent node; -1: the anchor
    depths: list[int]  # block position of the node, 1..B-1
    scores: list[float]  # non-increasing: the estimate that the target walks through the node
    # Nodes only prompt lookup proposed (lookup.py), not the drafter; empty: none
    from_lookup: list[bool] = field(default_factory=list)
    # Which guess proposed each lookup node ("lookup" or "ngram", see `source`); empty: all "lookup"
    guessed_by: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix(self, n: int) -> DraftTree:
        """The first n nodes: a tree too, since parents come first."""
        return DraftTree(self.tokens[:n], self.parents[:n], self.depths[:n], self.scores[:n], self.from_lookup[:n],
                         self.guessed_by[:n])

    @property
    def drafter_depth(self) -> int:
        """The deepest node the drafter proposed (prompt lookup's chains may run deeper): how far
        the next block needs drafting."""
        return max((d for i, d in enumerate(self.depths) if not self.is_lookup(i)), default=0)

    def is_lookup(self, node: int) -> bool:
        return node < len(self.from_lookup) and self.from_lookup[node]

    def source(self, node: int) -> str:
        """Who proposed the node: "drafter", "lookup" (prompt lookup) or "ngram" (the drafter's
        n-gram table). A guess that agreed with a drafter node stays the drafter's."""
        if not self.is_lookup(node):
            return "drafter"
        return self.guessed_by[node] if node < len(self.guessed_by) and self.guessed_by[node] else "lookup"

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the anchor's child down to `node` (empty for -1, the anchor)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def main_line(self, node: int) -> list[int]:
        """The best-scored chain of descendants below `node` (-1: below the anchor)."""
        line = []
        while True:
            children = [i for i, p in enumerate(self.parents) if p == node]
            if not children:
                return line
            node = children[0]  # best-first order: the first child scores highest
            line.append(node)


def grow_tree(probs: list[list[float]], ids: list[list[int]], max_nodes: int,
              branching: int = BRANCHING, given: list[list[list[float]]] | None = None) -> DraftTree:
    """The `max_nodes` likeliest nodes, best first.

    probs/ids: [positions][k] the drafter's top-k probabilities and token ids at block positions
    1, 2, ...; a node at depth d gets as children the top `branching` tokens of position d+1.
    Parallel drafts are marginals: the same candidates and probabilities under every parent.
    `given` [positions][k][k] conditions them instead (DFlash 2's selector): row r of position
    d+1's table holds its candidates' probabilities after position d's candidate r (position 1's
    rows all follow the anchor).
    """
    if max_nodes < 1 or not probs:
        raise ValueError("a draft tree needs at least one node and one position")
    rows: dict[tuple[int, int], tuple[list[float], list[int]]] = {}

    def ranked(d: int, r: int) -> tuple[list[float], list[int]]:
        """The scores of the children of a depth-d node of candidate rank r (d = 0: the anchor),
        and the children's candidate ranks, best first."""
        key = (d, r if given is not None and d > 0 else 0)
        if key not in rows:
            row = probs[d] if given is None or d == 0 else given[d][r]
            rows[key] = row, sorted(range(len(row)), key=lambda c: -row[c])[:branching]
        return rows[key]

    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    # A node's siblings are pushed one by one, each when the one ranked above it is taken: no node
    # outscores its better-ranked sibling, so nodes come out in the order they would if all were
    # pushed at once (8x fewer heap operations). Entries: (-score, order, depth, sibling index,
    # parent, parent's -score, the siblings' first order, their scores, their ranks); `order`
    # breaks ties first come, first served, numbered as if all siblings were pushed together.
    heap: list[tuple] = []
    order = 0

    def push_children(d: int, r: int, node: int, neg: float) -> None:
        nonlocal order
        row, best = ranked(d, r)
        if best:
            heapq.heappush(heap, (neg * row[best[0]], order, d + 1, 0, node, neg, order, row, best))
            order += len(best)

    push_children(0, 0, -1, -1.0)
    while heap and len(tokens) < max_nodes:
        neg, _, d, j, parent, above, first, row, best = heapq.heappop(heap)
        r = best[j]
        tokens.append(int(ids[d - 1][r]))
        parents.append(parent)
        depths.append(d)
        scores.append(-neg)
        if j + 1 < len(best):
            heapq.heappush(heap, (above * row[best[j + 1]], first + j + 1, d, j + 1, parent, above, first, row, best))
        if d < len(probs):
            push_children(d, r, len(tokens) - 1, neg)
    return DraftTree(tokens, parents, depths, scores)


Chain = tuple[list[int], list[float], str]  # a guess below the anchor: tokens, scores, who guessed


def add_chain(tree: DraftTree, tokens: list[int], scores: list[float], source: str = "lookup") -> DraftTree:
    """`tree` with a chain of guesses below the anchor merged in (prompt lookup's, or the n-gram
    table's: `source`); see `add_chains`."""
    return add_chains(tree, [(tokens, scores, source)])


def add_chains(tree: DraftTree, chains: list[Chain], keep: int | None = None) -> DraftTree:
    """`tree` with chains of guesses below the anchor merged in, in order: a guess equal to an
    existing node under the same parent raises that node's score to the guess's; the others
    become new nodes. Scores are then capped by their parent's, and the nodes re-sorted best
    first (ties: shallower first), so every prefix is still a tree. One sort for all the chains
    of a block (lookup.py merges up to ten). With `keep`, the result is the best `keep` nodes
    (the prefix), and a chain stops at its first guess scored below `tree`'s keep-th node, which
    could not be among them: scores only fall along a chain, and merging only raises a node."""
    if not chains:
        return tree if keep is None else tree.prefix(keep)
    floor = keep_floor(tree, keep)
    n = len(tree)
    toks, pars, deps, scs = list(tree.tokens), list(tree.parents), list(tree.depths), list(tree.scores)
    looked = [*tree.from_lookup, *[False] * (n - len(tree.from_lookup))]
    by = [tree.source(i) if looked[i] else "" for i in range(n)]
    children = {(p, t): i for i, (p, t) in enumerate(zip(pars, toks, strict=True))}
    for tokens, scores, source in chains:
        parent = -1
        for depth, (tok, score) in enumerate(zip(tokens, scores, strict=True), start=1):
            if score < floor:
                break
            node = children.get((parent, tok))
            if node is None:
                node = len(toks)
                toks.append(tok)
                pars.append(parent)
                deps.append(depth)
                scs.append(score)
                looked.append(True)
                by.append(source)
                children[(parent, tok)] = node
            else:
                scs[node] = max(scs[node], score)
            parent = node
    for i, p in enumerate(pars):  # parents precede children here too, so one pass caps every path
        if p >= 0:
            scs[i] = min(scs[i], scs[p])
    order = sorted(range(len(toks)), key=lambda i: (-scs[i], deps[i], i))
    rank = [0] * len(order)
    for new, old in enumerate(order):
        rank[old] = new
    order = order[:keep]
    return DraftTree([toks[i] for i in order], [rank[pars[i]] if pars[i] >= 0 else -1 for i in order],
                     [deps[i] for i in order], [scs[i] for i in order], [looked[i] for i in order],
                     [by[i] for i in order])


def keep_floor(tree: DraftTree, keep: int | None) -> float:
    """The score a guess must reach to be among the best `keep` nodes once merged into `tree`
    (`add_chains`); -inf where every guess could be."""
    return tree.scores[keep - 1] if keep is not None and len(tree) >= keep else float("-inf")


def visibility(tree: DraftTree, device: torch.device | str = "cpu") -> torch.Tensor:
    """bool [n+1, n+1] over [anchor, nodes...]: row i may attend to column j (j is i itself,
    the anchor or an ancestor of i)."""
    n = len(tree)
    rows = [[True] + [False] * n]  # row i+1 is its parent's row with i+1 set (one tensor made from all)
    for i, parent in enumerate(tree.parents, start=1):
        row = list(rows[parent + 1])
        row[i] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool, device=device)


def walk(tree: DraftTree, choices: list[int]) -> tuple[list[int], int]:
    """Follow the target through the tree. `choices[0]` is the target's token after the anchor,
    `choices[i]` its token after node i-1 (argmax, or its own draw when sampling).
    Returns the accepted node indices (root first) and the token the target adds after them."""
    children: dict[int, dict[int, int]] = {}
    for i, (tok, parent) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
        children.setdefault(parent, {}).setdefault(tok, i)
    path: list[int] = []
    node = -1
    while True:
        nxt = children.get(node, {}).get(choices[node + 1])
        if nxt is None:
            return path, choices[node + 1]
        path.append(nxt)
        node = nxt

