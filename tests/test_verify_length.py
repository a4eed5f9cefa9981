"""The adaptive verify length: the cost table, the choice, the drafted length, and that output
stays exactly plain greedy decoding's on the real target with the shipped drafter."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from conftest import CPU_LIKE, finish
from test_lossless import check_events, run

from dflash_core.config import GenerationConfig
from dflash_core.draft_tree import max_tree_nodes
from dflash_core.drafter import DFlashDrafter, load_drafter
from dflash_core.engine import Engine
from dflash_core.errors import DFlashError
from dflash_core.loading import SHIPPED_DRAFTER
from dflash_core.verify_length import (
    FIRST_REST,
    LONGEST_REST,
    MIN_DRAFT_LENGTH,
    PAYING_WINDOW,
    Pace,
    PassCosts,
    VerifyCost,
    chain_scores,
    choose_prefix,
    measure_verify_cost,
    next_draft_length,
    resolve_mode,
    timed_sizes,
    timing_tree,
)

# Shaped like this CPU's measurements: 2 tokens cost 1.15 one-token passes, 16 tokens 2.3.
FLAT = VerifyCost((1, 16), (10.0, 10.0))


def test_cost_table_interpolates_and_extrapolates() -> None:
    assert CPU_LIKE(1) == 60.0 and CPU_LIKE(2) == 69.0 and CPU_LIKE(16) == 138.0
    assert CPU_LIKE(3) == pytest.approx(79.5)  # halfway between 2 and 4
    assert CPU_LIKE(10) == pytest.approx(114.0)
    assert CPU_LIKE(20) == pytest.approx(154.0)  # the last segment's slope, beyond the table
    assert VerifyCost((1,), (5.0,))(3) == 15.0
    assert CPU_LIKE.relative()[16] == pytest.approx(2.3)


@pytest.mark.parametrize("sizes,ms", [((2, 4), (1.0, 2.0)), ((1, 4, 4), (1.0, 2.0, 3.0)), ((1, 4), (1.0,)),
                                      ((1, 4), (1.0, 0.0)), ((), ())])
def test_cost_table_rejects_bad_tables(sizes: tuple[int, ...], ms: tuple[float, ...]) -> None:
    with pytest.raises(ValueError):
        VerifyCost(sizes, ms)


def rate(confidence: list[float], cost: VerifyCost, draft_ms: float, m: int) -> float:
    """Expected tokens per ms when verifying m drafts, straight from the formula."""
    expected = 1 + sum(math.prod(confidence[:k]) for k in range(1, m + 1))
    return expected / (draft_ms + cost(m + 1))


def test_choice_maximises_expected_tokens_per_second() -> None:
    rng = random.Random(0)
    chosen = set()
    for _ in range(300):
        n = rng.choice([1, 3, 7, 15])
        conf = [rng.random() ** rng.choice([0.3, 1, 3]) for _ in range(n)]
        cost = rng.choice([CPU_LIKE, FLAT, VerifyCost((1, 2, 3, 8), (1.0, 1.5, 1.6, 4.0))])
        draft_ms = rng.choice([0.0, 5.0, 30.0])
        m = choose_prefix(chain_scores(conf), cost, draft_ms)
        best = max(rate(conf, cost, draft_ms, k) for k in range(1, n + 1))
        assert rate(conf, cost, draft_ms, m) == pytest.approx(best, rel=1e-12)
        chosen.add(m)
    assert len(chosen) > 5  # the cases exercise many lengths, not one


def test_choice_extremes() -> None:
    assert choose_prefix(chain_scores([0.99] * 15), FLAT, 1.0) == 15  # free verification: take everything
    assert choose_prefix(chain_scores([0.01] * 15), CPU_LIKE, 8.0) == 1  # an unsure drafter on a CPU: one token
    assert choose_prefix(chain_scores([0.95, 0.9, 0.05, 0.9]), CPU_LIKE, 8.0) == 2  # stop before the doubt
    with pytest.raises(ValueError):
        choose_prefix(chain_scores([]), CPU_LIKE, 1.0)


def test_drafted_length_follows_what_was_verified() -> None:
    assert next_draft_length([], 16, 16) == 16
    assert next_draft_length([1, 1, 2], 16, 16) == MIN_DRAFT_LENGTH  # floor
    assert next_draft_length([1, 5, 1], 16, 16) == 7  # the longest recent prefix + 2
    assert next_draft_length([1, 3], 4, 16) == 8  # the whole drafted block was verified: double
    assert next_draft_length([7], 8, 10) == 10  # never past the block size
    long_ago = [12] + [1] * 8
    assert next_draft_length(long_ago, 16, 16) == MIN_DRAFT_LENGTH  # only recent blocks count


def losing(pace: Pace, blocks: int = PAYING_WINDOW) -> None:
    """Blocks that verify 7 drafts and keep none: 1 token for a draft and a pass of 8."""
    for _ in range(blocks):
        pace.record(7, 0.0, verified=7, committed=1)


def test_drafting_rests_while_blocks_lose_to_plain_steps() -> None:
    """With pinned costs, judged on modelled ones (the table's passes and the fixed drafting time), so the verdicts
    are the same on any machine: a losing window rests for FIRST_REST plain tokens, each losing
    probe doubles the rest up to LONGEST_REST, a paying window resets it."""
    cost = VerifyCost((1, 16), (10.0, 25.0))
    pace = Pace(cost, 16, draft_ms=2.0)
    losing(pace, PAYING_WINDOW - 1)
    assert pace.resting == 0  # too few blocks for a verdict
    losing(pace, 1)
    assert pace.resting == FIRST_REST
    for _ in range(FIRST_REST):
        pace.rested()
    assert pace.resting == 0
    losing(pace)
    assert pace.resting == 2 * FIRST_REST
    pace.resting = 0
    for _ in range(10):
        losing(pace)
        pace.resting = 0
    assert pace.next_rest == LONGEST_REST
    # 3 tokens per block of 2 + cost(8) = 16 ms beat plain's 10 ms a token: no rest, reset.
    for _ in range(PAYING_WINDOW):
        pace.record(7, 0.0, verified=7, committed=3)
    assert pace.resting == 0 and pace.next_rest == FIRST_REST
    # Blocks of 2 + cost(3) = 14 ms: 2 tokens each pay (7 ms a token against 10), 1 each does
    # not: rests come only below LOSING of plain's rate (1.25 tokens: 11.2 ms a token).
    for committed, rests in ((2, False), (1, True)):
        pace = Pace(cost, 16, draft_ms=2.0)
        for _ in range(PAYING_WINDOW):
            pace.record(2, 0.0, verified=2, committed=committed)
        assert (pace.resting > 0) == rests
    # Without pinned costs, the same verdicts from the drafting as timed (2 ms) and the table's
    # pass: a busy machine slows plain steps as much as blocks, so block wall times would mislead.
    for committed, rests in ((2, False), (1, True)):
        pace = Pace(cost, 16)
        for _ in range(PAYING_WINDOW):
            pace.record(2, 0.002, verified=2, committed=committed)
        assert (pace.resting > 0) == rests


def test_no_rest_without_a_cost_table_or_when_turned_off() -> None:
    """`full` verifies every draft as published (no table), and `rest=False` (most tests)."""
    for pace in (Pace(None, 16), Pace(VerifyCost((1, 16), (10.0, 25.0)), 16, draft_ms=2.0, rest=False)):
        losing(pace, 3 * PAYING_WINDOW)
        assert pace.resting == 0


@pytest.mark.parametrize("verify", ["adaptive", "tree"])
def test_a_drafter_that_never_pays_rests_and_stays_exact(target, random_drafter: DFlashDrafter, verify: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The random drafter almost never guesses right: after a few blocks the reply goes on in
    plain steps, drafting again now and then to probe, and the tokens are plain greedy's."""
    monkeypatch.setattr(Engine, "pinned_costs", PassCosts(chain=CPU_LIKE, tree=CPU_LIKE, draft_ms=8.0, rest=True))
    eng = Engine(target, random_drafter)
    cfg = GenerationConfig(max_new_tokens=60, block_size=8, verify=verify)
    plain = finish(eng.generate(PROMPTS[0], cfg, plain=True)).token_ids
    events, fin = run(eng, PROMPTS[0], cfg)
    assert fin.token_ids == plain
    check_events(events, fin, prompt_len=fin.prompt_tokens, max_new=60, block=8, eos=target.eos_ids, full=False)
    drafted = [ev.is_draft_block for ev in events[1:]]
    assert drafted[:PAYING_WINDOW] == [True] * PAYING_WINDOW
    assert drafted[PAYING_WINDOW : PAYING_WINDOW + FIRST_REST] == [False] * FIRST_REST
    assert sum(drafted) < len(drafted) / 2 and True in drafted[PAYING_WINDOW + FIRST_REST :]  # it probed again


def test_mode_resolution_and_validation() -> None:
    assert resolve_mode("auto", "cpu") == "adaptive"
    assert resolve_mode("auto", "cpu", greedy=True, tree_ok=True) == "tree"  # greedy on the fast forward
    assert resolve_mode("auto", "cpu", greedy=False, tree_ok=True) == "adaptive"  # sampling keeps the chain
    assert resolve_mode("auto", "cpu", greedy=True, tree_ok=False) == "adaptive"
    assert resolve_mode("auto", "cuda", greedy=True, tree_ok=True) == "full"
    assert resolve_mode("tree-full", "cpu") == "tree-full"
    assert resolve_mode("auto", torch.device("cuda", 0)) == "full"
    assert resolve_mode("full", "cpu") == "full" and resolve_mode("adaptive", "cuda") == "adaptive"
    with pytest.raises(ValueError):
        resolve_mode("sometimes", "cpu")
    with pytest.raises(DFlashError, match="verify must be one of"):
        GenerationConfig(verify="sometimes")


def test_calibration_on_the_real_target(target) -> None:
    cost = measure_verify_cost(target, [1, 27], 16)
    assert cost.sizes == tuple(timed_sizes(16)) and cost.sizes[-1] == 16
    assert all(b >= a > 0 for a, b in itertools.pairwise(cost.ms))  # never cheaper for more tokens


@pytest.fixture(scope="module")
def shipped_engine(target) -> Engine:
    drafter: DFlashDrafter = load_drafter(SHIPPED_DRAFTER, device=target.device, dtype=target.dtype)
    return Engine(target, drafter)


@pytest.fixture(scope="module")
def plain_outputs(shipped_engine: Engine) -> list[list[int]]:
    cfg = GenerationConfig(max_new_tokens=40)
    return [finish(shipped_engine.generate(p, cfg, plain=True)).token_ids for p in PROMPTS]


PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "A farmer has 17 sheep and buys 5 more, then sells 8. How many sheep are left?",
    "Explain in two sentences why the sky is blue.",
    "List the first ten prime numbers.",
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "And a fruit of that colour?"}],
]


