"""Linear-layer weights laid out once for the CPU's GEMM library, so a small verify pass is cheap.

A verify pass of m tokens should cost little more than one token, but MKL packs each weight matrix
again inside every small-M GEMM (measured on SmolLM2-135M, 2 CPU threads: 4 tokens cost 1.6x a
one-token pass, 16 tokens 2.3x). Packing the weights once at load (MKL's packed GEMM, which
torch.compile's CPU freezing also uses) brings that to ~1.2x and ~1.7x. On an AVX2-only CPU (an
AMD EPYC) MKL's packed GEMM stayed expensive (16 tokens 3.1x one token) while oneDNN's, over a
weight reordered once, cost 1.9x; so fp32 weights take oneDNN's layout wherever it checks out
(`onednn_fp32_works`), MKL's packing otherwise. Both are checked against `F.linear` once per
process, since MKL documents the packed format for the batch size it was packed for and we use
it for every one. Where the compiled float32 kernel builds (any CPU with AVX2, cpu_kernels.py),
fp32 weights take its layout before either: every row's bits then hold by construction, and a
weight whose values are all bf16 values (`bf16_exact`: a bf16 checkpoint, or the embedded target
on a CPU without bf16 units, targets.py) is kept in bf16, half the bytes to stream.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from . import batch_invariant, cpu_kernels

PACK_BATCH_HINT = 16  # the largest verify pass; MKL's packed layout is chosen for it
# Below this many rows MKL's own small-M kernels are as fast or faster (measured: 1-3 rows equal
# or ~2 ms per pass better unpacked; 4 rows 58 ms packed against 76 ms unpacked).
PACKED_MIN_ROWS = 4


def _probe_weights(out: int, inp: int) -> tuple[torch.Generator, torch.Tensor, torch.Tensor]:
    """A seeded random weight and bias for the GEMM libraries' load-time probes."""
    gen = torch.Generator().manual_seed(0)
    return gen, torch.randn(out, inp, generator=gen), torch.randn(out, generator=gen)


@functools.cache
def mkl_packing_works() -> bool:
    """MKL's packed GEMM, packed once for PACK_BATCH_HINT rows, agrees with F.linear for any
    number of rows on this machine (checked once per process on a small random matrix)."""
    if not torch.backends.mkl.is_available():
        return False
    try:
        gen, w, b = _probe_weights(96, 64)
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_BATCH_HINT)
        return packed_agrees(w, b, packed, (1, 2, 3, 4, 7, 16, 40), gen)
    except (RuntimeError, AttributeError):
        return False


@functools.cache
def onednn_fp32_works() -> bool:
    """oneDNN's fp32 GEMM through a weight reordered once gives every row the same bits for
    1..32 rows and agrees with F.linear (probed once per process on random matrices of a
    transformer MLP's two shapes). Where it does, fp32 weights are laid out for oneDNN rather than
    packed for MKL: measured on an AVX2 AMD EPYC (2 threads), a 16-row LM-head GEMM took 15 ms
    through oneDNN against 40 ms MKL-packed, and the layers' GEMMs 20-40 % less."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        # Both directions of an MLP: whether rows keep their bits depends on the inner size (on
        # an AMX Xeon, 576 inputs did and 1536 did not).
        for out, inp in ((1536, 576), (576, 1536)):
            gen, w, b = _probe_weights(out, inp)
            packed = batch_invariant.onednn_weight(w)
            if not packed_agrees(w, b, packed, (1, 2, 3, 4, 7, 16, 17, 32), gen):
                return False
            x = torch.randn(32, inp, generator=gen)
            alone = torch.cat([batch_invariant.onednn_linear(x[i : i + 1], packed, b) for i in range(32)])
            rows = (2, 3, 4, 7, 16, 17, 32)
            if not all(torch.equal(batch_invariant.onednn_linear(x[:m], packed, b), alone[:m]) for m in rows):
                return False
        return True
    except (AttributeError, RuntimeError):
        return False


def packed_agrees(weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor,
                  rows: tuple[int, ...], gen: torch.Generator) -> bool:
    """The packed GEMM gives F.linear's result (to fp32 rounding) for random inputs of these
    row counts."""
    for m in rows:
        x = torch.randn(m, weight.shape[1], generator=gen)
        got = _matmul(x, weight, bias, packed)
        if not torch.allclose(got, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4):
            return False
    return True


def available_memory() -> int:
    """Bytes this process can still take: the kernel's MemAvailable (free + reclaimable cache),
    capped by a cgroup v2 memory limit when there is one (containers, Spaces); 0 if unknown.
    Packing keeps a second copy of the weights, so it is skipped when memory is short."""
    avail = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(avail, 0)


def onednn_layout(packed: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `packed` is oneDNN's layout of `weight` (it keeps the weight's shape; MKL's packed
    buffer is a flat [bytes, 1] tensor)."""
    return packed.shape == weight.shape


