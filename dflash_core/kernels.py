"""Triton kernels for a block's accept step, so the loop needs no host round trip to decide what to keep.

Each kernel does what its plain-torch rule in verify.py does, on the device, and can also write
the committed tokens (the accepted draft tokens, then the target's token) into a token buffer at
an offset held in a device tensor and advance that offset:

- `greedy_accept_triton`: per-row argmax of the target's logits (first index on ties, as
  torch.argmax), the accepted prefix where draft == argmax, the target's token after it.
  Same results as `verify.greedy_accept`.
- `speculative_accept_triton`: the p/q rejection test, then the final token by inverse CDF from
  max(0, p - q) at the first rejection (p itself where that is empty), or from p's last row
  after a full accept. Same results as `verify.speculative_accept_u` given the same uniforms
  (`verify.draw_uniforms`). The accept test is bit-identical (float64 `u * q < p` on the same
  values); the inverse CDF accumulates in float64 in both, but the kernel's sums run in a
  different order than torch.cumsum, so a u within ~1e-12 (relative) of a CDF boundary may pick
  the neighbouring token — for random u, a chance of order 1e-9 per block.

Kernels launch with enable_fp_fusion=False, so no multiply-add is fused and every operation
rounds as torch's does. Inputs may be fp32, bf16 or fp16; the kernels upcast to fp32 right after
loading (Triton's CPU interpreter mis-computes bf16 arithmetic, and fp32 is what the torch rules
use). NaN logits or probabilities are not supported.

`use_triton(device)` is the dispatcher the engine uses. Triton is optional: without it (or on
CPU) the torch rules run. On CPU the kernels can still be run through Triton's interpreter
(TRITON_INTERPRET=1 before triton is imported, and `use_triton(..., interpret=True)`);
tests/test_kernels.py does that.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional
    triton = None  # type: ignore[assignment]


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)  # triton >= 3.3
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Whether the kernels below were built for Triton's CPU interpreter (decided when this module is imported).
INTERPRETED = triton is not None and _interpreting()

BLOCK_V = 1024  # vocabulary entries one program handles per step
MAX_SPLIT = 64  # programs per row for the greedy argmax


def use_triton(device: torch.device | str | torch.Tensor, interpret: bool = False) -> bool:
    """Whether the accept step should run the Triton kernels for tensors on `device`.

    Yes on CUDA when triton imports. On CPU only through Triton's interpreter, and only when
    asked for with `interpret` (the kernel tests do that).
    """
    if triton is None:
        return False
    if isinstance(device, torch.Tensor):
        device = device.device
    device = torch.device(device)
    if device.type == "cuda":
        return True
    return interpret and INTERPRETED and device.type == "cpu"


if triton is not None:

    @triton.jit
    def _row_argmax_kernel(x_ptr, stride_x, V, span, val_ptr, idx_ptr, n_split, BLOCK: tl.constexpr):
        """Program (row, split): max and first arg-max of x[row, split*span : (split+1)*span]."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        base = x_ptr + row.to(tl.int64) * stride_x
        lo = split * span
        hi = tl.minimum(lo + span, V)
        best_v = tl.full((), float("-inf"), tl.float32)
        best_i = lo
        for start in range(lo, hi, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < hi, other=float("-inf")).to(tl.float32)
            m = tl.max(x, axis=0)
            i = tl.min(tl.where(x == m, cols, hi), axis=0)  # the first index of the chunk's max
            better = m > best_v  # strictly: an equal max later on keeps the earlier index
            best_i = tl.where(better, i, best_i)
            best_v = tl.where(better, m, best_v)
        tl.store(val_ptr + row * n_split + split, best_v)
        tl.store(idx_ptr + row * n_split + split, best_i)

    @triton.jit
    def _store_and_commit(acc, tok, d, rows, acc_ptr, tok_ptr, out_ptr, len_ptr, HAS_OUT: tl.constexpr):
        """Write (accepted, token); with a buffer, append the accepted drafts + token at the
        device-side length and advance it: the host learns what was kept at its one sync."""
        tl.store(acc_ptr, acc)
        tl.store(tok_ptr, tok)
        if HAS_OUT:
            off = tl.load(len_ptr)
            tl.store(out_ptr + off + rows, tl.where(rows < acc, d, tok), mask=rows <= acc)
            tl.store(len_ptr, off + acc + 1)

    @triton.jit
    def _greedy_commit_kernel(draft_ptr, val_ptr, idx_ptr, n, n_split, acc_ptr, tok_ptr, out_ptr, len_ptr,
                              HAS_OUT: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr):
        """One program: reduce the partial arg-maxes, find the accepted prefix, commit."""
        rows = tl.arange(0, BLOCK_B)
        splits = tl.arange(0, BLOCK_S)
        big = 2147483647
        inside = (rows[:, None] <= n) & (splits[None, :] < n_split)
        offs = rows[:, None] * n_split + splits[None, :]
        v = tl.load(val_ptr + offs, mask=inside, other=float("-inf"))
        i = tl.load(idx_ptr + offs, mask=inside, other=big)
        best = tl.max(v, axis=1)
        choice = tl.min(tl.where(v == best[:, None], i, big), axis=1)  # splits are in order: first arg-max
        is_draft = rows < n
        d = tl.load(draft_ptr + rows, mask=is_draft, other=-1)
        stop = ~is_draft | (d != choice)
        acc = tl.min(tl.where(stop, rows, BLOCK_B), axis=0)  # first mismatch, n if none
        tok = tl.sum(tl.where(rows == acc, choice, 0), axis=0)
        _store_and_commit(acc, tok, d, rows, acc_ptr, tok_ptr, out_ptr, len_ptr, HAS_OUT)

    @triton.jit
    def _speculative_commit_kernel(draft_ptr, q_ptr, p_ptr, u_ptr, n, q_last, V, stride_q, stride_p,
                                   acc_ptr, tok_ptr, out_ptr, len_ptr,
                                   HAS_OUT: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr):
        """One program: the accept tests, then the final token by inverse CDF, then commit."""
        rows = tl.arange(0, BLOCK_B)
        is_draft = rows < n
        d = tl.load(draft_ptr + rows, mask=is_draft, other=0)
        p_d = tl.load(p_ptr + rows.to(tl.int64) * stride_p + d, mask=is_draft, other=0.0).to(tl.float32)
        q_d = tl.load(q_ptr + rows.to(tl.int64) * stride_q + d, mask=is_draft, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + rows, mask=is_draft, other=0.0).to(tl.float64)
        ok = u * q_d.to(tl.float64) < p_d.to(tl.float64)  # u < p/q without dividing by a zero q
        acc = tl.min(tl.where(is_draft & ~ok, rows, n), axis=0)

        # The row at `acc`: residual max(0, p - q) after a rejection, p's last row (the bonus) after none.
        # (q's row is clamped to a real one and zeroed with `where`, not masked by a scalar: the
        # interpreter mishandles `block_mask & scalar_bool`.)
        has_q = acc < n
        p_row = p_ptr + acc.to(tl.int64) * stride_p
        q_row = q_ptr + tl.minimum(acc, q_last).to(tl.int64) * stride_q
        residual_mass = tl.zeros((), tl.float64)
        p_mass = tl.zeros((), tl.float64)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            m = cols < V
            pv = tl.load(p_row + cols, mask=m, other=0.0).to(tl.float32)
            qv = tl.where(has_q, tl.load(q_row + cols, mask=m, other=0.0).to(tl.float32), 0.0)
            residual_mass += tl.sum(tl.maximum(pv - qv, 0.0).to(tl.float64), axis=0)
            p_mass += tl.sum(pv.to(tl.float64), axis=0)
        # A sum of non-negative numbers is > 0 exactly when one of them is (the torch rule's `any`).
        # Where the residual is empty (p == q) rejection has probability 0; p's row stands in.
        use_q = has_q & (residual_mass > 0)
        total = tl.where(residual_mass > 0, residual_mass, p_mass)
        threshold = tl.load(u_ptr + n).to(tl.float64) * total

        # Inverse CDF: count the cdf entries <= threshold (= the first index past it); float64 running sum.
        carry = tl.zeros((), tl.float64)
        count = tl.zeros((), tl.int32)
        last_positive = tl.full((), -1, tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            m = cols < V
            pv = tl.load(p_row + cols, mask=m, other=0.0).to(tl.float32)
            qv = tl.where(use_q, tl.load(q_row + cols, mask=m, other=0.0).to(tl.float32), 0.0)
            w = tl.maximum(pv - qv, 0.0)
            cdf = tl.cumsum(w.to(tl.float64), axis=0) + carry
            count += tl.sum((m & (cdf <= threshold)).to(tl.int32), axis=0)
            last_positive = tl.maximum(last_positive, tl.max(tl.where(m & (w > 0), cols, -1), axis=0))
            carry = tl.max(cdf, axis=0)  # the cdf never decreases: its max is its last entry
        tok = tl.minimum(count, last_positive)  # rounding past the end: the last token with weight

        _store_and_commit(acc, tok, d, rows, acc_ptr, tok_ptr, out_ptr, len_ptr, HAS_OUT)


def _check_out(out: torch.Tensor | None, length: torch.Tensor | None, device: torch.device) -> None:
    if (out is None) != (length is None):
        raise ValueError("pass both `out` and `length`, or neither")
    if out is not None and length is not None:
        if out.dim() != 1 or not out.is_contiguous() or length.numel() != 1:
            raise ValueError("`out` must be a contiguous 1-d token buffer and `length` a 1-element tensor")
        if out.device != device or length.device != device:
            raise ValueError("`out` and `length` must be on the same device as the logits")


def _block_b(rows: int) -> int:
    return max(triton.next_power_of_2(rows), 2)


def greedy_accept_triton(draft: torch.Tensor, logits: torch.Tensor, out: torch.Tensor | None = None,
                         length: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify.greedy_accept` in two kernels: draft [B-1] int64, logits [B, V] → (accepted, token), 0-d int64.

    With `out` (a 1-d token buffer) and `length` (1 element, int64), also writes the committed
    tokens to out[length : length + accepted + 1] and adds accepted + 1 to length, on the
    device. `out` must have room for B tokens past `length` (not checked: that would need a sync).
    """
    B, V = logits.shape
    n = B - 1
    if draft.shape != (n,):
        raise ValueError(f"draft has shape {tuple(draft.shape)}, expected ({n},) for {B} rows of logits")
    _check_out(out, length, logits.device)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    draft = draft.contiguous()
    dev = logits.device
    n_split = min(triton.cdiv(V, BLOCK_V), MAX_SPLIT)
    span = triton.cdiv(triton.cdiv(V, n_split), BLOCK_V) * BLOCK_V
    n_split = triton.cdiv(V, span)
    vals = torch.empty(B, n_split, device=dev, dtype=torch.float32)
    idxs = torch.empty(B, n_split, device=dev, dtype=torch.int32)
    _row_argmax_kernel[(B, n_split)](logits, logits.stride(0), V, span, vals, idxs, n_split, BLOCK=BLOCK_V,
                                     enable_fp_fusion=False)
    acc = torch.empty((), device=dev, dtype=torch.int64)
    tok = torch.empty((), device=dev, dtype=torch.int64)
    has_out = out is not None
    _greedy_commit_kernel[(1,)](
        draft, vals, idxs, n, n_split, acc, tok, out if has_out else acc, length if has_out else acc,
        HAS_OUT=has_out, BLOCK_B=_block_b(B), BLOCK_S=max(triton.next_power_of_2(n_split), 2),
        enable_fp_fusion=False,
    )
    return acc, tok


def speculative_accept_triton(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, u: torch.Tensor,
                              out: torch.Tensor | None = None,
                              length: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify.speculative_accept_u` in one kernel: draft [B-1], q [B-1, V], p [B, V], u [B] float64.

    Returns (accepted, token), 0-d int64. `out` and `length` as in `greedy_accept_triton`.
    """
    B, V = p.shape
    n = B - 1
    if draft.shape != (n,) or q.shape != (n, V) or u.shape != (B,):
        raise ValueError(f"shapes draft {tuple(draft.shape)}, q {tuple(q.shape)}, p {tuple(p.shape)}, "
                         f"u {tuple(u.shape)} do not fit a block of {B}")
    _check_out(out, length, p.device)
    if p.stride(-1) != 1:
        p = p.contiguous()
    if n == 0:
        q = p  # never read: the only row is the bonus row
    elif q.stride(-1) != 1:
        q = q.contiguous()
    draft = draft.contiguous()
    u = u.to(torch.float64).contiguous()
    dev = p.device
    acc = torch.empty((), device=dev, dtype=torch.int64)
    tok = torch.empty((), device=dev, dtype=torch.int64)
    has_out = out is not None
    _speculative_commit_kernel[(1,)](
        draft, q, p, u, n, max(n - 1, 0), V, q.stride(0), p.stride(0), acc, tok,
        out if has_out else acc, length if has_out else acc,
        HAS_OUT=has_out, BLOCK_B=_block_b(B), BLOCK=BLOCK_V, enable_fp_fusion=False,
    )
    return acc, tok

