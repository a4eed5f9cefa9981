"""Prompt-lookup candidates (dflash_core/lookup.py) and merging them into a draft tree."""

from __future__ import annotations

import random

import pytest

from dflash_core.draft_tree import add_chain, grow_tree
from dflash_core.lookup import GUESS_CALIBRATION, LOOP_NGRAM, PRIOR, LookupRates, NgramIndex, with_lookup


def brute_guess(ids: list[int], path: list[int], length: int, max_ngram: int = 3) -> tuple[int, list[int]]:
    """The latest occurrence inside `ids` (with a continuation there) of the last n tokens of
    ids + path, searched directly; the continuation is what follows it in ids + path, and after
    a `LOOP_NGRAM`-token match the text then repeats with its period, token by token."""
    seq = ids + path
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        tail = seq[-n:]
        for s in range(len(ids) - n - 1, -1, -1):
            if ids[s : s + n] == tail:
                text, period = list(seq), len(seq) - (s + n)
                while n >= LOOP_NGRAM and len(text) < s + n + length:
                    text.append(text[-period])
                return n, text[s + n : s + n + length]
    return 0, []


def test_index_matches_a_direct_search_as_tokens_arrive() -> None:
    rng = random.Random(0)
    for trial in range(20):
        vocab = 3 + trial % 5  # small vocabularies: many repeats
        index = NgramIndex()
        ids: list[int] = []
        for _ in range(60):
            chunk = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            index.extend(chunk)
            ids.extend(chunk)
            assert index.guess(6) == brute_guess(ids, [], 6)
            assert index.guess(15) == brute_guess(ids, [], 15)


