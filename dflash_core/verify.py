"""Acceptance rules in plain torch: greedy prefix match and speculative sampling.

Both decide a whole block without a Python loop over tokens. The speculative sampling rule
(accept draft x with probability min(1, p(x)/q(x)); at the first rejection draw from the
normalised max(0, p - q); after a fully accepted block draw a bonus from p) makes every
committed token follow the target's distribution p exactly, whatever q the drafter used.
Its random numbers are drawn explicitly (`draw_uniforms`) and the final token is picked by
inverse CDF, so the Triton kernel in kernels.py, given the same numbers, picks the same tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import cpu_kernels

if TYPE_CHECKING:
    from .config import GenerationConfig


def logits_to_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution: temperature, then top-k, then top-p (nucleus). fp32 [n, V]."""
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest set whose mass reaches top_p (the first token always stays).
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` [n, V] (unnormalised weights >= 0) → [n], by inverse CDF
    in float64 (`inverse_cdf`, row by row). torch.multinomial draws the same law but costs
    ~1 ms per 49k-token row on a CPU: 17 ms for a 16-row block here, against 0.7 ms."""
    u = torch.rand(probs.shape[0], generator=generator, device=probs.device, dtype=torch.float64)
    return _inverse_cdf_rows(probs, u)


def greedy_choice(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first index among equal maxima as `argmax` gives (a NaN counting as
    largest, as torch's `max` does), whatever path computes it: greedy decoding is exact only if
    every path chooses alike. On a CPU torch's `max(-1)` scans a 49k-token row in ~45 µs (a
    14-row tree pass pays that per row); the compiled `argmax_rows` finds the same index in ~7."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1]:
        compiled = cpu_kernels.kernel()
        if compiled is not None:
            return compiled.argmax_rows(logits)
    return logits.max(-1).indices


def greedy_accept(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draft [B-1]; target_logits [B, V] at the block's positions 0..B-1.

    Returns (accepted count, the target's token after the accepted prefix), both 0-d tensors.
    """
    choice = greedy_choice(target_logits)
    accepted = (draft == choice[:-1]).int().cumprod(0).sum()
    return accepted, choice[accepted]


def draw_uniforms(n: int, generator: torch.Generator | None, device: torch.device | str) -> torch.Tensor:
    """The random numbers one block of speculative sampling consumes: float64 [n + 1].

    u[:n] drive the accept tests at positions 0..n-1, u[n] picks the final (correction or bonus)
    token by inverse CDF. The torch rule and the Triton kernel (dflash_core/kernels.py) both take
    them as input, so the same generator state gives the same block on either path. float64 so
    the inverse CDF resolves probabilities far below float32's 2**-24 step.
    """
    return torch.rand(n + 1, generator=generator, device=device, dtype=torch.float64)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token whose CDF interval holds u: weights [V] >= 0 (unnormalised), u 0-d in [0, 1).

    Returns the first index i with cdf[i] > u * total (a u exactly on a boundary goes to the
    next token; a zero-weight token is never chosen), accumulated in float64. If rounding puts
    u * total at or past the end, the last token with positive weight. 0-d int64, no host sync.
    """
    return _inverse_cdf_rows(weights[None], u.reshape(1))[0]


def _inverse_cdf_rows(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`inverse_cdf` for every row of weights [n, V] with its own u [n] → [n]."""
    cdf = weights.double().cumsum(-1)
    threshold = u.double()[:, None] * cdf[:, -1:]
    index = torch.searchsorted(cdf, threshold, right=True)[:, 0]  # how many cdf entries are <= threshold
    positions = torch.arange(weights.shape[-1], device=weights.device)
    last_positive = torch.where(weights > 0, positions, -1).max(-1).values
    return torch.minimum(index, last_positive)


def speculative_accept_u(
    draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`speculative_accept` with its random numbers given: u float64 [B] (see `draw_uniforms`).

    The reference the Triton kernel is tested against; it computes in float32 (bf16/fp16 are
    upcast) and float64 exactly as the kernel does.
    """
    n = draft.shape[0]
    p, q, u = p.float(), q.float(), u.double()
    rows = torch.arange(n, device=draft.device)
    ok = u[:n] * q[rows, draft].double() < p[rows, draft].double()  # u < p/q without dividing by a zero q
    accepted = ok.int().cumprod(0).sum()
    # Only the row at `accepted` matters; pick it on the device (no host round trip).
    at = accepted.reshape(1)
    p_row = p.index_select(0, at)[0]
    q_row = q.index_select(0, at.clamp_max(n - 1))[0] if n else torch.zeros_like(p_row)
    q_row = torch.where(accepted < n, q_row, 0.0)  # no q after a full accept:
    residual = (p_row - q_row).clamp_min(0.0)  # then this is p's last row itself (the bonus)
    # Where p == q the residual is empty; rejection there has probability 0, so any row is fine.
    weights = torch.where((residual > 0).any(), residual, p_row)
    return accepted, inverse_cdf(weights, u[n])


def speculative_accept(
    draft: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """draft [B-1] sampled from q [B-1, V]; p [B, V] the target's distributions at positions 0..B-1.

    Returns (accepted count, the correction or bonus token), both 0-d tensors.
    """
    return speculative_accept_u(draft, q, p, draw_uniforms(draft.shape[0], generator, p.device))


class Sampler:
    """How tokens are chosen, built once from a config: the argmax at temperature 0, else a draw
    from the tempered, top-k/top-p cut distribution with the config's seeded generator."""

    def __init__(self, cfg: GenerationConfig, device: torch.device | str) -> None:
        self.greedy = cfg.greedy
        self.temperature, self.top_k, self.top_p = cfg.temperature, cfg.top_k, cfg.top_p
        self.generator = torch.Generator(device=device).manual_seed(cfg.seed)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return logits_to_probs(logits, self.temperature, self.top_k, self.top_p)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """One token per row of logits [n, V] → [n]."""
        return greedy_choice(logits) if self.greedy else sample(self.probs(logits), self.generator)

    def accept(self, draft: torch.Tensor, q: torch.Tensor | None,
               logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rule for a chain: draft [B-1] (proposed from q [B-1, V] when sampling), the target's
        logits [B, V] → (accepted count, the target's token after them), both 0-d tensors."""
        if self.greedy:
            return greedy_accept(draft, logits)
        assert q is not None, "speculative sampling needs the drafter's proposal distributions"
        return speculative_accept(draft, q, self.probs(logits), self.generator)
