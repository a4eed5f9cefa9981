"""Sampled DFlash on the REAL embedded target and the shipped drafter follows the target's
distribution: the toy test (test_sampling_distribution.py) checks the rule exhaustively on a
4-token vocabulary; this one checks the plumbing at full size (49,152 tokens, the draft
vocabulary, temperature processing, q and p aligned with the right block positions).

The prompt ends inside an answer, "The capital of France is", so the first token is " Paris"
most of the time (~95 %) and the next two are spread ("." / "," then several); the exact
probability of each (t2, t3) after " Paris" comes from two target forwards, and the counts of
many seeded runs are compared with it by a chi-square test.
"""

from __future__ import annotations

from collections import Counter

import torch
from conftest import finish
from scipy.stats import chisquare

from dflash_core.config import GenerationConfig
from dflash_core.drafter import load_drafter
from dflash_core.engine import Engine
from dflash_core.loading import SHIPPED_DRAFTER

RUNS = 300


def _probs(target, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.softmax(target.model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)


def test_sampled_tokens_follow_the_targets_distribution(target) -> None:
    prompt = target.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    prompt += target.tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    paris = int(_probs(target, prompt).argmax())
    p2 = _probs(target, [*prompt, paris])
    exact: dict[tuple[int, int], float] = {}
    for t2 in p2.topk(2).indices.tolist():  # "." and ",": ~99 % of the mass
        p3 = _probs(target, [*prompt, paris, t2])
        for t3 in p3.topk(8).indices.tolist():
            exact[(t2, t3)] = float(p2[t2] * p3[t3])
    engine = Engine(target, load_drafter(SHIPPED_DRAFTER, device=target.device, dtype=target.dtype))
    cfg = GenerationConfig(max_new_tokens=3, temperature=1.0, top_p=1.0, block_size=4)
    pairs: Counter = Counter()
    accepted = 0
    for seed in range(RUNS):
        fin = finish(engine.generate(prompt, cfg.with_(seed=seed)))
        if fin.token_ids[0] == paris:
            pairs[tuple(fin.token_ids[1:3])] += 1
        accepted += round(fin.tau * fin.blocks) - fin.blocks
    n = sum(pairs.values())
    assert 0.85 * RUNS < n <= RUNS, n  # " Paris" at ~95 %
    assert accepted > 0, "the shipped drafter should get some drafts accepted here"
    cells = [k for k, v in exact.items() if v * n >= 5]
    observed = [pairs[k] for k in cells] + [n - sum(pairs[k] for k in cells)]
    expected = [exact[k] * n for k in cells] + [(1 - sum(exact[k] for k in cells)) * n]
    assert len(cells) >= 3 and expected[-1] > 0
    pvalue = float(chisquare(observed, expected).pvalue)
    assert pvalue > 1e-3, (pvalue, observed, [round(e, 1) for e in expected])
