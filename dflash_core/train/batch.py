"""Several training sequences in one drafter forward: right padding, per-row anchors and masks.

`recipe.build_blocks` lays out the blocks of ONE sequence; here a batch of sequences becomes
one [b, ...] tensor set for `DFlashDrafter.forward_train`:

- context: positions [0, T) of every row, T = the largest anchor in the batch (features at or
  after a row's last anchor are never attended, so nothing longer is needed). Rows are right
  padded; padded positions p >= len(row) > every anchor of that row, so the mask never lets a
  block see them, and the target is causal, so padding after a row cannot change its features.
- blocks: every row gets N = max anchors per row blocks; a row with fewer anchors gets dummy
  blocks that attend only to themselves (a query row with no key at all would give NaN) and
  carry no label and no weight.

Features come either from the disk cache (`features.py`, fp16) or ONLINE: the frozen target
reads the padded context batch once per step (`context_features`). On a GPU the target is
tiny next to the step, so a cache would only cost disk and start-up time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .recipe import IGNORE, build_blocks


@dataclass
class PaddedBatch:
    ids: torch.Tensor  # [b, T] long: context tokens, right padded with 0
    lengths: list[int]  # real context length of each row (<= T)
    input_ids: torch.Tensor  # [b, N*B] anchor token then mask tokens, per block
    positions: torch.Tensor  # [b, N*B] absolute positions of the block tokens
    labels: torch.Tensor  # [b, N*B] IGNORE at anchors, past a sequence's end and in dummy blocks
    weights: torch.Tensor  # [b, N*B] loss weight, 0 wherever the label is IGNORE
    mask: torch.Tensor  # bool [b, 1, N*B, T + N*B]
    block_size: int
    ahead: torch.Tensor | None = None  # [b, T + B - 1]: `ids` and the tokens after T that blocks label

    @property
    def context_len(self) -> int:
        return int(self.ids.shape[1])

    def to(self, device: torch.device | str) -> PaddedBatch:
        return PaddedBatch(self.ids.to(device), self.lengths, self.input_ids.to(device), self.positions.to(device),
                           self.labels.to(device), self.weights.to(device), self.mask.to(device), self.block_size,
                           None if self.ahead is None else self.ahead.to(device))


Row = tuple[torch.Tensor, list[int]] | tuple[torch.Tensor, list[int], torch.Tensor | None]


def collate(rows: list[Row], block_size: int, mask_token_id: int,
            gamma: float | None = None) -> PaddedBatch:
    """`rows`: (ids [L], sorted anchors[, greedy [L] or None]) per sequence, each with at least
    one anchor; `greedy`: see `recipe.build_blocks`."""
    if not rows or any(not r[1] for r in rows):
        raise ValueError("every row needs at least one anchor")
    n_max = max(len(r[1]) for r in rows)
    t = max(max(r[1]) for r in rows)
    b = block_size
    ahead = torch.zeros((len(rows), t + b - 1), dtype=torch.long)
    parts = []
    lengths = []
    for r, row in enumerate(rows):
        seq, anchors = row[0], row[1]
        greedy = row[2] if len(row) > 2 else None
        seq = torch.as_tensor(seq, dtype=torch.long)
        n = min(t, seq.shape[0])
        ahead[r, : min(t + b - 1, seq.shape[0])] = seq[: t + b - 1]
        lengths.append(n)
        # Dummy anchors at 0: they see no context key (p < 0) and only their own block.
        bb = build_blocks(seq, [*anchors, *[0] * (n_max - len(anchors))], b, mask_token_id, gamma, context_len=t,
                          greedy=greedy)
        real = len(anchors) * b
        bb.labels[real:] = IGNORE
        bb.weights[real:] = 0.0
        parts.append(bb)
    return PaddedBatch(
        ids=ahead[:, :t].contiguous(), lengths=lengths,
        input_ids=torch.stack([p.input_ids for p in parts]), positions=torch.stack([p.positions for p in parts]),
        labels=torch.stack([p.labels for p in parts]), weights=torch.stack([p.weights for p in parts]),
        mask=torch.cat([p.mask for p in parts]), block_size=b, ahead=ahead,
    )


@torch.no_grad()
def context_features(target: Any, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """The target's hidden states at `layer_ids`, concatenated: [b, T, len(layer_ids)*H].

    No attention mask: rows are right padded and the target is causal (see the module doc).
    `logits_to_keep=1`: the LM head over every position would be wasted work.
    """
    res = target.model(input_ids=ids.to(target.device), output_hidden_states=True, use_cache=False,
                       logits_to_keep=1)
    return layer_features(res.hidden_states, layer_ids)


def layer_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """transformers' `hidden_states` of the layers `layer_ids`, concatenated on the last axis."""
    # hidden_states[0] is the embedding output, so layer i's output is at i + 1.
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