def test_guess_after_a_path_matches_a_direct_search() -> None:
    rng = random.Random(1)
    for trial in range(300):
        vocab = 3 + trial % 6
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        path = [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
        index = NgramIndex(ids)
        assert index.guess(5, path) == brute_guess(ids, path, 5), (ids, path)
        assert index.guess(12, path) == brute_guess(ids, path, 12), (ids, path)
        assert index.ids == ids  # the path is not committed


def test_index_examples() -> None:
    index = NgramIndex([5, 6, 7, 8, 9, 5, 6, 7])
    assert index.guess(3) == (3, [8, 9, 5])  # "5 6 7" occurred before, followed by 8 9 5
    assert NgramIndex([1, 2, 3]).guess(4) == (0, [])  # nothing repeats
    assert NgramIndex([4, 1, 2, 4]).guess(2) == (1, [1, 2])
    # A loop: the 3-gram's continuation runs into the end of the text and repeats with its period.
    assert NgramIndex([1, 2, 3, 1, 2, 3]).guess(8) == (3, [1, 2, 3, 1, 2, 3, 1, 2])
    assert NgramIndex([4, 1, 2, 4]).guess(5) == (1, [1, 2, 4])  # a 1-gram match does not extend
    # The continuation reads on into the path, as if it were committed, then loops.
    assert NgramIndex([7, 8, 9, 7, 8]).guess(4, [9]) == (3, [7, 8, 9, 7])


def test_rates_start_at_the_prior_and_learn() -> None:
    rates = LookupRates()
    assert rates.scores(3, 2) == pytest.approx([PRIOR[(3, 0)], PRIOR[(3, 0)] * PRIOR[(3, 1)]])
    for _ in range(50):
        rates.update(3, [7, 8], [7, 9])  # first guessed token right, second wrong
    first, second = rates.scores(3, 2)
    assert first > PRIOR[(3, 0)]
    assert second / first < PRIOR[(3, 1)]
    assert rates.scores(9, 6)[-1] == pytest.approx(rates.scores(3, 6)[-1])  # long n-grams and positions pool


def test_chain_merges_into_the_tree() -> None:
    tree = grow_tree([[0.5, 0.3], [0.6, 0.2]], [[10, 11], [20, 21]], max_nodes=6, branching=2)
    merged = add_chain(tree, [10, 22, 30], [0.9, 0.8, 0.7])
    assert len(merged) == len(tree) + 2  # 10 existed under the anchor; 22 and 30 are new
    assert sorted(zip(merged.tokens, merged.depths, strict=True)) == sorted(
        [*zip(tree.tokens, tree.depths, strict=True), (22, 2), (30, 3)])
    assert merged.scores == sorted(merged.scores, reverse=True)
    for i, p in enumerate(merged.parents):
        assert p < i and (p < 0 or merged.scores[i] <= merged.scores[p])
    ten = merged.tokens.index(10)
    assert merged.scores[ten] == pytest.approx(0.9) and not merged.is_lookup(ten)  # the drafter's node, raised
    new = [i for i in range(len(merged)) if merged.is_lookup(i)]
    assert [merged.tokens[i] for i in new] == [22, 30]
    assert merged.path_to(merged.tokens.index(30)) == [ten, merged.tokens.index(22), merged.tokens.index(30)]
    # Low-scored guesses go after every drafter node, and a prefix leaves them out.
    low = add_chain(tree, [12], [0.01])
    assert low.tokens[-1] == 12 and low.prefix(len(tree)).tokens == tree.tokens


def test_lookup_extends_the_drafters_best_nodes() -> None:
    """After the anchor nothing repeats yet, but after the drafter's first candidate (30) the
    text did occur before: its continuation hangs below that node, scored below it."""
    index = NgramIndex([1, 30, 31, 32, 33, 2, 9])  # committed; the anchor is 9
    tree = grow_tree([[0.6, 0.2], [0.5, 0.1]], [[30, 40], [41, 42]], max_nodes=4, branching=2)
    rates = LookupRates()
    merged, (n, guess) = with_lookup(tree, index, rates, max_depth=4)
    assert (n, guess) == (0, [])  # "9" never occurred before: no guess after the anchor
    thirty = merged.tokens.index(30)
    below = [i for i in range(len(merged)) if merged.is_lookup(i)]
    assert [merged.tokens[i] for i in below] == [31, 32, 33]  # depth 2..4: max_depth caps the chain
    assert merged.path_to(below[-1])[0] == thirty and merged.depths[below[-1]] == 4
    assert merged.scores[below[0]] == pytest.approx(merged.scores[thirty] * rates.scores(1, 1)[0] ** GUESS_CALIBRATION)
    assert merged.scores == sorted(merged.scores, reverse=True)
    for i, p in enumerate(merged.parents):
        assert p < i
    # Without branches only the anchor gets a guess: here none, so the drafter's tree is unchanged.
    same, _ = with_lookup(tree, index, rates, max_depth=4, branches=0)
    assert same == tree


def test_keeping_the_best_nodes_cuts_the_merged_tree() -> None:
    """`keep`: guesses that could not be among the best `keep` nodes are not made, and the result
    is what merging them all and then cutting the tree would give."""
    rng = random.Random(3)
    for _ in range(300):
        committed = [rng.randint(0, 6) for _ in range(rng.randint(2, 40))]
        k = rng.randint(1, 4)
        probs = [sorted((rng.random() for _ in range(k)), reverse=True) for _ in range(5)]
        ids = [[rng.randint(0, 6) for _ in range(k)] for _ in range(5)]
        tree = grow_tree(probs, ids, max_nodes=rng.randint(1, 12), branching=k)
        index, rates, keep = NgramIndex(committed), LookupRates(), rng.randint(1, 12)
        whole, guess = with_lookup(tree, index, rates, max_depth=6)
        kept, kept_guess = with_lookup(tree, index, rates, max_depth=6, keep=keep)
        cut = whole.prefix(keep)
        assert (kept.tokens, kept.parents, kept.depths, kept.scores) == (cut.tokens, cut.parents, cut.depths,
                                                                           cut.scores)
        assert [kept.is_lookup(i) for i in range(len(kept))] == [cut.is_lookup(i) for i in range(len(cut))]
        assert kept_guess == guess