def bf16_exact(weight: torch.Tensor) -> bool:
    """Every value of this float32 weight is a bf16 value (so bf16 holds it exactly)."""
    return torch.equal(weight.to(torch.bfloat16).float(), weight)


def f32_layout(weight: torch.Tensor) -> torch.Tensor | None:
    """A float32 [out, in] weight laid out for the compiled float32 kernel (in bf16 where that is
    exact), or None where the kernel does not build or take this shape."""
    kernel = cpu_kernels.f32_kernel() if cpu_kernels.linear_fits(weight) else None
    if kernel is None:
        return None
    w = weight.detach().contiguous()
    return kernel.pack_linear_f32(w.to(torch.bfloat16) if bf16_exact(w) else w)


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            packed: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] times the weight, through the packed copy when there is one (MKL's: with
    enough rows)."""
    if packed is not None and packed.dim() == 4:  # laid out for a compiled kernel (cpu_kernels.py)
        if x.dtype == torch.float32:
            return cpu_kernels.f32_kernel().linear_f32(x, packed, bias)
        return cpu_kernels.kernel().linear(x, packed, bias)
    if packed is not None and onednn_layout(packed, weight):
        return batch_invariant.onednn_linear(x, packed, bias)
    if packed is not None and x.shape[0] >= PACKED_MIN_ROWS:
        # The last argument tells MKL that `packed` is laid out for this many rows.
        return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])
    return F.linear(x, weight, bias)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A [out, in] weight laid out once for its GEMM library: for bf16 the compiled kernel's layout
    where it applies (cpu_kernels.py: AVX512-BF16, with AMX tiles where the CPU has them), else
    oneDNN's reordered copy on CPUs with bf16 units; for fp32 the compiled float32 kernel's layout
    where it builds (`f32_layout`), else oneDNN's where its fp32 GEMM passes its check
    (`onednn_fp32_works`), else MKL's packed copy; None where none applies (not CPU, or the
    self-checks failed)."""
    if weight.device.type != "cpu":
        return None
    if weight.dtype == torch.bfloat16:
        return batch_invariant.bf16_layout(weight)[0] if batch_invariant.bf16_gemm_available() else None
    if weight.dtype == torch.float32 and (compiled := f32_layout(weight)) is not None:
        return compiled
    if weight.dtype == torch.float32 and onednn_fp32_works():
        return batch_invariant.onednn_weight(weight)
    if weight.dtype != torch.float32 or not mkl_packing_works():
        return None
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)


@dataclass
class Linear:
    """A linear layer's detached weight and bias, multiplied through `packed` when there is one."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: torch.Tensor | None = None  # `weight` laid out once for its GEMM library (`pack_weight`)

    @classmethod
    def of(cls, module: Any, pack: bool) -> Linear:
        """An nn.Linear's weights, laid out once (`pack_weight`) when `pack`."""
        w = module.weight.detach()
        b = None if getattr(module, "bias", None) is None else module.bias.detach()
        return cls(w, b, pack_weight(w) if pack else None)

    @classmethod
    def joined(cls, modules: list[torch.nn.Module]) -> Linear:
        """Linear layers that read the same input as one GEMM (`batch_invariant.joined_weight`),
        laid out once (`pack_weight`)."""
        weight, bias = batch_invariant.joined_weight(modules)
        return cls(weight, bias, pack_weight(weight))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _matmul(x, self.weight, self.bias, self.packed)

    whole = __call__  # the same GEMM for any number of rows (see InvariantLinear.whole)


def weight_key(w: torch.Tensor) -> tuple[Any, ...]:
    """What changes when a weight does: a new tensor (also after a move or a cast), or an
    in-place update (inference tensors keep no version counter). Copies laid out from it are
    rebuilt when it changes."""
    return w.data_ptr(), w.dtype, w.device, -1 if w.is_inference() else w._version


class PackingLinear(torch.nn.Linear):
    """An nn.Linear (same parameters, same checkpoints) that, at CPU inference with 4 or more
    rows, multiplies through weights laid out once (`pack_weight`: MKL-packed fp32, ~25 % cheaper
    for the drafter's 16-row blocks; bf16 in the compiled kernel's layout on CPUs with bf16
    units). The packed copy is made on first use and again whenever the weight changes (training
    evaluates the live drafter between optimizer steps); with gradients on it is a plain nn.Linear."""

    _packed: tuple[tuple[Any, ...], torch.Tensor | None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The packed copy is an opaque MKL tensor: it cannot be copied or pickled, and is
        # rebuilt on first use anyway (deepcopy, torch.save of the module).
        state = dict(self.__dict__)
        state.pop("_packed", None)
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        if torch.is_grad_enabled() or rows < PACKED_MIN_ROWS or torch.is_autocast_enabled(x.device.type):
            return super().forward(x)
        key = weight_key(self.weight)
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, pack_weight(self.weight))
        out = _matmul(x.reshape(rows, x.shape[-1]), self.weight, self.bias, self._packed[1])
        return out.view(*x.shape[:-1], out.shape[-1])
