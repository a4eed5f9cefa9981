"""Acceptance rules in plain torch: greedy prefix match and speculative sampling.

Both decide a whole block without a Python loop over tokens. The speculative sampling rule
(accept draft x with probability min(1, p(x)/q(x)); at the first rejection draw from the
normalised max(0, p - q); after a fully accepted block draw a bonus from p) makes every
committed token follow the target's distribution p exactly, whatever q the drafter used.
"""

from __future__ import annotations

import torch


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
    """One token per row of `probs` [n, V] → [n]."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def greedy_accept(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draft [B-1]; target_logits [B, V] at the block's positions 0..B-1.

    Returns (accepted count, the target's token after the accepted prefix), both 0-d tensors.
    """
    choice = target_logits.argmax(-1)
    accepted = (draft == choice[:-1]).int().cumprod(0).sum()
    return accepted, choice[accepted]


def speculative_accept(
    draft: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """draft [B-1] sampled from q [B-1, V]; p [B, V] the target's distributions at positions 0..B-1.

    Returns (accepted count, the correction or bonus token), both 0-d tensors.
    """
    n = draft.shape[0]
    rows = torch.arange(n, device=draft.device)
    p_draft = p[rows, draft]
    q_draft = q[rows, draft]
    u = torch.rand(n, generator=generator, device=p.device, dtype=p.dtype)
    ok = u * q_draft < p_draft  # u < p/q without dividing by a zero q
    accepted = ok.int().cumprod(0).sum()
    # One candidate per position, picked by `accepted` afterwards: no host round trip.
    residual = (p[:n] - q).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    # Where p == q the residual is empty; rejection there has probability 0, so any row is fine.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p[:n])
    candidates = torch.cat([residual, p[n:]], dim=0)
    token = sample(candidates, generator)[accepted]
    return accepted, token
