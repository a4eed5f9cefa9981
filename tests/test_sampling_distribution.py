"""Sampled DFlash output follows the target's distribution exactly (speculative sampling).

On a toy target with a 4-token vocabulary, every 3-token continuation's probability is
enumerated exactly; DFlash sampling (with a random drafter whose q is far from p) is run
thousands of times and compared with a chi-square test. The same test run with a wrong
acceptance rule must fail, which shows the test is tight enough to matter.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare
from toy import toy_target

from dflash_core import verify, verify_length
from dflash_core.config import GenerationConfig
from dflash_core.drafter import DFlashDrafter, init_weights
from dflash_core.drafter_config import config_for_target
from dflash_core.engine import Engine
from dflash_core.events import Finished
from dflash_core.verify import logits_to_probs
from dflash_core.verify_length import PassCosts, VerifyCost

PROMPT = [1, 3, 0, 2]
LENGTH = 3
TRIALS = 1200


def exact_distribution(target, cfg: GenerationConfig) -> dict[tuple[int, ...], float]:
    vocab = target.vocab_size
    out = {}
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=LENGTH):
            ids = torch.tensor([PROMPT + list(seq)])
            logits = target.model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1]
            probs = logits_to_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)
            out[seq] = float(torch.prod(probs[torch.arange(LENGTH), torch.tensor(seq)]))
    return out


def sampled_counts(engine: Engine, cfg: GenerationConfig) -> tuple[Counter, float]:
    counts: Counter = Counter()
    taus = []
    for seed in range(TRIALS):
        fin = None
        for ev in engine.generate(PROMPT, cfg.with_(seed=seed)):
            fin = ev
        assert isinstance(fin, Finished)
        counts[tuple(fin.token_ids)] += 1
        taus.append(fin.tau)
    return counts, sum(taus) / len(taus)


def chi_square_p(counts: Counter, exact: dict) -> float:
    keys = sorted(exact)
    expected = [exact[k] * TRIALS for k in keys]
    # Pool rare outcomes so every expected count is large enough for the chi-square law.
    obs_big, exp_big, obs_rest, exp_rest = [], [], 0, 0.0
    for k, e in zip(keys, expected, strict=True):
        if e >= 5:
            obs_big.append(counts.get(k, 0))
            exp_big.append(e)
        else:
            obs_rest += counts.get(k, 0)
            exp_rest += e
    if exp_rest > 0:
        obs_big.append(obs_rest)
        exp_big.append(exp_rest)
    assert sum(counts.values()) == TRIALS
    scale = sum(obs_big) / sum(exp_big)  # exact sums, as chisquare demands
    return float(chisquare(obs_big, [e * scale for e in exp_big]).pvalue)


@pytest.fixture(scope="module")
def toy_engine() -> Engine:
    target = toy_target()
    cfg = config_for_target(target.config, num_layers=1, block_size=3, mask_token_id=3)
    drafter = init_weights(DFlashDrafter(cfg), std=0.3, seed=5)
    return Engine(target, drafter)


@pytest.mark.parametrize(
    "cfg",
    [
        GenerationConfig(max_new_tokens=LENGTH, temperature=1.0, block_size=3, steps=1),
        GenerationConfig(max_new_tokens=LENGTH, temperature=0.8, top_p=0.9, block_size=3, steps=2),
    ],
    ids=["t1-steps1", "t0.8-topp0.9-steps2"],
)
def test_dflash_sampling_matches_target_distribution(toy_engine: Engine, cfg: GenerationConfig) -> None:
    exact = exact_distribution(toy_engine.target, cfg)
    assert abs(sum(exact.values()) - 1.0) < 1e-5
    counts, tau = sampled_counts(toy_engine, cfg)
    assert 1.0 < tau < 3.0, "the random drafter should be right sometimes and wrong sometimes"
    assert chi_square_p(counts, exact) > 1e-3


def test_sampling_from_a_draft_vocabulary_stays_exact() -> None:
    """A drafter that drafts only from a subset of tokens (q = 0 elsewhere) is still exact:
    the residual max(0, p - q) gives the missing tokens their full probability."""
    target = toy_target()
    cfg_d = config_for_target(target.config, num_layers=1, block_size=3, mask_token_id=3)
    drafter = init_weights(DFlashDrafter(cfg_d), std=0.3, seed=5)
    drafter.draft_vocab = torch.tensor([0, 2])  # tokens 1 and 3 are never drafted
    engine = Engine(target, drafter)
    cfg = GenerationConfig(max_new_tokens=LENGTH, temperature=1.0, block_size=3, steps=1)
    drafted: set[int] = set()
    for seed in range(50):
        for ev in engine.generate(PROMPT, cfg.with_(seed=seed)):
            drafted.update(getattr(ev, "draft", []))
    assert drafted and drafted <= {0, 2}
    counts, tau = sampled_counts(engine, cfg)
    assert 1.0 < tau < 3.0
    assert chi_square_p(counts, exact_distribution(target, cfg)) > 1e-3


def test_wrong_acceptance_rule_is_detected(toy_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resampling from p (not the residual max(0, p - q)) after a rejection biases the output."""

    def wrong_accept(draft, q, p, generator):
        n = draft.shape[0]
        rows = torch.arange(n)
        u = torch.rand(n, generator=generator)
        accepted = (u * q[rows, draft] < p[rows, draft]).int().cumprod(0).sum()
        return accepted, verify.sample(p, generator)[accepted]

    monkeypatch.setattr("dflash_core.verify.speculative_accept", wrong_accept)
    cfg = GenerationConfig(max_new_tokens=LENGTH, temperature=1.0, block_size=3, steps=1)
    counts, _ = sampled_counts(toy_engine, cfg)
    assert chi_square_p(counts, exact_distribution(toy_engine.target, cfg)) < 1e-3


