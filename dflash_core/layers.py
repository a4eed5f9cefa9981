"""RMSNorm and rotary position embeddings, the maths the drafter and the fast forward share."""

from __future__ import annotations

import math
from typing import Any

import torch

from . import cpu_kernels


def _compiled(x: torch.Tensor, *others: torch.Tensor, multiple: int) -> Any:
    """The compiled row-wise kernels (cpu_kernels.py) where they take this call: bf16 on the CPU,
    nothing to differentiate, the last dim a multiple of `multiple`; else None."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[-1] % multiple:
        return None
    if any(t.dtype != torch.bfloat16 for t in others):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, *others)):
        return None
    return cpu_kernels.kernel()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3/Llama RMSNorm, operation for operation: statistics in fp32, the scale
    applied in the input's dtype (so results match theirs bit for bit). In bf16 on a CPU, one
    compiled call computes the same steps (torch's six calls cost ~20 µs, it ~1 µs)."""
    compiled = _compiled(x, weight, multiple=16)
    if compiled is not None:
        return compiled.rms_norm(x, weight, eps)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class RMSNorm(torch.nn.Module):
    """`rms_norm` with a learned scale, as a module (checkpoint key `weight`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


ROPE_TYPES = ("default", "linear", "yarn")


def rope_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None = None, max_position_embeddings: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (fp32) and the factor cos/sin are multiplied by, for the
    RoPE types in `ROPE_TYPES`, operation for operation as transformers' `ROPE_INIT_FUNCTIONS`
    computes them (so a drafter trained with transformers' RoPE sees the same positions here)."""
    kind = (scaling or {}).get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ValueError(f"RoPE type {kind!r} is not one of {', '.join(ROPE_TYPES)}")
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    assert scaling is not None
    factor = scaling.get("factor")
    if kind == "linear":
        return 1.0 / pos_freqs / factor, 1.0
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    # High frequencies keep their trained values (extrapolation), low ones are stretched by
    # `factor` (interpolation), with a linear blend between the two correction dimensions.
    keep = 1 - ramp
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
    scaling: dict[str, Any] | None = None, max_position_embeddings: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [len(positions), head_dim] for `apply_rope` (`rope_frequencies` for the scaling)."""
    inv_freq, attention_factor = rope_frequencies(head_dim, theta, scaling, max_position_embeddings)
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:  # in fp32 before the cast, as transformers scales them
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., seq, head_dim] by cos/sin [seq, head_dim] (or broadcastable), in the
    rotate-half layout transformers uses. In bf16 on a CPU, one compiled call with the same
    roundings (the same bits)."""
    if x.dim() == 3 and x.stride(-1) == 1 and cos.dim() == 2 and cos.shape == (x.shape[1], x.shape[2]):
        compiled = _compiled(x, cos, sin, multiple=32)
        if compiled is not None:
            return compiled.rope(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def full_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q [heads, n, head_dim] over keys/values [kv_heads, S, head_dim] that every query sees (a
    drafter's full, bidirectional layer); [heads, n, head_dim]. In bf16 on a CPU, the compiled
    attention (~15 µs for a 16-row block against SDPA's ~80)."""
    compiled = _compiled(q, keys, values, multiple=16)
    if compiled is not None and cpu_kernels.attention_kernel(q.shape[-1]) is not None:
        n = q.shape[1]
        sees_all = torch.full((n,), keys.shape[1], dtype=torch.long)
        return compiled.attention(q, keys, values, sees_all, torch.empty((n, 0), dtype=torch.long),
                                  torch.zeros(n, dtype=torch.long), q.shape[-1] ** -0.5)
    return torch.nn.functional.scaled_dot_product_attention(
        q[None], keys[None], values[None], enable_gqa=keys.shape[0] != q.shape[0])[0]


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [rows, 2 * inner] (the two side by side, as one GEMM gives
    them). In bf16 on a CPU, one compiled call with torch's two roundings (~1 µs against ~12)."""
    compiled = _compiled(gate_up, multiple=32) if gate_up.dim() == 2 else None
    if compiled is not None:
        return compiled.swiglu(gate_up)
    gate, up = gate_up.chunk(2, -1)
    return torch.nn.functional.silu(gate) * up
