"""The compiled float32 linear layers (cpu_linear_f32.cpp) for CPUs with AVX2: a row's bits never
depend on the pass, the sums are right for float32 and bf16 weights, weights that are all bf16
values are kept in bf16, and the default target on a CPU without bf16 units takes them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_core import cpu_kernels, packing, targets
from dflash_core.packing import Linear, bf16_exact, pack_weight

kernel = cpu_kernels.f32_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason=f"no float32 kernel here: {cpu_kernels._load_f32()[1]}")

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (48, 38)]  # SmolLM2's, and a small odd one


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rows_keep_their_bits_in_any_pass_and_sums_are_right(shape: tuple[int, int], weights: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(shape[0] + shape[1])
    w = torch.randn(shape, generator=gen).to(weights)
    b = torch.randn(shape[0], generator=gen) if shape[0] % 3 == 0 else None
    packed = kernel.pack_linear_f32(w)
    assert packed.dtype == weights
    x = torch.randn(40, shape[1], generator=gen)
    alone = torch.cat([kernel.linear_f32(x[i : i + 1], packed, b) for i in range(len(x))])
    torch.testing.assert_close(alone, reference(x, w.float(), b), rtol=1e-5, atol=1e-4)
    # 2-3 rows take two weight blocks a tile, 4+ one; past 6 rows the tiles go panel by panel.
    for m in (2, 3, 4, 5, 6, 7, 8, 13, 16, 33, 40):
        assert torch.equal(kernel.linear_f32(x[:m], packed, b), alone[:m]), m
    assert kernel.linear_f32(x[:0], packed, b).shape == (0, shape[0])


def test_bad_shapes_and_dtypes_are_refused_with_a_reason() -> None:
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel.pack_linear_f32(torch.randn(40, 64))
    with pytest.raises(RuntimeError, match="float32 or bf16"):
        kernel.pack_linear_f32(torch.randn(32, 64).half())
    packed = kernel.pack_linear_f32(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="64 inputs"):
        kernel.linear_f32(torch.randn(2, 62), packed, None)
    with pytest.raises(RuntimeError, match="float32 input"):
        kernel.linear_f32(torch.randn(2, 64).bfloat16(), packed, None)
    with pytest.raises(RuntimeError, match="bias of 32"):
        kernel.linear_f32(torch.randn(2, 64), packed, torch.zeros(31))


def test_weights_that_are_bf16_values_are_kept_in_bf16() -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 96, generator=gen)
    rounded = w.bfloat16().float()
    assert bf16_exact(rounded) and not bf16_exact(w)
    assert pack_weight(w).dtype == torch.float32
    assert pack_weight(rounded).dtype == torch.bfloat16  # exact: half the bytes, the same products
    x = torch.randn(5, 96, generator=gen)
    for weight in (w, rounded):
        lin = Linear(weight, None, pack_weight(weight))
        torch.testing.assert_close(lin(x), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    assert pack_weight(torch.randn(40, 96)) is not None  # not the kernel's shape: oneDNN or MKL, where they work
    assert packing.f32_layout(torch.randn(40, 96)) is None


def test_default_target_without_bf16_units_computes_in_float32_over_bf16_weights(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU without bf16 units: `auto` loads the bf16 model and computes in float32 (its linears
    from bf16 weights); an explicit float32 keeps float32 weights."""
    monkeypatch.setattr(targets, "bf16_gemm_available", lambda: False)
    monkeypatch.setattr(targets, "default_dtype", lambda device: torch.float32)
    auto = targets.load_target("embedded", device="cpu")
    assert auto.dtype == torch.float32 and not auto.invariant
    assert all(p.dtype == torch.float32 and bf16_exact(p) for p in auto.model.parameters())
    assert auto.fast_forward is not None and auto.fast_forward.bf16_weights
    assert "bf16 weights" in auto.forward_note
    full = targets.load_target("embedded", device="cpu", dtype="fp32")
    assert not all(bf16_exact(p) for p in full.model.parameters())
    assert full.fast_forward is not None and not full.fast_forward.bf16_weights