def test_adaptive_verify_length_keeps_sampling_exact(toy_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The adaptive verify length is chosen from the drafter's first-step distributions, before any
    token is drawn, so verifying one draft in some blocks and two in others stays exact."""
    toy_costs = VerifyCost((1, 2, 3), (100.0, 115.0, 135.0))
    monkeypatch.setattr(Engine, "pinned_costs", PassCosts(chain=toy_costs, tree=toy_costs, draft_ms=8.0))
    cfg = GenerationConfig(max_new_tokens=LENGTH, temperature=1.0, block_size=3, steps=1, verify="adaptive")
    checked = Counter()
    counts: Counter = Counter()
    for seed in range(TRIALS):
        *events, fin = toy_engine.generate(PROMPT, cfg.with_(seed=seed))
        checked.update(ev.checked for ev in events[1:])
        counts[tuple(fin.token_ids)] += 1
    assert checked[1] > TRIALS / 20 and checked[2] > TRIALS / 20, checked  # both lengths were chosen often
    assert chi_square_p(counts, exact_distribution(toy_engine.target, cfg)) > 1e-3


def test_resting_after_losing_blocks_keeps_sampling_exact(toy_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether a step drafts or rests follows from blocks already committed (here: a block that
    kept no draft makes the next token a plain step), never from the draws of the step itself,
    so the reply still follows the target's distribution."""
    toy_costs = VerifyCost((1, 2, 3), (100.0, 115.0, 135.0))
    monkeypatch.setattr(Engine, "pinned_costs", PassCosts(chain=toy_costs, tree=toy_costs, draft_ms=8.0, rest=True))
    monkeypatch.setattr(verify_length, "PAYING_WINDOW", 1)
    monkeypatch.setattr(verify_length, "FIRST_REST", 1)
    cfg = GenerationConfig(max_new_tokens=LENGTH, temperature=1.0, block_size=3, steps=1, verify="adaptive")
    kinds: Counter = Counter()
    counts: Counter = Counter()
    for seed in range(TRIALS):
        *events, fin = toy_engine.generate(PROMPT, cfg.with_(seed=seed))
        kinds.update(ev.is_draft_block for ev in events[1:])
        counts[tuple(fin.token_ids)] += 1
    assert kinds[False] > TRIALS / 20 and kinds[True] > TRIALS / 20, kinds  # both kinds of step were taken often
    assert chi_square_p(counts, exact_distribution(toy_engine.target, cfg)) > 1e-3


def test_dflash2_sampling_with_the_selectors_sparse_q_stays_exact() -> None:
    """DFlash 2 proposes from the selector's softmax over each position's top-k candidates
    (k = 2 of this toy's 4 tokens, so q is 0 for half the vocabulary), conditioned on the token
    drawn before it: the accept rule with that q keeps the target's distribution."""
    from dflash_core.dflash2 import dflash2_config

    target = toy_target()
    base = config_for_target(target.config, num_layers=1, block_size=3, mask_token_id=3)
    cfg_d = dflash2_config(base, kernel_size=2, group_size=base.hidden_size, top_k=2, rank=4)
    engine = Engine(target, init_weights(DFlashDrafter(cfg_d), std=0.3, seed=5))
    cfg = GenerationConfig(max_new_tokens=LENGTH, temperature=1.0, block_size=3, steps=1)
    counts, tau = sampled_counts(engine, cfg)
    assert 1.0 < tau < 3.0
    assert chi_square_p(counts, exact_distribution(target, cfg)) > 1e-3
