"""The batch-invariant bf16 maths as compiled calls: attention (`cpu_attention.cpp`), RMSNorm,
RoPE and SwiGLU's SiLU-times-up (`cpu_rowwise.cpp`, layers.py), on CPUs with AVX512-BF16 (AMX
Xeons have it too) the linear layers (`cpu_linear.cpp`) and, built from all of these, a whole
decoder layer and a drafter's layer as one call each (`cpu_layer.cpp`: a layer as ~20
Python-level calls cost a one-token pass ~2 ms of its ~9).

Each computes every result whole, in one fixed order, so a row's bits cannot depend on the pass:
what `FastForward.rows_agree` checks on every load.

- Attention: at a handful of rows, attention written as torch calls is nearly all call overhead.
  SmolLM2's tree pass spent ~0.25-0.45 ms per layer in ~40 small calls (three bf16 GEMMs through
  oneDNN at ~40 µs each, for a few microseconds of arithmetic), a plain step ~0.2 ms. The kernel
  reduces each (query head, row) over exactly the keys the row sees, in position order; a KV group's
  heads and a few rows share a tile so each key is read once (~30 µs for 7 rows of 9 heads).
- Linear layers: oneDNN's bf16 GEMM is row-invariant only for 2..32 rows, so a plain step
  multiplied its one row as a pair, and it reads the weights slower than the memory allows. All of
  SmolLM2's linears, 2 threads: on a Zen 4, oneDNN 16.5 ms for a plain step's pair, 15.9 for 8
  rows, the kernel (vdpbf16ps) 7-9 ms for 1 to 8 rows; on an AMX Xeon, oneDNN's tiles 13-14 ms for
  1 to 16 rows, the kernel's tile multiplies 8.0-8.2 ms (vdpbf16ps there: 7.9 at 1 row, 12.3 at 8,
  22 at 16, out of arithmetic). `linear_units()` says which instruction multiplies here.
- Float32 linear layers (`cpu_linear_f32.cpp`, any x86 CPU with AVX2): where the target runs in
  float32 (CPUs without bf16 units), oneDNN's float32 GEMM read the weights at about half the
  memory's speed. The kernel sums each output over its inputs in order by FMAs, from float32
  weights or, where every weight is a bf16 value (`packing.bf16_exact`), from bf16 weights widened
  exactly (half the bytes). SmolLM2's linears, 2 threads, a 2-core AMD EPYC Zen 3: oneDNN 58 / 78 ms
  at 1 / 8 rows, the kernel 38 / 56-64 (float32 weights) and 17 / 34-40 (bf16 weights).

Built once per machine by torch's C++ extension loader (g++ and ninja; ~40 s on 2 cores, cached
in torch's extensions folder under a name that hashes the sources, this CPU's vector instructions
and the torch version). scripts/setup.sh builds it ahead (`describe()`). Where it cannot be built
(no compiler, a CPU without AVX-512), `kernel()` is None (`f32_kernel()`: without AVX2),
`unavailable_reason()` says why, and batch_invariant.py's torch calls (oneDNN for float32) run
instead; `DFLASH_CPU_KERNEL=0` picks that path on purpose.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch

SOURCES = [Path(__file__).with_name(name)  # one translation unit, in this order: cpu_layer.cpp calls the others
           for name in ("cpu_attention.cpp", "cpu_linear.cpp", "cpu_rowwise.cpp", "cpu_layer.cpp")]
HEADER = Path(__file__).with_name("cpu_bf16.h")  # bf16 helpers the sources share
FUNCTIONS = ["attention", "pack_linear", "linear", "linear_units", "rms_norm", "rope", "swiglu", "decoder_layer",
             "draft_layer", "argmax_rows"]
HEAD_DIMS = (16, 32, 64, 128, 256)  # the attention's instantiations (other sizes take the torch calls)
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]
# Float32 linear layers for CPUs without bf16 units (AVX2 and FMA: laptops, AMD Zen 1-3), built apart
# from the AVX-512 sources above.
F32_SOURCE = Path(__file__).with_name("cpu_linear_f32.cpp")
F32_FUNCTIONS = ["pack_linear_f32", "linear_f32"]
log = logging.getLogger(__name__)


def _ninja_on_path() -> None:
    """torch's loader runs `ninja` from PATH; the pip package's copy sits in the venv's bin,
    which is not on PATH when the venv's python is run without activating it."""
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR


