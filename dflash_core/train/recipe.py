"""The DFlash training recipe as pure functions: anchors, the block-sparse mask, the loss weights.

One training sequence is `ids = prompt + response` (length L) with the target's features
`feats[p]` for every position p (the target's hidden states after reading token p). A block
anchored at position `a` is the tokens [ids[a], mask, ..., mask] at positions a..a+B-1; it
sees the context features of positions [0, a) (exactly what `DFlashDrafter.step` gives it at
inference: the anchor is the newest committed token, whose features the target has not
produced yet) and itself, bidirectionally; it learns to predict ids[a+1 .. a+B-1].

Many blocks of one sequence go through `DFlashDrafter.forward_train` in one pass, laid end to
end after the context keys; `block_attention_mask` keeps them apart.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise
from typing import Protocol

import torch

IGNORE = -100


def default_gamma(block_size: int) -> float:
    """Decay of the loss weight over block positions.

    The DFlash paper uses gamma 7 for B = 16, 5 for B = 10 and 4 for B = 8: roughly linear in
    B (1 + 3B/8 fits all three within 0.25). Scaling with B keeps the weight of the last
    position similar (exp(-14/7) ~ 0.14 at B = 16) whatever the block size.
    """
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, 1.0 + 0.375 * block_size)


def position_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """[B] loss weight per block position: 0 for the anchor (given, not predicted), then
    exp(-(k-1)/gamma) for k = 1..B-1 (early positions matter most: a draft is accepted up to
    its first mistake)."""
    g = default_gamma(block_size) if gamma is None else gamma
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / g)
    w[0] = 0.0
    return w


def sample_anchors(prompt_len: int, seq_len: int, n: int, generator: torch.Generator | None = None) -> list[int]:
    """Up to `n` distinct anchor positions, sorted, each with the anchor and the next token in
    the response: prompt_len <= a <= seq_len - 2.

    Anchors are distinct, but their blocks may overlap (a block spans B positions and anchors
    may be closer than B): blocks never attend to each other, so overlap costs nothing and lets
    short replies yield as many blocks as long ones.
    """
    lo, hi = prompt_len, seq_len - 2
    if prompt_len < 1:
        raise ValueError("a block needs a non-empty prompt before it (context features for [0, anchor))")
    if hi < lo or n <= 0:
        return []
    count = hi - lo + 1
    if count <= n:
        return list(range(lo, hi + 1))
    pick = torch.randperm(count, generator=generator)[:n]
    return sorted(int(i) + lo for i in pick)


@dataclass
class BlockBatch:
    """The inputs and labels of `len(anchors)` blocks of one sequence, laid end to end."""

    anchors: list[int]
    block_size: int
    input_ids: torch.Tensor  # [N*B] anchor token then mask tokens, per block
    positions: torch.Tensor  # [N*B] absolute positions a..a+B-1
    labels: torch.Tensor  # [N*B] ids[a+k] for k >= 1 inside the sequence, else IGNORE
    weights: torch.Tensor  # [N*B] loss weight (0 where the label is IGNORE)
    mask: torch.Tensor  # bool [1, 1, N*B, T + N*B], T = context_len
    context_len: int  # features of positions [0, T) are the context keys


def block_attention_mask(anchors: list[int], block_size: int, context_len: int) -> torch.Tensor:
    """bool [N*B, T + N*B]: True where a block query may attend.

    Keys are the T context positions, then the N blocks end to end. Block j sees context keys
    p < anchors[j] (never its own anchor's features: at inference they do not exist yet) and
    its own B keys in both directions; never another block.
    """
    n, b = len(anchors), block_size
    if any(a > context_len for a in anchors):
        raise ValueError(f"context of {context_len} positions is too short for anchors up to {max(anchors)}")
    a = torch.tensor(anchors, dtype=torch.long).repeat_interleave(b)  # [N*B] anchor of each query
    p = torch.arange(context_len)[None, :]
    ctx = p < a[:, None]
    blk = torch.arange(n).repeat_interleave(b)
    own = blk[:, None] == blk[None, :]
    return torch.cat([ctx, own], dim=1)


def build_blocks(ids: torch.Tensor | list[int], anchors: list[int], block_size: int, mask_token_id: int,
                 gamma: float | None = None, context_len: int | None = None,
                 greedy: torch.Tensor | None = None) -> BlockBatch:
    """Blocks for one sequence `ids` [L] at the given anchors.

    `context_len` defaults to the last anchor: features at or after it are never attended.
    `greedy` [L] (a dataset's own answer read by the target, see `answers.py`): greedy[p] is
    the target's choice for position p given ids[:p]. Labels then follow the target, not the
    text: position k of a block anchored at a is labelled greedy[a+k] while the text agrees
    with the target at a+1..a+k-1, and carries no label after the first disagreement (the
    text is then not what the target would have read). Without it the text is the target's
    own reply and is its own label.
    """
    ids = torch.as_tensor(ids, dtype=torch.long)
    seq_len = ids.shape[0]
    b = block_size
    if not anchors:
        raise ValueError("no anchors")
    pos = torch.tensor(anchors, dtype=torch.long)[:, None] + torch.arange(b)[None, :]  # [N, B]
    inside = pos < seq_len
    at = pos.clamp_max(seq_len - 1)
    if greedy is None:
        labels = torch.where(inside, ids[at], IGNORE)
    else:
        greedy = torch.as_tensor(greedy, dtype=torch.long)
        agree = (ids[at] == greedy[at]) & inside
        agree[:, 0] = True  # the anchor is given: the chain starts after it
        # Position k is exact while every earlier block position agreed: cumprod of the agreement, shifted by one.
        chain = torch.cat([torch.ones_like(agree[:, :1]), agree[:, :-1]], dim=1).long().cumprod(1).bool()
        labels = torch.where(inside & chain, greedy[at], IGNORE)
    labels[:, 0] = IGNORE  # the anchor is given, not predicted
    inp = torch.full_like(pos, mask_token_id)
    inp[:, 0] = ids[pos[:, 0]]
    w = position_weights(b, gamma)[None, :].expand_as(pos) * (labels != IGNORE)
    t = max(anchors) if context_len is None else context_len
    mask = block_attention_mask(anchors, b, t)[None, None]
    return BlockBatch(anchors=list(anchors), block_size=b, input_ids=inp.reshape(-1), positions=pos.reshape(-1),
                      labels=labels.reshape(-1), weights=w.reshape(-1).contiguous(), mask=mask, context_len=t)


def expected_accepted(hits: torch.Tensor, counts: torch.Tensor) -> float:
    """A rough tau from per-position accuracies, treating positions as independent:
    1 + sum_k prod_{j<=k} acc_j (the accepted prefix plus the target's bonus token)."""
    acc = (hits[1:].float() / counts[1:].clamp_min(1).float()).tolist()
    tau, run = 1.0, 1.0
    for p in acc:
        run *= p
        tau += run
    return tau if math.isfinite(tau) else 1.0


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine down to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / max(1, warmup)
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))


class _Seq(Protocol):
    ids: torch.Tensor
    prompt_len: int


def bigram_accuracy(train_seqs: Iterable[_Seq], eval_seqs: Iterable[_Seq]) -> float:
    """Block-position-1 accuracy of "the most frequent successor of the anchor token" learnt from
    the training replies: the floor a drafter that uses its anchor must clearly beat."""
    succ: dict[int, Counter[int]] = defaultdict(Counter)
    for seq in train_seqs:
        for a, b in pairwise(seq.ids[seq.prompt_len:].tolist()):
            succ[a][b] += 1
    best = {a: c.most_common(1)[0][0] for a, c in succ.items()}
    hits = total = 0
    for seq in eval_seqs:
        for a, b in pairwise(seq.ids[seq.prompt_len:].tolist()):
            hits += best.get(a) == b
            total += 1
    return hits / max(total, 1)
