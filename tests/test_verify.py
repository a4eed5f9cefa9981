"""Unit tests of the acceptance rules in dflash_core/verify.py on small hand-made tensors."""

from __future__ import annotations

import pytest
import torch

from dflash_core.verify import greedy_accept, greedy_choice, logits_to_probs, sample, speculative_accept

V = 6


def one_hot_logits(choices: list[int], vocab: int = V) -> torch.Tensor:
    """Logits whose argmax at row i is choices[i]."""
    logits = torch.zeros(len(choices), vocab)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return logits


# ----- greedy -----


@pytest.mark.parametrize(
    ("draft", "target", "accepted", "token"),
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, 4),  # all match: the bonus comes from the last row
        ([0, 2, 3], [1, 2, 3, 4], 0, 1),  # first token wrong: the target's own first choice
        ([1, 5, 3], [1, 2, 3, 4], 1, 2),  # mismatch in the middle: later matches do not count
        ([1, 2, 5], [1, 2, 3, 4], 2, 3),  # mismatch at the last draft position
        ([4], [4, 0], 1, 0),  # B = 2
        ([3], [4, 0], 0, 4),
    ],
)
def test_greedy_accept(draft: list[int], target: list[int], accepted: int, token: int) -> None:
    acc, tok = greedy_accept(torch.tensor(draft), one_hot_logits(target))
    assert acc.dim() == 0 and tok.dim() == 0
    assert (int(acc), int(tok)) == (accepted, token)


def test_greedy_choice_is_argmax_on_ties_and_edge_rows() -> None:
    # bf16 logits tie often: every path must pick the same (first) index as torch.argmax.
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 33):
        logits = torch.randint(-3, 4, (n, 500), generator=gen).float()
        assert torch.equal(greedy_choice(logits), logits.argmax(-1))
    edge = torch.full((3, 5), float("-inf"))
    edge[1, 3] = float("nan")
    edge[2] = torch.tensor([2.0, 9.0, 9.0, float("inf"), float("inf")])
    assert greedy_choice(edge).tolist() == edge.argmax(-1).tolist() == [0, 3, 3]


# ----- logits_to_probs -----


def test_logits_to_probs_temperature_only() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    for t in (0.5, 1.0, 2.0):
        p = logits_to_probs(logits, t)
        assert torch.allclose(p, torch.softmax(logits / t, -1))
        assert p.dtype == torch.float32


def test_logits_to_probs_top_k() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 0.0, 2.0], [5.0, 1.0, 2.0, 3.0, 4.0]])
    p = logits_to_probs(logits, 1.0, top_k=2)
    assert (p > 0).tolist() == [[False, True, True, False, False], [True, False, False, False, True]]
    assert torch.allclose(p.sum(-1), torch.ones(2))
    # The kept tokens keep their relative weights.
    assert p[0, 1] / p[0, 2] == pytest.approx(torch.e, rel=1e-5)
    # top_k >= V is off.
    assert torch.allclose(logits_to_probs(logits, 1.0, top_k=5), torch.softmax(logits, -1))


def test_logits_to_probs_top_p() -> None:
    probs = torch.tensor([[0.5, 0.05, 0.3, 0.15]])
    logits = probs.log()
    # The smallest set whose mass reaches top_p, most likely first.
    for top_p, support in [
        (0.4, [True, False, False, False]),
        (0.5, [True, False, False, False]),
        (0.6, [True, False, True, False]),
        (0.8, [True, False, True, False]),
        (0.9, [True, False, True, True]),
        (0.99, [True, True, True, True]),
        (1.0, [True, True, True, True]),
    ]:
        p = logits_to_probs(logits, 1.0, top_p=top_p)
        assert (p[0] > 0).tolist() == support, top_p
        assert float(p.sum()) == pytest.approx(1.0, abs=1e-6)
        kept = torch.tensor(support)
        assert torch.allclose(p[0][kept], probs[0][kept] / probs[0][kept].sum(), atol=1e-6)


def test_logits_to_probs_top_k_then_top_p() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    # top-k 3 renormalises to (4/9, 3/9, 2/9); top-p 0.7 then needs the first two (7/9 >= 0.7).
    p = logits_to_probs(probs.log(), 1.0, top_k=3, top_p=0.7)
    assert (p[0] > 0).tolist() == [True, True, False, False]
    assert torch.allclose(p[0, :2], torch.tensor([4 / 7, 3 / 7]), atol=1e-6)


def test_sample_shape_and_support() -> None:
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]])
    for _ in range(50):
        s = sample(probs, g)
        assert s.shape == (2,)
        assert int(s[0]) == 1 and int(s[1]) in (0, 2)


def test_sample_follows_each_rows_distribution() -> None:
    from scipy.stats import chisquare

    g = torch.Generator().manual_seed(1)
    weights = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0], [2.0, 1.0, 0.0, 0.5, 0.5]])  # unnormalised is fine
    draws = torch.stack([sample(weights.expand(2000, 2, 5).reshape(-1, 5), g).view(2000, 2)
                         for _ in range(2)]).view(-1, 2)
    for row in range(2):
        counts = torch.bincount(draws[:, row], minlength=5)
        expected = weights[row] / weights[row].sum() * len(draws)
        assert counts[expected == 0].sum() == 0  # a zero-weight token is never drawn
        keep = expected > 0
        assert chisquare(counts[keep].tolist(), expected[keep].tolist()).pvalue > 1e-3


# ----- speculative sampling -----