def _build(name: str, sources: list[str], functions: list[str], what: str) -> tuple[Any, str | None]:
    """Compile `sources` as one extension named after their hash, this CPU and torch (cached in
    torch's extensions folder); (module, None), or (None, why not)."""
    capability = torch.backends.cpu.get_cpu_capability()
    tag = hashlib.sha1(f"{sources}{HEADER.read_text()}{FLAGS}{capability}{name}{torch.__version__}".encode())
    name = f"{name}_{tag.hexdigest()[:12]}"
    try:
        from torch.utils import cpp_extension

        _ninja_on_path()
        if not Path(cpp_extension._get_build_directory(name, verbose=False), f"{name}.so").exists():
            print(f"[cpu kernels] building {what} for this machine (once, ~40 s) ...", file=sys.stderr, flush=True)
        module = cpp_extension.load_inline(name=name, cpp_sources=sources, functions=functions,
                                           extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                                           extra_include_paths=[str(HEADER.parent)])
    except Exception as err:  # no compiler, no ninja, a build error: the torch-call path runs
        lines = str(err).strip().splitlines()
        reason = f"{type(err).__name__}: {lines[-1] if lines else ''}"
        log.warning("%s could not be built (%s); torch calls run instead", what, reason)
        return None, reason
    return module, None


@functools.cache
def _load() -> tuple[Any, str | None]:
    if os.environ.get("DFLASH_CPU_KERNEL", "1") == "0":
        return None, "turned off (DFLASH_CPU_KERNEL=0)"
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return None, f"this CPU has no AVX-512 ({torch.backends.cpu.get_cpu_capability()})"
    from .batch_invariant import _cpu_supports

    amx = _cpu_supports("_is_amx_tile_supported")  # -march=native builds the tile path only where the CPU has tiles
    return _build(f"dflash_cpu_kernels{'_amx' if amx else ''}", [path.read_text() for path in SOURCES], FUNCTIONS,
                  "the compiled CPU kernels")


@functools.cache
def _load_f32() -> tuple[Any, str | None]:
    if os.environ.get("DFLASH_CPU_KERNEL", "1") == "0":
        return None, "turned off (DFLASH_CPU_KERNEL=0)"
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith(("AVX2", "AVX512")):
        return None, f"this CPU has no AVX2 ({capability})"
    return _build("dflash_cpu_f32", [F32_SOURCE.read_text()], F32_FUNCTIONS, "the compiled float32 linear layers")


def f32_kernel() -> Any:
    """The float32 linear layers' module (`F32_FUNCTIONS`, any x86 CPU with AVX2), built on first
    call; None where it cannot be."""
    return _load_f32()[0]


def kernel() -> Any:
    """The compiled module (its `FUNCTIONS`), built on first call; None where it cannot be."""
    return _load()[0]


def unavailable_reason() -> str | None:
    """Why `kernel()` is None (None when it is built)."""
    return _load()[1]


def linear_kernel() -> Any:
    """The module when the compiled linear layers apply here (AVX512-BF16, with or without AMX), else None."""
    from .batch_invariant import _cpu_supports

    if not _cpu_supports("_is_avx512_bf16_supported"):
        return None
    return kernel()


def attention_kernel(head_dim: int) -> Any:
    """The module when the compiled attention takes this head size (`HEAD_DIMS`), else None."""
    return kernel() if head_dim in HEAD_DIMS else None


def linear_fits(weight: torch.Tensor) -> bool:
    """`pack_linear` takes this [out, in] weight (out a multiple of 16, in even)."""
    return weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0


def describe() -> str:
    """Builds the kernels wherever they run (any AVX-512 CPU: greedy choices use `argmax_rows`
    whatever the target's dtype; the float32 linear layers where the target runs in float32), and
    says how that went (for setup)."""
    from .batch_invariant import bf16_gemm_available

    if not bf16_gemm_available():  # the target runs in float32 here, its linear layers on the float32 kernel
        f32 = "float32 linear layers" if f32_kernel() is not None else f"no float32 linear layers ({_load_f32()[1]})"
        if kernel() is None:
            return f"[cpu kernels] ready ({f32}); the AVX-512 kernels not built: {unavailable_reason()}"
        return f"[cpu kernels] ready (argmax, {f32}; without bf16 units the target runs in float32)"
    if kernel() is None:
        return f"[cpu kernels] not built: {unavailable_reason()}"
    linears = linear_kernel()
    return f"[cpu kernels] ready (attention{'' if linears is None else f', linear layers on {linears.linear_units()}'})"
