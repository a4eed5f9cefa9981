"""bf16 maths on CPUs with bf16 hardware (AMX, AVX512-BF16) in which a row's result never
depends on its neighbours.

Speculative decoding is lossless only if the target's logits for a token are the same whether it
is computed alone (plain decoding) or as one row of a verify pass. Floating-point results depend on
the order of additions, and a library picks a different kernel, blocking or thread split for a
different number of rows; in bf16 the rounding is coarse enough that such a difference flips a
near-tie every few hundred tokens. This module computes so that it cannot:

- Linear layers: on AVX512-BF16 (AMX CPUs have it too), a compiled kernel (cpu_kernels.py) sums
  each output in one fixed order, whatever the rows. Elsewhere oneDNN's bf16 GEMM, which gives each
  row the same bits for 2..32 rows (measured for every shape of SmolLM2, with AMX and with
  AVX512-BF16; 33 rows and more take another kernel), so a pass is cut into calls of at most
  `MAX_ROWS` rows, and a lone row, whose kernel's bits differ, is computed as a pair
  (`MIN_ROWS`). The weights are laid out once, which is also what makes bf16 fast: a 16-token
  pass costs ~1.26x a one-token pass on the AMX Xeon (fp32 with MKL-packed weights: ~1.8x), so
  verifying a block or a tree is cheap. Linears that read the same input (q/k/v, gate/up) run as
  one GEMM (`InvariantLinear.joined`).
- Attention: the keys a row sees are laid out by their absolute position and reduced in fixed
  chunks of `CHUNK` positions, whatever the pass: a verify row at position p and a plain step at
  p see the same keys in the same slots (a tree row's ancestors are gathered into the slots their
  positions name). One GEMM per chunk against the values and a column of ones beside them gives
  the chunk's weighted values and its weights' total; the chunks are added by adjacent pairs,
  level by level (`_pairwise_sum`), so trailing all-masked chunks add exact zeros.

`FastForward` checks the result on the model itself when it is built (`rows_agree`): a verify pass
and a tree pass must give plain decoding's logits bit for bit, or the fast forward falls back to
float32. Everything else in a layer (norms, RoPE, SiLU, residual adds) works row by row already.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import cpu_kernels

MAX_ROWS = 32  # rows per oneDNN call; see the module docstring
MIN_ROWS = 2  # a lone row is computed beside a copy of itself; see the module docstring
CHUNK = 64  # key positions per attention chunk (a multiple of 16: exp and sums run without scalar tails)


def whole_chunks(n: int) -> int:
    """`n` rounded up to whole attention chunks (`CHUNK` key positions)."""
    return -(-n // CHUNK) * CHUNK


def _cpu_supports(probe: str) -> bool:
    """torch's own CPU feature probe `probe` (False where this torch lacks it)."""
    return bool(getattr(getattr(torch, "cpu", None), probe, lambda: False)())


def cpu_has_bf16_units() -> bool:
    """This CPU multiplies bf16 in hardware: AMX tiles or AVX512-BF16 dot products."""
    return _cpu_supports("_is_amx_tile_supported") or _cpu_supports("_is_avx512_bf16_supported")


def bf16_units() -> str:
    """The bf16 hardware oneDNN runs on here, for reports."""
    return "AMX" if _cpu_supports("_is_amx_tile_supported") else "AVX512-BF16"


