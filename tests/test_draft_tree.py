"""Tree verification (dflash_core/draft_tree.py): growing, masking and walking a draft tree,
the target's tree pass against chain passes, and exactness on the real target: greedy output is
plain greedy output, sampled output follows the target's distribution."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import finish
from test_lossless import CORRUPT_ORDER, REF_TOKENS, ForcedEngine, References, check_events, run
from test_sampling_distribution import chi_square_p, exact_distribution, sampled_counts, toy_engine  # noqa: F401
from test_verify_length import PROMPTS, plain_outputs, shipped_engine  # noqa: F401 (fixtures)

import dflash_core.steps as steps_module
from dflash_core.config import GenerationConfig
from dflash_core.draft_tree import DRAFTER_CALIBRATION, DraftTree, grow_tree, max_tree_nodes, visibility, walk
from dflash_core.drafter import DFlashDrafter
from dflash_core.drafting import Draft
from dflash_core.engine import Engine
from dflash_core.errors import DFlashError
from dflash_core.steps import TreeStep, candidate_tree
from dflash_core.targets import Target
from dflash_core.verify_length import VerifyCost, choose_prefix

# Top-3 candidates at three block positions: probabilities (descending) and token ids.
PROBS = [[0.5, 0.3, 0.1], [0.6, 0.2, 0.1], [0.9, 0.05, 0.01]]
IDS = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]


def test_tree_grows_best_first() -> None:
    tree = grow_tree(PROBS, IDS, max_nodes=6, branching=3)
    # Scores: 10 .5, 11 .3, 10>20 .3 (ties: first come first), 10>20>30 .27, 11>20 .18, 11>20>30 .162.
    assert tree.tokens == [10, 11, 20, 30, 20, 30]
    assert tree.parents == [-1, -1, 0, 2, 1, 4]
    assert tree.scores == sorted(tree.scores, reverse=True)
    for i, (parent, depth) in enumerate(zip(tree.parents, tree.depths, strict=True)):
        assert parent < i  # a parent before its children: every prefix is a tree
        assert depth == (1 if parent < 0 else tree.depths[parent] + 1)
        expected = PROBS[depth - 1][IDS[depth - 1].index(tree.tokens[i])]
        assert tree.scores[i] == pytest.approx(expected * (1.0 if parent < 0 else tree.scores[parent]))
    big = grow_tree(PROBS, IDS, max_nodes=100, branching=2)
    assert len(big) == 2 + 4 + 8 and big.depth == 3  # every node of a full binary tree of depth 3
    assert len(grow_tree(PROBS, IDS, max_nodes=100, branching=1)) == 3  # branching 1: the chain
    with pytest.raises(ValueError):
        grow_tree(PROBS, IDS, max_nodes=0)


def eager_tree(probs: list[list[float]], ids: list[list[int]], max_nodes: int, branching: int,
               given: list[list[list[float]]] | None) -> tuple[list[int], list[int], list[int], list[float]]:
    """Best-first growth as first written: every child pushed when its parent is taken."""
    import heapq

    def best(row: list[float]) -> list[int]:
        return sorted(range(len(row)), key=lambda r: -row[r])[:branching]

    out: tuple[list[int], list[int], list[int], list[float]] = ([], [], [], [])
    heap = [(-probs[0][r], i, 1, r, -1) for i, r in enumerate(best(probs[0]))]
    order = len(heap)
    while heap and len(out[0]) < max_nodes:
        neg, _, d, r, parent = heapq.heappop(heap)
        for part, value in zip(out, (int(ids[d - 1][r]), parent, d, -neg), strict=True):
            part.append(value)
        if d < len(probs):
            row = probs[d] if given is None else given[d][r]
            for r2 in best(row):
                heapq.heappush(heap, (neg * row[r2], order, d + 1, r2, len(out[0]) - 1))
                order += 1
    return out


def test_tree_equals_pushing_every_child_at_once() -> None:
    """`grow_tree` pushes siblings one at a time: the same nodes in the same order (ties and
    zero probabilities included, marginals and conditioned rows alike) as pushing them all."""
    import random

    rng = random.Random(7)
    for _ in range(3000):
        positions, k = rng.randint(1, 6), rng.randint(1, 8)

        def p() -> float:
            return rng.choice([0.5, 0.25, 0.0, rng.random(), rng.random()])

        probs = [[p() for _ in range(k)] for _ in range(positions)]
        ids = [[rng.randint(0, 20) for _ in range(k)] for _ in range(positions)]
        given = [[[p() for _ in range(k)] for _ in range(k)] for _ in range(positions)] if rng.random() < 0.5 else None
        max_nodes, branching = rng.randint(1, 40), rng.randint(1, 8)
        tree = grow_tree(probs, ids, max_nodes, branching, given)
        assert (tree.tokens, tree.parents, tree.depths, tree.scores) == eager_tree(probs, ids, max_nodes, branching,
                                                                                  given)


def test_conditioned_rows_rank_each_nodes_children_after_its_token() -> None:
    """DFlash 2: position 2's candidates in another order after each of position 1's."""
    given = [[[0.6, 0.4], [0.6, 0.4]], [[0.9, 0.1], [0.2, 0.8]]]
    ids = [[10, 11], [20, 21]]
    tree = grow_tree([given[0][0], [0.5, 0.5]], ids, max_nodes=4, given=given)  # the marginals go unused
    # 10 .6, 10>20 .54, 11 .4, 11>21 .32 (as marginals: 11>20 .2 and 11>21 .2)
    assert list(zip(tree.tokens, tree.parents, strict=True)) == [(10, -1), (20, 0), (11, -1), (21, 2)]
    assert tree.scores == pytest.approx([0.6, 0.54, 0.4, 0.32])
    # A row in logit order, not by probability: its best children still come first
    tree = grow_tree([[0.3, 0.7]], [[10, 11]], max_nodes=2, branching=1, given=[[[0.3, 0.7]]])
    assert tree.tokens == [11]


def test_engine_trees_score_calibrated_drafter_probabilities() -> None:
    """A block's tree scores each node by its path's drafter probabilities raised to
    DRAFTER_CALIBRATION: lower than the raw products, in the same order."""
    top = (torch.tensor(PROBS), torch.tensor(IDS))
    draft = Draft(tokens=torch.tensor([10, 20, 30]), probs=torch.tensor([0.5, 0.6, 0.9]), q=None,
                                steps=[], top=top)
    tree = candidate_tree(draft, max_nodes=6)
    assert DRAFTER_CALIBRATION > 1
    assert tree.scores == sorted(tree.scores, reverse=True)
    for i in range(len(tree)):
        raw = 1.0
        for j in tree.path_to(i):
            d = tree.depths[j]
            raw *= PROBS[d - 1][IDS[d - 1].index(tree.tokens[j])]
        assert tree.scores[i] == pytest.approx(raw**DRAFTER_CALIBRATION, rel=1e-5) and tree.scores[i] < raw


def test_prefix_main_line_and_path() -> None:
    tree = grow_tree(PROBS, IDS, max_nodes=8, branching=3)
    small = tree.prefix(3)
    assert len(small) == 3 and all(p < 3 for p in small.parents)
    line = tree.main_line(-1)
    assert [tree.tokens[i] for i in line] == [10, 20, 30]  # the best candidate at every depth
    for node in range(len(tree)):
        path = tree.path_to(node)
        assert path[-1] == node and len(path) == tree.depths[node]
        assert all(tree.parents[b] == a for a, b in itertools.pairwise(path))


def test_visibility_is_self_anchor_and_ancestors() -> None:
    tree = grow_tree(PROBS, IDS, max_nodes=8, branching=3)
    seen = visibility(tree)
    assert seen.shape == (len(tree) + 1, len(tree) + 1)
    assert seen[0].tolist() == [True] + [False] * len(tree)  # the anchor sees only itself (and the cache)
    for i in range(len(tree)):
        allowed = {0, *(j + 1 for j in tree.path_to(i))}
        assert {j for j in range(len(tree) + 1) if seen[i + 1, j]} == allowed


def test_walk_follows_the_targets_choices() -> None:
    tree = DraftTree(tokens=[5, 6, 7, 8], parents=[-1, -1, 0, 1], depths=[1, 1, 2, 2], scores=[.5, .4, .3, .2])
    # choices[0]: the target after the anchor; choices[i]: after node i-1.
    assert walk(tree, [6, 0, 8, 0, 0]) == ([1, 3], 0)  # second candidate, then its child, then a bonus
    assert walk(tree, [5, 9, 0, 0, 0]) == ([0], 9)  # first candidate, then a correction
    assert walk(tree, [4, 0, 0, 0, 0]) == ([], 4)  # nothing accepted
    assert walk(tree, [5, 7, 0, 1, 2]) == ([0, 2], 1)


def test_tree_size_pays_for_its_pass() -> None:
    flat = VerifyCost((1, 16), (10.0, 10.0))  # a pass costs the same for any size: take every node
    assert choose_prefix([0.5, 0.3, 0.2, 0.1], flat, 1.0) == 4
    steep = VerifyCost((1, 2), (10.0, 20.0))  # every node costs as much as a whole token
    assert choose_prefix([0.5, 0.3, 0.2, 0.1], steep, 0.0) == 1
    with pytest.raises(ValueError):
        choose_prefix([], flat, 1.0)


def test_tree_needs_one_denoising_step() -> None:
    with pytest.raises(DFlashError, match="one denoising step"):
        GenerationConfig(verify="tree", steps=2)
    GenerationConfig(verify="tree-full", steps=1)


def test_tree_pass_equals_chain_passes(target: Target) -> None:
    """Every node's logits and features in one tree pass are those of a chain pass over its path,
    and keeping a path's rows leaves the cache a chain pass would have left."""
    prompt = target.encode_chat([{"role": "user", "content": "Count from one to five."}])
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(4, 3, generator=gen).sort(-1, descending=True).values.tolist()
    ids = torch.randint(0, target.vocab_size, (4, 3), generator=gen).tolist()
    tree = grow_tree(probs, ids, max_nodes=9, branching=3)
    anchor = 42
    layers = [1, 27]
    cache = target.new_cache(len(prompt) + 20)
    target.forward(torch.tensor([prompt]), cache, layers)
    start = cache.length
    logits, feats = target.tree_forward(torch.tensor([[anchor, *tree.tokens]]), torch.tensor([0, *tree.depths]),
                                        visibility(tree), cache, layers)
    assert cache.length == start + len(tree) + 1
    for node in [-1, *range(len(tree))]:
        path = tree.path_to(node)
        cache.truncate(start)
        chain_logits, chain_feats = target.forward(torch.tensor([[anchor, *(tree.tokens[i] for i in path)]]),
                                                   cache, layers)
        row = node + 1
        torch.testing.assert_close(logits[row], chain_logits[-1], rtol=1e-4, atol=2e-4)
        torch.testing.assert_close(feats[row], chain_feats[-1], rtol=1e-4, atol=2e-4)
    deep = max(range(len(tree)), key=lambda i: (tree.depths[i], i))  # a deep node off the first line, usually
    path = tree.path_to(deep)
    rows = [0, *(i + 1 for i in path)]
    cache.truncate(start)
    target.tree_forward(torch.tensor([[anchor, *tree.tokens]]), torch.tensor([0, *tree.depths]),
                        visibility(tree), cache, layers)
    cache.keep_rows(start, rows)
    assert cache.length == start + len(rows)
    kept = [(layer.keys[:, :, : cache.length].clone(), layer.values[:, :, : cache.length].clone())
            for layer in cache.layers]
    cache.truncate(start)
    target.forward(torch.tensor([[anchor, *(tree.tokens[i] for i in path)]]), cache, layers)
    for (k, v), layer in zip(kept, cache.layers, strict=True):
        torch.testing.assert_close(k, layer.keys[:, :, : cache.length], rtol=1e-4, atol=2e-4)
        torch.testing.assert_close(v, layer.values[:, :, : cache.length], rtol=1e-4, atol=2e-4)


