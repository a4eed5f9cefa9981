"""Prompt-lookup candidates for a draft tree: text that already occurred is often repeated.

Code repeats names from the prompt, worked maths repeats numbers, and a small model's greedy
reply repeats itself. So after the committed tokens' last n-gram (n = 3, 2, 1, longest first),
the tokens that followed its most recent earlier occurrence are a good guess for what follows
now (and, when a 3-gram's continuation runs into the end of the text, the reply is looping: the
guess repeats that period to the block's end). Those guesses join the drafter's candidates in
the tree (`draft_tree.add_chains`); the target checks both in the same pass. It costs no model:
an index of n-grams, updated as tokens commit.
The drafter's best few nodes get a guess too, read as if their tokens were committed
(`with_lookup`): the drafter may see a repeat coming one token before the committed text does.
A drafter that ships an n-gram table of the target's own text (corpus.py) adds its guesses at
the same places.

Each guessed token gets a score like a drafter candidate's, its estimated chance of being the
target's next token given the ones before it were. The estimate is a per-reply running rate by
n-gram size and position in the guess, starting from the rates measured on SmolLM2's greedy
replies (`PRIOR`) with the weight of `PRIOR_WEIGHT` observations, so a reply that repeats itself
soon trusts its guesses more and one that does not, less. Exactness does not depend on it: the
scores only decide which candidates the target checks.

A guess that adds a node to the tree is one the drafter did not make itself (an agreeing guess
only raises the drafter's node), and chosen against the drafter it is right less often than its
rate says. Measured on the shipped drafter (HumanEval and GSM8K prompts 6-20): a
guessed node rated 0.36 given its parent was walked 19 % of the time (prompt lookup) and 14 %
(the n-gram table), one rated 0.84, 67 % and 65 %. So each rate, and each table entry's score,
is raised to the power `GUESS_CALIBRATION` where a guess joins the tree (0.36 -> 0.18, 0.84 -> 0.74);
overrated guesses would make trees larger than pays.
"""

from __future__ import annotations

from .corpus import FLOOR, ORDER, CorpusNgrams
from .draft_tree import Chain, DraftTree, add_chains, keep_floor

MAX_NGRAM = 3
BRANCHES = 4  # the drafter's best nodes that also get a guess for what follows them
POSITIONS = 4  # rates are kept for guess positions 0, 1, 2 and 3+
# (n, position) -> rate, measured on SmolLM2-135M's own greedy replies to 952 ShareGPT prompts (the
# training data's regenerated replies, 256 tokens each; never the evaluation sets): a 3-gram
# match's first token was the target's 89 % of the time, a 1-gram's 23 %.
PRIOR = {
    (1, 0): 0.23, (1, 1): 0.57, (1, 2): 0.66, (1, 3): 0.83,
    (2, 0): 0.55, (2, 1): 0.66, (2, 2): 0.77, (2, 3): 0.87,
    (3, 0): 0.89, (3, 1): 0.92, (3, 2): 0.94, (3, 3): 0.96,
}
PRIOR_WEIGHT = 10.0
# Only a match this long that runs into the end of the text extends periodically (measured,
# HumanEval / GSM8K prompts 6-15: 1-, 2- and 3-gram matches alike cut HumanEval's blocks by ~5 %,
# GSM8K's by none; 3 is the most certain that the text is looping).
LOOP_NGRAM = 3
GUESS_CALIBRATION = 1.7  # power on a guess's rates where it joins a tree (see the module text)