@functools.cache
def bf16_gemm_available() -> bool:
    """This CPU multiplies bf16 in hardware and torch's oneDNN can use it."""
    if not cpu_has_bf16_units() or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def onednn_weight(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 or fp32 [out, in] weight reordered once into oneDNN's layout (for `onednn_linear`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 16)


def bf16_layout(weight: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A bf16 [out, in] weight laid out once for its row-invariant GEMM, and the compiled module
    that multiplies through it: the compiled kernel's layout where it applies (cpu_kernels.py),
    else oneDNN's (module None, `onednn_linear`)."""
    compiled = cpu_kernels.linear_kernel() if cpu_kernels.linear_fits(weight) else None
    if compiled is not None:
        return compiled.pack_linear(weight.detach().contiguous()), compiled
    return onednn_weight(weight), None


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] (the weight's dtype) times a weight laid out by `onednn_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def joined_weight(modules: list[torch.nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias of linear layers that read the same input, as one layer whose outputs
    are theirs side by side (q/k/v, gate/up); a missing bias counts as zeros."""
    weights = [m.weight.detach() for m in modules]
    biases = [getattr(m, "bias", None) for m in modules]
    bias = None
    if any(b is not None for b in biases):
        pairs = zip(weights, biases, strict=True)
        bias = torch.cat([w.new_zeros(w.shape[0]) if b is None else b.detach() for w, b in pairs])
    return torch.cat(weights), bias


@dataclass
class InvariantLinear:
    """A bf16 linear layer whose rows never depend on the pass: the compiled kernel
    (cpu_kernels.py) where it applies, else oneDNN with its weight reordered once."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: torch.Tensor
    compiled: Any = None  # the compiled module that multiplies through `packed`, if any

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> InvariantLinear:
        w = weight.detach().to(torch.bfloat16).contiguous()
        b = None if bias is None else bias.detach().to(torch.bfloat16)
        packed, compiled = bf16_layout(w)
        return cls(w, b, packed, compiled)

    @classmethod
    def joined(cls, modules: list[torch.nn.Module]) -> InvariantLinear:
        """Linear layers that read the same input as one (`joined_weight`)."""
        return cls.of(*joined_weight(modules))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.compiled is not None:
            return self.compiled.linear(x, self.packed, self.bias)
        if x.shape[0] < MIN_ROWS:
            return onednn_linear(x.expand(MIN_ROWS, -1).contiguous(), self.packed, self.bias)[:1]
        if x.shape[0] <= MAX_ROWS:
            return onednn_linear(x, self.packed, self.bias)
        return torch.cat([self(x[i : i + MAX_ROWS]) for i in range(0, x.shape[0], MAX_ROWS)])

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """All rows in one call: faster for many rows, but through oneDNN a row's bits then
        depend on how many there are (for a prefill, which no other pass has to match)."""
        if self.compiled is not None:
            return self.compiled.linear(x, self.packed, self.bias)
        return onednn_linear(x, self.packed, self.bias)


@dataclass
class AttentionPlan:
    """Where each row of a pass finds its keys, shared by every layer of the pass.

    As the compiled kernel reads it (cpu_kernels.py): row r sees buffer rows [0, before[r]) and
    then after[r, :after_count[r]], in position order. The torch calls read the same, derived on
    first use (the kernel never needs them): keys in buffer rows [0, `in_place`) are read where
    they are (a multiple of CHUNK), under `mask` [n, in_place] (None: all visible); that is all
    of a chain pass, whose rows sit at their positions. A tree pass reads in place only below
    `base` (the chunk boundary at or before its start): there, row r's slot s holds the key at
    position `base + s` as r sees it, the cache's row below the pass's start and r's ancestors
    above it (`index[r, s]`, its buffer row); `visible[r, s]` is False past r's own position."""

    length: int  # keys in the buffer after this pass appended its rows
    in_place: int
    before: torch.Tensor  # [n] long
    after: torch.Tensor  # [n, E] long; a tree pass: the buffer row of each row's ancestor at each depth
    after_count: torch.Tensor  # [n] long; a tree pass: each row's depth + 1
    base: int = 0
    is_tree: bool = False

    # Derived once per pass, read by every layer.
    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        if self.is_tree:
            return None
        return torch.arange(self.in_place, device=self.before.device)[None, :] < self.before[:, None]

    @functools.cached_property
    def _region(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A tree pass's (index, visible)."""
        if not self.is_tree:
            return None
        n, deepest = self.before.shape[0], self.after.shape[1] - 1
        start, base, depths, dev = self.length - n, self.base, self.after_count - 1, self.before.device
        pos = base + torch.arange(whole_chunks(start + deepest + 1 - base), device=dev)
        in_pass = (pos[None, :] >= start) & (pos[None, :] <= start + depths[:, None])
        seen = (pos[None, :] < start) | in_pass
        index = torch.where(in_pass, self.after[:, (pos - start).clamp(0, deepest)], pos[None, :])
        index = torch.where(seen, index, torch.full_like(index, base))  # masked slots read any real row
        return index, seen

    @property
    def index(self) -> torch.Tensor | None:  # [n, W] long, W a multiple of CHUNK
        return None if self._region is None else self._region[0]

    @property
    def visible(self) -> torch.Tensor | None:  # [n, W] bool
        return None if self._region is None else self._region[1]

    @functools.cached_property
    def masked(self) -> torch.Tensor | None:
        return None if self.mask is None else ~self.mask

    @functools.cached_property
    def region_masked(self) -> torch.Tensor | None:
        return None if self.visible is None else ~self.visible

    @functools.cached_property
    def region_slots(self) -> torch.Tensor | None:
        """`index` relative to `base`: where each slot's score sits in the scores from `base` on."""
        return None if self.index is None else self.index - self.base

    @property
    def extent(self) -> int:
        """Buffer rows the scores cover: whole chunks, past `length` only to finish the last one
        (masked there, or never gathered). Whole chunks also keep the scores' GEMM to a few
        shapes: oneDNN builds a new kernel for every new shape (~0.4 ms), which a tree pass's
        exact length would ask for at nearly every block."""
        return whole_chunks(self.length) if self.is_tree else self.in_place

    @classmethod
    def chain(cls, start: int, n: int, device: torch.device) -> AttentionPlan:
        """Rows at positions start..start+n-1, each seeing everything before it."""
        length = start + n
        before = torch.arange(start + 1, length + 1, device=device)
        none = torch.zeros(n, 0, dtype=torch.long, device=device)
        return cls(length, whole_chunks(length), before, none, torch.zeros_like(before))

    @classmethod
    def tree(cls, start: int, depths: torch.Tensor, visible: torch.Tensor) -> AttentionPlan:
        """Rows at positions start + depths[r]; `visible[r, j]`: row j is r itself or an ancestor
        (so r sees exactly one row per depth up to its own)."""
        n = depths.shape[0]
        dev = depths.device
        base = start // CHUNK * CHUNK
        ancestor = torch.zeros(n, int(depths.max()) + 1, dtype=torch.long, device=dev)
        r_idx, j_idx = visible.nonzero(as_tuple=True)
        ancestor[r_idx, depths[j_idx]] = start + j_idx
        before = torch.full((n,), start, dtype=torch.long, device=dev)
        return cls(start + n, base, before, ancestor, depths.long() + 1, base, is_tree=True)


def values_with_ones(layer: object) -> torch.Tensor:
    """A cache layer's values [kv_heads, S, head_dim + 1] with the column of ones `attention`
    reads: the layer's own buffer (`TargetCache(value_ones=True)`, what a batch-invariant target
    allocates), or a padded copy of a plain cache's."""
    full = getattr(layer, "values_ones", None)
    if full is not None:
        return full[0]
    return F.pad(layer.values[0], (0, 1), value=1.0)  # type: ignore[attr-defined]


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: AttentionPlan,
              scale: float) -> torch.Tensor:
    """q [heads, n, hd] (bf16, RoPE applied) over keys [kv_heads, S, hd] and values with a
    column of ones [kv_heads, S, hd + 1] (`values_with_ones`), the layer's whole buffers with
    this pass's rows already written; [heads, n, hd]."""
    compiled = cpu_kernels.attention_kernel(q.shape[-1])
    if compiled is not None:
        return compiled.attention(q, keys, values, plan.before, plan.after, plan.after_count, scale)  # type: ignore[attr-defined]
    heads, n, hd = q.shape
    nkv = keys.shape[0]
    g = heads // nkv
    extent, in_place = plan.extent, plan.in_place
    if keys.shape[1] < extent:  # the buffer ends inside the last chunk: pad it (masked anyway)
        keys = F.pad(keys, (0, 0, 0, extent - keys.shape[1]))
        values = F.pad(values, (0, 0, 0, extent - values.shape[1]))
    # Scores against the buffer in one GEMM: each is a head_dim-term dot product, computed the
    # same way for any number of rows or keys (what `FastForward.rows_agree` checks). The scale
    # goes on the queries (exact in bf16 when it is a power of two, as for head_dim 64 or 256).
    s = torch.matmul((q * scale).reshape(nkv, g * n, hd), keys[:, :extent].transpose(1, 2)).float()
    s = s.view(nkv, g, n, extent)
    own = s[..., :in_place]
    if plan.masked is not None:
        own = own.masked_fill_(plan.masked, float("-inf"))
    top = own.amax(-1, keepdim=True) if in_place else None
    region = None
    if plan.region_slots is not None and plan.region_masked is not None:
        idx = plan.region_slots.expand(nkv, g, n, -1)
        region = torch.gather(s[..., plan.base :], 3, idx).masked_fill_(plan.region_masked, float("-inf"))
        top = region.amax(-1, keepdim=True) if top is None else torch.maximum(top, region.amax(-1, keepdim=True))
    # Each chunk's weighted values and weight total (the ones column), [kv_heads, chunks, g*n,
    # hd + 1] in position order: one bf16 GEMM with K = CHUNK per chunk, whose rows are
    # independent of the other rows. Masked keys weigh exactly 0.
    parts: list[torch.Tensor] = []
    c_own = in_place // CHUNK
    if in_place:
        p = own.sub_(top).exp_().to(values.dtype).view(nkv, g * n, c_own, CHUNK).transpose(1, 2)
        parts += torch.matmul(p, values[:, :in_place].view(nkv, c_own, CHUNK, hd + 1)).unbind(1)
    if region is not None and plan.index is not None:
        c_reg = region.shape[-1] // CHUNK
        # A [g, CHUNK] block per row and chunk, against that row's own keys (its ancestors').
        p = region.sub_(top).exp_().to(values.dtype).view(nkv, g, n, c_reg, CHUNK).permute(0, 2, 3, 1, 4)
        v = values.index_select(1, plan.index.view(-1)).view(nkv, n, c_reg, CHUNK, hd + 1)
        parts += torch.matmul(p, v).permute(2, 0, 3, 1, 4).reshape(c_reg, nkv, g * n, hd + 1).unbind(0)
    total = _pairwise_sum(parts)
    return (total[..., :hd] / total[..., hd:]).to(q.dtype).view(heads, n, hd)


def _pairwise_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """Sum by adjacent pairs, level by level, an odd last part passing to the next level as it
    is: part i's path through the additions depends only on i (as if the count were padded with
    zeros to a power of two), and the chunks past a row's position are zeros, so a row gets the
    same bits whatever the number of trailing chunks."""
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]
