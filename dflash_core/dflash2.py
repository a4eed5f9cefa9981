"""What DFlash 2 adds to a DFlash drafter (z-lab's DFlash2DraftModel), as modules `drafter.py` uses.

- `DynamicConv`: around each layer's attention and MLP, a causal convolution along the block's
  positions whose kernel is a learnt base plus a part computed from each position's own input
  (one weight per channel group). `prepare` convolves the sublayer's input and computes the
  kernel `finish` applies to its output, both from the same normed input.
- `CandidateSelector`: the block's tokens are no longer each position's argmax but a path walked
  left to right: at each position the top-k logits are rescored by a low-rank bilinear term of
  the token chosen before (predecessor codebook), the position's hidden state and each
  candidate (successor codebook). Greedy takes each step's best score; sampling draws from the
  softmax of the scores, so the proposal q lives on those k candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .packing import PackingLinear
from .verify import sample


class DynamicConv(nn.Module):
    """Grouped dynamic causal convolution (`conv_kernel_size` taps, `conv_group_size` channels
    share a dynamic weight). Inputs are [..., L, H], convolved along L (one block's positions)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = PackingLinear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return self._convolve(x, dynamic[..., 0, :, :], self.base_kernel[0]), dynamic[..., 1, :, :]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return self._convolve(x, dynamic, self.base_kernel[1])

    def _convolve(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """out[l] = sum over taps o of x[l - o] * (base[o] + dynamic[l, o] per group); x[<0] = 0.
        Summed in z-lab's order (base, then dynamic, tap by tap) so the float results agree."""
        *lead, length, _ = x.shape
        blocks = x.reshape(*lead, length, self.groups, self.group_size)
        dynamic = dynamic.unsqueeze(-1)  # [..., L, K, G, 1]
        out = torch.zeros_like(blocks)
        for o in range(min(self.kernel_size, length)):  # taps before the block's start add nothing
            values = blocks if o == 0 else F.pad(blocks[..., :-o, :, :], (0, 0, 0, 0, o, 0))
            out = out + base[o].view(self.groups, self.group_size).to(x.dtype) * values
            out = torch.addcmul(out, dynamic[..., o, :, :], values)
        return out.reshape(x.shape)


@dataclass
class Walk:
    """The selector's choices for a block's positions 1..n."""

    path: torch.Tensor  # [n] the chosen tokens (vocabulary ids)
    candidates: torch.Tensor  # [n, k] each position's top-k tokens, best score first given the path
    probs: torch.Tensor  # [n, k] softmax of the scores given the path's predecessor, same order
    chosen: torch.Tensor  # [n] the path's index into each row of `candidates`
    q: torch.Tensor | None  # [n, k] the proposal rows when sampling (softmax at the temperature)
    # Every predecessor at once: each position's top-k in logit order [n, k], and the softmax of
    # their scores after each of the previous position's (the anchor's at position 1) [n, k, k]
    ids: torch.Tensor
    given: torch.Tensor


class CandidateSelector(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, top_k: int, rank: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def pair_scores(self, hidden: torch.Tensor, previous: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """The bilinear term for candidates [..., k] after tokens `previous` [...] at positions
        whose hidden states are `hidden` [..., H] (training scores every position at once)."""
        mixed = self.predecessor_codebook(previous) * self.hidden_projection(hidden)
        return torch.einsum("...r,...kr->...k", mixed, self.successor_codebook(candidates))

    @torch.no_grad()
    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: int, vocab: torch.Tensor | None,
             temperature: float, generator: torch.Generator | None) -> Walk:
        """hidden [n, H] and logits [n, Vd] of positions 1..n (over the draft vocabulary `vocab`,
        or all tokens); temperature 0: greedy. Every position's scores after every candidate
        before it are one product, so the walk itself only picks rows."""
        unary, index = logits.topk(min(self.top_k, logits.shape[-1]), -1)
        ids = index if vocab is None else vocab[index]
        n, k = ids.shape
        previous = torch.cat([ids.new_full((1, k), anchor), ids[:-1]])  # [n, k]: position 1 follows the anchor
        mixed = self.predecessor_codebook(previous).float() * self.hidden_projection(hidden).float()[:, None, :]
        scores = unary[:, None, :] + torch.einsum("nir,njr->nij", mixed, self.successor_codebook(ids).float())
        picks, before, qs = [], 0, []
        if temperature > 0:
            for p in range(n):
                q = torch.softmax(scores[p, before] / temperature, -1)
                before = int(sample(q[None], generator)[0])
                qs.append(q)
                picks.append(before)
        else:
            for row in scores.argmax(-1).tolist():
                before = row[before]
                picks.append(before)
        chosen = torch.tensor(picks, device=ids.device)
        along = scores[torch.arange(n, device=ids.device), torch.cat([chosen.new_zeros(1), chosen[:-1]])]
        probs, order = torch.softmax(along, -1).sort(-1, descending=True)
        q = torch.stack(qs).gather(1, order) if qs else None
        return Walk(path=ids.gather(1, chosen[:, None])[:, 0], candidates=ids.gather(1, order), probs=probs,
                    chosen=(order == chosen[:, None]).int().argmax(-1), q=q, ids=ids,
                    given=torch.softmax(scores, -1))


# The codebooks' start: the bilinear term is a product of three factors, so at the usual 0.02 a
# zero-started hidden projection barely moves it (a warm-started run's selector loss stayed flat
# over 70 steps at lr 1e-4; bench/HISTORY.md).
CODEBOOK_STD = 0.1
# The selector is new where the rest is warm-started: it learns at this multiple of the run's lr.
SELECTOR_LR_SCALE = 10.0


def dflash2_config(cfg: Any, kernel_size: int = 4, group_size: int = 64, top_k: int = 8, rank: int = 64) -> Any:
    """A DFlash 2 drafter's config with the shape of DFlash 1 config `cfg` (a `DFlashConfig`)."""
    return replace(cfg, conv_kernel_size=kernel_size, conv_group_size=group_size, selector_top_k=top_k,
                   selector_rank=rank)


@torch.no_grad()
def upgrade(v1: nn.Module, v2: nn.Module, seed: int = 0) -> nn.Module:
    """Start DFlash 2 drafter `v2` from DFlash 1 drafter `v1` (a warm start for training): its
    layers' weights, convolutions that pass their input through (the first tap 1, the others
    and the dynamic part 0), and a selector whose bilinear term is 0 (a zero hidden projection;
    random codebooks, so it learns), whose path is then each position's argmax: it drafts as
    `v1` until trained."""
    missing, _ = v2.load_state_dict(v1.state_dict(), strict=False)
    g = torch.Generator().manual_seed(seed)
    for name, p in v2.named_parameters():
        if name not in missing:
            continue
        if name.endswith("base_kernel"):
            p.zero_()[:, 0].fill_(1.0)
        elif "codebook" in name:
            p.copy_(torch.randn(p.shape, generator=g) * CODEBOOK_STD)
        else:  # kernel projections and the selector's hidden projection
            p.zero_()
    v2.draft_vocab, v2.corpus = v1.draft_vocab, v1.corpus
    return v2