@pytest.mark.parametrize("block", [2, 4, 8, 16])
def test_adaptive_output_is_plain_greedy_output(target, shipped_engine: Engine, plain_outputs: list[list[int]],
                                                block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = GenerationConfig(max_new_tokens=40, block_size=block, verify="adaptive")
    shorter = fewer_drafted = 0
    for prompt, plain in zip(PROMPTS, plain_outputs, strict=True):
        events, fin = run(shipped_engine, prompt, cfg)
        check_events(events, fin, prompt_len=fin.prompt_tokens, max_new=40, block=block,
                     eos=target.eos_ids, full=False)
        assert fin.token_ids == plain
        shorter += sum(ev.checked < len(ev.draft) for ev in events[1:])
        fewer_drafted += sum(len(ev.draft) + 1 < block for ev in events[1:])
    if block > 2:  # with B = 2 there is one draft token: nothing to choose
        assert shorter > 0, "the adaptive length never verified less than the drafted block"
    if block > MIN_DRAFT_LENGTH:
        assert fewer_drafted > 0, "the drafted length never adapted"


def test_full_mode_verifies_every_draft(target, shipped_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = GenerationConfig(max_new_tokens=24, block_size=8, verify="full")
    events, fin = run(shipped_engine, PROMPTS[0], cfg)
    check_events(events, fin, prompt_len=fin.prompt_tokens, max_new=24, block=8, eos=target.eos_ids, full=True)
    assert all(ev.verified == 7 for ev in events[1:])


def test_tree_calibration_times_tree_passes(target) -> None:
    """Tree modes size their trees with the cost of tree passes (their rows' ancestors are
    gathered: dearer than a chain of as many tokens on the batch-invariant path)."""
    depths, visible = timing_tree(9, torch.device("cpu"))
    assert depths.tolist() == [0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert visible.sum(1).tolist() == [d + 1 for d in depths.tolist()]  # itself and one row per depth
    assert visible[8].nonzero().flatten().tolist() == [0, 2, 4, 6, 8]
    cost = measure_verify_cost(target, [1, 27], 8, tree=True)
    assert cost.sizes == tuple(timed_sizes(8))
    assert all(b >= a > 0 for a, b in itertools.pairwise(cost.ms))


def test_unpinned_engine_measures_once_and_stays_exact(target, shipped_engine: Engine, plain_outputs: list[list[int]],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Without pinned costs an engine times the target's passes on first use, keeps them on the
    target for every engine, and sizes blocks from them; the output is plain greedy's whatever
    the machine's load made of the sizes."""
    monkeypatch.setattr(Engine, "pinned_costs", None)
    monkeypatch.setattr(target, "measured_costs", {})
    chain = shipped_engine.cost_table("adaptive", 8)
    assert chain is not None and chain.sizes[-1] >= 8 and target.measured_costs["chain"] is chain
    assert Engine(target, shipped_engine.drafter).cost_table("adaptive", 8) is chain  # not measured again
    tree = shipped_engine.cost_table("tree", 8)
    assert tree is target.measured_costs["tree"] and tree.sizes[-1] >= max_tree_nodes(8, sized=True) + 1
    assert shipped_engine.cost_table("full", 8) is None
    fin = finish(shipped_engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=40, block_size=8, verify="tree")))
    assert fin.token_ids == plain_outputs[0]