class TreeRecordingEngine(Engine):
    """Records the rows every tree pass kept, to show that paths off the first line occurred."""

    def __init__(self, target: Target, drafter: DFlashDrafter) -> None:
        super().__init__(target, drafter)
        self.kept: list[list[int]] = []

    def _step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        step = super()._step(*args, **kwargs)
        if isinstance(step, TreeStep):
            verify = step.verify

            def recording(anchor: int, tree: DraftTree) -> tuple[list[int], list[int], int]:
                out = verify(anchor, tree)
                self.kept.append(out[0])
                return out

            step.verify = recording  # type: ignore[method-assign]
        return step


@pytest.mark.parametrize("block", [2, 4, 8, 16])
@pytest.mark.parametrize(("mode", "lookup"), [("tree", True), ("tree-full", True), ("tree-full", False)])
def test_tree_output_is_plain_greedy_output(target: Target, shipped_engine: Engine,  # noqa: F811
                                            plain_outputs: list[list[int]], block: int, mode: str,  # noqa: F811
                                            lookup: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = TreeRecordingEngine(target, shipped_engine.drafter)
    cfg = GenerationConfig(max_new_tokens=40, block_size=block, verify=mode, lookup=lookup)
    guessed = 0
    for prompt, plain in zip(PROMPTS, plain_outputs, strict=True):
        events, fin = run(eng, prompt, cfg)
        check_events(events, fin, prompt_len=fin.prompt_tokens, max_new=40, block=block, eos=target.eos_ids,
                     full=False)
        assert fin.token_ids == plain
        cap = max_tree_nodes(block, sized=mode == "tree")
        assert all(ev.tree_nodes is not None and 1 <= ev.tree_nodes <= cap for ev in events[1:])
        if mode == "tree-full":
            assert all(ev.tree_nodes == block - 1 for ev in events[1:])
        assert all(0 <= (ev.lookup_accepted or 0) <= min(ev.accepted, ev.lookup_nodes or 0) for ev in events[1:])
        guessed += sum(ev.lookup_accepted or 0 for ev in events[1:])
    # Replies repeat the prompt's words: prompt-lookup guesses get accepted, and only when asked for.
    assert (guessed > 0) == lookup
    # The shipped drafter's second or third candidates are accepted at times: those blocks keep
    # rows that are not the tree's first ones, the case the cache compaction exists for.
    if block > 2:
        assert any(rows != list(range(len(rows))) for rows in eng.kept)


@pytest.mark.parametrize("block", [4, 16])
def test_forced_drafts_in_tree_mode(target: Target, random_drafter: DFlashDrafter, block: int) -> None:
    """A draft without candidates is verified as a chain; every accepted length still lands right."""
    refs = References(target, Engine(target, random_drafter))
    todo = set(range(block))

    def corrupt(k: int, avail: int) -> int:
        fits = [c for c in todo if c < avail or c == avail == block - 1]
        c = max(fits) if fits else k % block
        todo.discard(c)
        return c

    for name in CORRUPT_ORDER:
        ref = refs[name]
        eng = ForcedEngine(target, random_drafter, ref, corrupt=corrupt)
        events, fin = run(eng, ref.prompt, GenerationConfig(max_new_tokens=REF_TOKENS, block_size=block,
                                                            verify="tree-full"))
        check_events(events, fin, prompt_len=ref.prompt_len, max_new=REF_TOKENS, block=block, eos=target.eos_ids,
                     full=False)
        assert fin.token_ids == ref.tokens, name
        for ev, c, avail in zip(events[1:], eng.planned, eng.available, strict=True):
            assert c is not None and (ev.accepted == c if c < avail else ev.accepted >= avail)
        if not todo:
            break
    assert not todo, f"accepted lengths never produced: {sorted(todo)}"


@pytest.mark.parametrize(("mode", "lookup"), [("tree", True), ("tree-full", True), ("tree-full", False)])
def test_tree_sampling_matches_target_distribution(toy_engine: Engine, mode: str, lookup: bool,  # noqa: F811
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    engine = toy_engine
    cfg = GenerationConfig(max_new_tokens=3, temperature=1.0, block_size=3, verify=mode, lookup=lookup)
    exact = exact_distribution(engine.target, cfg)
    counts, tau = sampled_counts(engine, cfg)
    assert 1.0 < tau < 3.0
    assert chi_square_p(counts, exact) > 1e-3


def test_wrong_tree_walk_is_detected(toy_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """A walk that takes the first candidate unchecked biases the output; the test above sees it."""
    engine = toy_engine

    def biased(tree: DraftTree, choices: list[int]) -> tuple[list[int], int]:
        path, tok = walk(tree, choices)
        return (path, tok) if path else ([0], choices[1])

    monkeypatch.setattr(steps_module, "walk", biased)
    cfg = GenerationConfig(max_new_tokens=3, temperature=1.0, block_size=3, verify="tree-full")
    counts, _ = sampled_counts(engine, cfg)
    assert chi_square_p(counts, exact_distribution(engine.target, cfg)) < 1e-3


def test_tree_on_a_target_without_the_fast_forward(target: Target, random_drafter: DFlashDrafter) -> None:
    slow = Target(model=target.model, tokenizer=target.tokenizer, name=target.name, device=target.device,
                  dtype=target.dtype, fast=False)
    assert not slow.supports_tree
    fin = finish(Engine(slow, random_drafter).generate("Say hi.", GenerationConfig(max_new_tokens=4, verify="tree")))
    assert any("needs the fast forward" in w for w in fin.warnings)
    plain = finish(Engine(slow, random_drafter).generate("Say hi.", GenerationConfig(max_new_tokens=4), plain=True))
    assert fin.token_ids == plain.token_ids
    with pytest.raises(DFlashError, match="tree verification needs the fast forward"):
        slow.tree_forward(torch.tensor([[1, 2]]), torch.tensor([0, 1]), torch.ones(2, 2, dtype=torch.bool),
                          slow.new_cache(4))