def random_dist(rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    return torch.softmax(torch.randn(rows, vocab, generator=g) * 2, -1)


def test_speculative_accept_q_equals_p_accepts_everything() -> None:
    g = torch.Generator().manual_seed(1)
    B = 4
    counts = torch.zeros(V)
    for _ in range(300):
        p = random_dist(B, V, g)
        q = p[: B - 1].clone()
        draft = sample(q, g)
        acc, tok = speculative_accept(draft, q, p, g)
        assert int(acc) == B - 1
        assert float(p[B - 1, tok]) > 0
    # The bonus follows p's last row.
    p = torch.tensor([[0.2, 0.2, 0.2, 0.2, 0.1, 0.1]] * 3 + [[0.7, 0.0, 0.3, 0.0, 0.0, 0.0]])
    q = p[:3].clone()
    n = 4000
    for _ in range(n):
        acc, tok = speculative_accept(sample(q, g), q, p, g)
        assert int(acc) == 3
        counts[int(tok)] += 1
    assert counts[[1, 3, 4, 5]].sum() == 0
    assert abs(float(counts[0]) / n - 0.7) < 0.03


def test_speculative_accept_rejects_where_p_is_zero() -> None:
    g = torch.Generator().manual_seed(2)
    # Position 1's draft token (2) has p = 0: acceptance must stop there, every time.
    p = torch.tensor([
        [0.5, 0.5, 0.0, 0.0, 0.0, 0.0],
        [0.3, 0.3, 0.0, 0.2, 0.2, 0.0],
        [0.1, 0.1, 0.2, 0.2, 0.2, 0.2],
        [0.1, 0.1, 0.2, 0.2, 0.2, 0.2],
    ])
    q = torch.tensor([
        [0.5, 0.5, 0.0, 0.0, 0.0, 0.0],
        [0.1, 0.4, 0.5, 0.0, 0.0, 0.0],
        [0.1, 0.1, 0.2, 0.2, 0.2, 0.2],
    ])
    draft = torch.tensor([0, 2, 3])
    residual_support = (p[1] - q[1]) > 0  # tokens 0, 3, 4 (token 1 has p - q < 0, token 2 and 5 zero)
    assert residual_support.tolist() == [True, False, False, True, True, False]
    seen = set()
    for _ in range(2000):
        acc, tok = speculative_accept(draft, q, p, g)
        assert int(acc) == 1  # position 0 has p == q (always accepted), position 1 always rejected
        assert bool(residual_support[tok]), int(tok)
        seen.add(int(tok))
    assert seen == {0, 3, 4}


def test_speculative_accept_first_position_zero_mass() -> None:
    g = torch.Generator().manual_seed(3)
    p = torch.tensor([[0.0, 0.6, 0.4, 0.0, 0.0, 0.0]] * 3)
    q = torch.tensor([[0.4, 0.6, 0.0, 0.0, 0.0, 0.0]] * 2)
    for _ in range(500):
        acc, tok = speculative_accept(torch.tensor([0, 1]), q, p, g)
        assert int(acc) == 0
        assert int(tok) == 2  # p - q > 0 only at token 2


# ----- statistics: the committed tokens follow p whatever q is -----

P_ROWS = torch.tensor([
    [0.10, 0.40, 0.20, 0.30],
    [0.25, 0.05, 0.60, 0.10],
    [0.50, 0.20, 0.20, 0.10],
])
Q_ROWS = torch.tensor([
    [0.40, 0.10, 0.40, 0.10],
    [0.10, 0.50, 0.10, 0.30],
])
TRIALS = 20_000


@pytest.fixture(scope="module")
def committed_blocks() -> list[list[int]]:
    """TRIALS blocks (V=4, B=3): draft sampled from q, then speculative_accept against fixed p."""
    g = torch.Generator().manual_seed(1234)
    blocks = []
    for _ in range(TRIALS):
        draft = sample(Q_ROWS, g)
        acc, tok = speculative_accept(draft, Q_ROWS, P_ROWS, g)
        a = int(acc)
        blocks.append([*draft[:a].tolist(), int(tok)])
    return blocks


def assert_follows(tokens: list[int], probs: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.shape[0]).double()
    n = float(counts.sum())
    assert n > 1000
    try:
        from scipy.stats import chisquare
    except ImportError:  # pragma: no cover - scipy is in the test extras
        assert float((counts / n - probs.double()).abs().max()) < 0.02
        return
    expected = probs.double() / probs.double().sum() * n
    result = chisquare(counts.numpy(), expected.numpy())
    assert result.pvalue > 1e-3, (counts / n, probs)


def test_first_committed_token_follows_p(committed_blocks: list[list[int]]) -> None:
    assert_follows([b[0] for b in committed_blocks], P_ROWS[0])


def test_second_committed_token_follows_p_given_first(committed_blocks: list[list[int]]) -> None:
    # p's rows here do not depend on the previous token, so the second token follows p[1]
    # whatever the first was; check each first token separately.
    for first in range(4):
        seconds = [b[1] for b in committed_blocks if len(b) >= 2 and b[0] == first]
        if len(seconds) > 1000:
            assert_follows(seconds, P_ROWS[1])
    assert_follows([b[1] for b in committed_blocks if len(b) >= 2], P_ROWS[1])


def test_bonus_token_follows_last_row(committed_blocks: list[list[int]]) -> None:
    assert_follows([b[2] for b in committed_blocks if len(b) == 3], P_ROWS[2])


def test_accept_rate_matches_theory(committed_blocks: list[list[int]]) -> None:
    # P(accept position 0) = sum_x min(p(x), q(x)).
    rate = sum(len(b) >= 2 for b in committed_blocks) / TRIALS
    expected = float(torch.minimum(P_ROWS[0], Q_ROWS[0]).sum())
    assert abs(rate - expected) < 0.02