class NgramIndex:
    """The committed tokens and, per n-gram, where its most recent continuation starts."""

    def __init__(self, ids: list[int] | None = None, max_ngram: int = MAX_NGRAM) -> None:
        self.max_ngram = max_ngram
        self.ids: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest occurrence
        self.extend(ids or [])

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            end = len(self.ids)  # the n-grams ending just before `t` now have a continuation: t
            for n in range(1, self.max_ngram + 1):
                if end >= n:
                    self._next[tuple(self.ids[end - n : end])] = end
            self.ids.append(t)

    def guess(self, length: int, path: list[int] | tuple[int, ...] = ()) -> tuple[int, list[int]]:
        """(n, up to `length` tokens that followed the latest earlier occurrence of the last n
        tokens), trying the longest n first; (0, []) when nothing matches. With `path` (a draft
        node's tokens below the anchor), the guess is for after them, as if they were committed;
        the index itself is not changed."""
        tail = [*self.ids[len(self.ids) - self.max_ngram :], *path]
        for n in range(min(self.max_ngram, len(self.ids) + len(path) - 1), 0, -1):
            start = self._next.get(tuple(tail[len(tail) - n :]))
            if start is not None:
                return n, self._continuation(start, length, path, n)
        return 0, []

    def _continuation(self, start: int, length: int, path: list[int] | tuple[int, ...], n: int) -> list[int]:
        """Up to `length` tokens from `start` on in the committed tokens followed by `path`.
        Where they run out after a match of `LOOP_NGRAM` tokens, the guess goes on repeating
        itself with the period it has (the match's distance from the end): a reply caught in a
        loop, as small models' greedy replies often are, then gets a whole block's guess rather
        than one period of it."""
        seq = self.ids[start : start + length]
        if len(seq) < length:
            seq += path[: length - len(seq)]
        if len(seq) == length or n < LOOP_NGRAM:
            return seq
        return [seq[k % len(seq)] for k in range(length)]  # seq holds all of it: one period


class LookupRates:
    """Running rate at which guessed tokens were the target's, by n-gram size and position."""

    def __init__(self) -> None:
        self.hits = {k: v * PRIOR_WEIGHT for k, v in PRIOR.items()}
        self.tries = dict.fromkeys(PRIOR, PRIOR_WEIGHT)

    @staticmethod
    def _key(n: int, k: int) -> tuple[int, int]:
        return min(n, MAX_NGRAM), min(k, POSITIONS - 1)

    def scores(self, n: int, length: int) -> list[float]:
        """The guess's path scores: the product of the rates up to each position."""
        rates = [self.hits[key] / self.tries[key] for key in (self._key(n, k) for k in range(POSITIONS))]
        out, score = [], 1.0
        for k in range(length):
            score *= rates[min(k, POSITIONS - 1)]
            out.append(score)
        return out

    def update(self, n: int, guess: list[int], committed: list[int]) -> None:
        """Count the guess against what was committed after the anchor, up to its first miss."""
        for k, (g, c) in enumerate(zip(guess, committed, strict=False)):
            key = self._key(n, k)
            self.tries[key] += 1
            if g != c:
                return
            self.hits[key] += 1


def with_lookup(tree: DraftTree, index: NgramIndex, rates: LookupRates, max_depth: int,
                branches: int = BRANCHES, corpus: CorpusNgrams | None = None, keep: int | None = None,
                ) -> tuple[DraftTree, tuple[int, list[int]]]:
    """The drafter's `tree` with prompt-lookup chains merged in: one after the anchor, and one
    after each of the drafter's `branches` best nodes, as if that node's path were committed (when
    the drafter has the first tokens of a repeat right but the committed text does not yet reach
    into it, lookup can then carry the rest). A chain's scores are its node's score times the
    guess's calibrated rates; chains run at most to block position `max_depth`. With a `corpus`
    (corpus.py), its chains join at the same places. With `keep`, the tree is cut to its best
    `keep` nodes, and guesses that could not be among them are not made (`add_chains`).
    Returns the tree and the anchor's guess (n, tokens), which `rates.update` learns from."""
    floor = keep_floor(tree, keep)
    nodes = [tree.path_to(i) for i in range(min(branches, len(tree)))]
    # the anchor (an empty path, certain) first, then the drafter's best nodes
    starts = [([], [])] + [([tree.tokens[j] for j in p], [tree.scores[j] for j in p]) for p in nodes]
    anchor_guess: tuple[int, list[int]] = (0, [])
    chains: list[Chain] = []
    for path, path_scores in starts:
        room = max_depth - len(path)
        if room <= 0:
            continue
        above = path_scores[-1] if path_scores else 1.0
        n, guess = index.guess(room, path)
        if not path:
            anchor_guess = (n, guess)
        if guess:
            rated = rates.scores(n, len(guess))
            chains.append((path + guess, path_scores + [above * r**GUESS_CALIBRATION for r in rated], "lookup"))
        if corpus is not None:
            guess, below = corpus.chain([*index.ids[-ORDER:], *path], room, above, power=GUESS_CALIBRATION,
                                        floor=max(FLOOR, floor))
            if guess:
                chains.append((path + guess, path_scores + below, "ngram"))
    return add_chains(tree, chains, keep), anchor_guess
