"""Prompt-lookup candidates for a draft tree: text that already occurred is often repeated.

Code repeats names from the prompt, worked maths repeats numbers, and a small model's greedy
reply repeats itself. So after the committed tokens' last n-gram (n = 3, 2, 1, longest first),
the tokens that followed its most recent earlier occurrence are a good guess for what follows
now. Those guesses join the drafter's candidates in the tree (`draft_tree.add_chain`); the target
checks both in the same pass. It costs no model: an index of n-grams, updated as tokens commit.

Each guessed token gets a score like a drafter candidate's, its estimated chance of being the
target's next token given the ones before it were. The estimate is a per-reply running rate by
n-gram size and position in the guess, starting from the rates measured on SmolLM2's greedy
replies (`PRIOR`) with the weight of `PRIOR_WEIGHT` observations, so a reply that repeats itself
soon trusts its guesses more and one that does not, less. Exactness does not depend on it: the
scores only decide which candidates the target checks.
"""

from __future__ import annotations

MAX_NGRAM = 3
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

    def guess(self, length: int) -> tuple[int, list[int]]:
        """(n, up to `length` tokens that followed the latest earlier occurrence of the last n
        tokens), trying the longest n first; (0, []) when nothing matches."""
        ids = self.ids
        for n in range(min(self.max_ngram, len(ids) - 1), 0, -1):
            start = self._next.get(tuple(ids[len(ids) - n :]))
            if start is not None:
                return n, ids[start : start + length]
        return 0, []


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
        out, score = [], 1.0
        for k in range(length):
            key = self._key(n, k)
            score *= self.hits[key] / self.tries[key]
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