@torch.no_grad()
def features_and_final(target: Any, batch: PaddedBatch, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`context_features` over the batch's context, and the target's last hidden state [b, T+B-1, H]
    over `batch.ahead` (the context and the tokens its blocks label): the head over it is the
    target's own next-token distribution at each labelled position, which distillation learns.
    Causal, so reading the tokens after T leaves the context's features as they were."""
    if batch.ahead is None:
        raise ValueError("distillation needs the tokens after the context (`collate` keeps them in `ahead`)")
    res = target.model(input_ids=batch.ahead.to(target.device), output_hidden_states=True, use_cache=False,
                       logits_to_keep=1)
    feats = layer_features(res.hidden_states, layer_ids)[:, : batch.context_len]
    # transformers reports the last layer after the final norm: the hidden state the LM head reads.
    return feats, res.hidden_states[-1]


def cached_features(feats: list[torch.Tensor], t: int) -> torch.Tensor:
    """Right-padded [b, t, F] from per-sequence cached features (zeros where a row is shorter)."""
    out = torch.zeros((len(feats), t, feats[0].shape[-1]), dtype=feats[0].dtype)
    for r, f in enumerate(feats):
        n = min(t, f.shape[0])
        out[r, :n] = f[:n]
    return out


@dataclass
class BatchOutput:
    logits: torch.Tensor  # [M, V] for the M labelled block positions only
    labels: torch.Tensor  # [M]
    weights: torch.Tensor  # [M]
    rows: torch.Tensor  # [M] row of each labelled position
    slots: torch.Tensor  # [M] position inside its block (1..B-1)
    # DFlash 2: the selector's scores of each position's top-k candidates [M, k], given the true
    # previous token, and the label's index among them (IGNORE where it is not one of them)
    selector_scores: torch.Tensor | None = None
    selector_labels: torch.Tensor | None = None
    # Distillation: the target's own logits at each labelled position [M, V] (over the same head),
    # and the share of the loss that learns their distribution instead of the label alone.
    teacher: torch.Tensor | None = None
    distill: float = 0.0

    def loss(self) -> torch.Tensor:
        """The weighted cross entropy of the whole batch (one normaliser for all rows, as if all
        blocks were one sequence's: rows with more valid positions count more), plus the
        selector's over its candidates, weighted alike. With a teacher, a `distill` share of each
        position's cross entropy is against the target's distribution rather than its label."""
        logits = self.logits.float()
        ce = F.cross_entropy(logits, self.labels, reduction="none")
        if self.teacher is not None and self.distill > 0:
            soft = F.cross_entropy(logits, self.teacher.float().softmax(-1), reduction="none")
            ce = (1 - self.distill) * ce + self.distill * soft
        loss = (ce * self.weights).sum() / self.weights.sum().clamp_min(1e-12)
        if self.selector_scores is not None and self.selector_labels is not None:
            sel = F.cross_entropy(self.selector_scores, self.selector_labels, reduction="none", ignore_index=IGNORE)
            loss = loss + (sel * self.weights).sum() / self.weights.sum().clamp_min(1e-12)
        return loss

    @torch.no_grad()
    def row_loss(self, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of w*ce, sum of w) per row: each row's own weighted loss is their ratio."""
        ce = F.cross_entropy(self.logits.float(), self.labels, reduction="none")
        num = torch.zeros(n_rows, device=ce.device).index_add_(0, self.rows, ce * self.weights)
        den = torch.zeros(n_rows, device=ce.device).index_add_(0, self.rows, self.weights)
        return num, den

    @torch.no_grad()
    def position_hits(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(hits, counts), each [B] on the CPU: accuracy per block position of the drafter's
        choice (the argmax; DFlash 2: the selector's, after the true previous tokens)."""
        if self.selector_scores is not None and self.selector_labels is not None:
            ok = (self.selector_scores.argmax(-1) == self.selector_labels).long()
        else:
            ok = (self.logits.argmax(-1) == self.labels).long()
        hits = torch.zeros(block_size, dtype=torch.long, device=ok.device).index_add_(0, self.slots, ok)
        counts = torch.zeros(block_size, dtype=torch.long, device=ok.device).index_add_(
            0, self.slots, torch.ones_like(ok))
        return hits.cpu(), counts.cpu()


def token_counts(replies: list[torch.Tensor], vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size)
    for r in replies:
        counts.index_add_(0, r, torch.ones(r.shape[0]))
    return counts


class HeadSubset:
    """The `size` most frequent reply tokens: a training-only LM head over a vocabulary subset.

    On a CPU the [V]-wide head is most of a drafter step (V = 49152 for SmolLM2, against a
    hidden size of 576), while the target's replies use a few thousand distinct tokens. Training
    against the rows of the frequent tokens only (as EAGLE-3 trains a reduced draft vocabulary)
    makes steps several times cheaper; labels outside the subset are dropped from the loss.
    The checkpoint records the subset (`DFlashDrafter.draft_vocab`), and the engine drafts from it.
    """

    def __init__(self, token_counts: torch.Tensor, size: int) -> None:
        order = token_counts.argsort(descending=True, stable=True)
        self.keep = order[: min(size, int((token_counts > 0).sum()))].sort().values
        self.index = torch.full((token_counts.shape[0],), -1, dtype=torch.long)
        self.index[self.keep] = torch.arange(self.keep.shape[0])
        self.coverage = float(token_counts[self.keep].sum() / token_counts.sum().clamp_min(1))
        self._rows: tuple[torch.Tensor, torch.Tensor | None] | None = None  # the head's kept rows (frozen)

    @classmethod
    def from_replies(cls, replies: list[torch.Tensor], vocab_size: int, size: int) -> HeadSubset:
        """The `size` most frequent tokens of these replies (token id tensors)."""
        return cls(token_counts(replies, vocab_size), size)

    @classmethod
    def from_tokens(cls, keep: torch.Tensor, replies: list[torch.Tensor], vocab_size: int) -> HeadSubset:
        """A given subset (e.g. a warm start's draft vocabulary), its coverage counted on these replies."""
        counts = token_counts(replies, vocab_size)
        # Ranked above every other token, the subset is exactly what the constructor keeps.
        boosted = counts.clone()
        boosted[keep] += counts.sum() + 1
        head = cls(boosted, int(keep.numel()))
        head.coverage = float(counts[head.keep].sum() / counts.sum().clamp_min(1))
        return head

    def logits(self, target: Any, hidden: torch.Tensor) -> torch.Tensor:
        # The head is frozen: gather its kept rows once, not on every step.
        if self._rows is None or self._rows[0].device != hidden.device or self._rows[0].dtype != hidden.dtype:
            weight, bias = target.lm_head_rows(self.keep)
            self._rows = (weight.to(hidden.device, hidden.dtype),
                          None if bias is None else bias.to(hidden.device, hidden.dtype))
        return F.linear(hidden, *self._rows)


def batch_forward(drafter: Any, target: Any, batch: PaddedBatch, context: torch.Tensor,
                  autocast: torch.dtype | None = None, head: HeadSubset | None = None,
                  final: torch.Tensor | None = None, distill: float = 0.0) -> BatchOutput:
    """Drafter logits for the labelled positions of a padded batch (frozen target embedding/head).

    Only labelled positions go through the LM head: the anchor slot (1/B of all) and padding
    never need a [V]-wide row, and the head is the largest matrix product of the step. With
    `head`, logits and labels are over its subset (labels outside it are dropped). With the
    target's last hidden state `final` (`features_and_final`), the output carries the target's
    logits over the same head at each labelled position, for a `distill` share of the loss.
    """
    dev = drafter.fc.weight.device
    batch = batch.to(dev)
    with torch.no_grad():
        emb = target.embed(batch.input_ids.to(target.device)).to(dev)
    valid = batch.labels != IGNORE
    labels = batch.labels
    if head is not None:
        labels = torch.where(valid, head.index.to(dev)[labels.clamp_min(0)], IGNORE)
        valid = labels >= 0
    with torch.autocast(dev.type, dtype=autocast, enabled=autocast is not None):
        dtype = autocast or drafter.fc.weight.dtype
        hidden = drafter.forward_train(context.to(dev, dtype), emb.to(dtype), batch.positions, batch.mask,
                                       batch.block_size)
        logits = drafter.shape_logits(
            target.lm_head(hidden[valid].to(target.dtype)) if head is None else head.logits(target, hidden[valid]))
        selector = getattr(drafter, "candidate_selector", None)
        scores, picks = (None, None) if selector is None else selector_targets(
            selector, hidden, logits, batch, valid, labels[valid], head)
    rows = torch.arange(valid.shape[0], device=dev)[:, None].expand_as(valid)[valid]
    slots = (torch.arange(valid.shape[1], device=dev) % batch.block_size)[None, :].expand_as(valid)[valid]
    teacher = None
    if final is not None:
        with torch.no_grad():
            # The label at position p is the target's choice after reading up to p - 1.
            h = final.to(dev)[rows, batch.positions[valid] - 1]
            # A head subset keeps its rows in the drafter's logits' dtype: the teacher reads them alike.
            teacher = target.lm_head(h) if head is None else head.logits(target, h.to(logits.dtype))
    return BatchOutput(logits=logits, labels=labels[valid], weights=batch.weights[valid].float(),
                       rows=rows, slots=slots, selector_scores=scores, selector_labels=picks,
                       teacher=teacher, distill=distill)


def selector_targets(selector: Any, hidden: torch.Tensor, logits: torch.Tensor, batch: PaddedBatch,
                     valid: torch.Tensor, labels: torch.Tensor, head: HeadSubset | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """DFlash 2's selector, teacher forced: each labelled position's top-k candidates scored
    after the TRUE previous token (the anchor at a block's first position), which is what the
    selector sees whenever the path so far is right, the only case acceptance depends on.
    Returns the scores [M, k] and the label's index among the candidates (IGNORE: not among them)."""
    first = (torch.arange(valid.shape[1], device=valid.device) % batch.block_size == 1)[None, :]
    previous = torch.where(first, batch.input_ids.roll(1, 1), batch.labels.roll(1, 1))[valid]
    unary, index = logits.detach().topk(min(selector.top_k, logits.shape[-1]), -1)
    candidates = index if head is None else head.keep.to(index.device)[index]
    found = index == labels[:, None]
    picks = torch.where(found.any(-1) & (previous >= 0), found.int().argmax(-1), IGNORE)
    scores = unary.float() + selector.pair_scores(hidden[valid], previous.clamp_min(0), candidates).float()
    return scores, picks
