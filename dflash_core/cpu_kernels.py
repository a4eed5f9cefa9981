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

Built once per machine by torch's C++ extension loader (g++ and ninja; ~40 s on 2 cores, cached
in torch's extensions folder under a name that hashes the sources, this CPU's vector instructions
and the torch version). scripts/setup.sh builds it ahead (`describe()`). Where it cannot be built
(no compiler, a CPU without AVX-512), `kernel()` is None, `unavailable_reason()` says why, and
batch_invariant.py's torch calls run instead; `DFLASH_CPU_KERNEL=0` picks that path on purpose.
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


@functools.cache
def _load() -> tuple[Any, str | None]:
    if os.environ.get("DFLASH_CPU_KERNEL", "1") == "0":
        return None, "turned off (DFLASH_CPU_KERNEL=0)"
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return None, f"this CPU has no AVX-512 ({torch.backends.cpu.get_cpu_capability()})"
    sources = [path.read_text() for path in SOURCES]
    capability = torch.backends.cpu.get_cpu_capability()
    from .batch_invariant import _cpu_supports

    amx = _cpu_supports("_is_amx_tile_supported")  # -march=native builds the tile path only where the CPU has tiles
    tag = hashlib.sha1(f"{sources}{HEADER.read_text()}{FLAGS}{capability}{amx}{torch.__version__}".encode())
    name = f"dflash_cpu_kernels_{tag.hexdigest()[:12]}"
    try:
        from torch.utils import cpp_extension

        _ninja_on_path()
        if not Path(cpp_extension._get_build_directory(name, verbose=False), f"{name}.so").exists():
            print("[cpu kernels] building the compiled CPU kernels for this machine (once, ~40 s) ...",
                  file=sys.stderr, flush=True)
        module = cpp_extension.load_inline(name=name, cpp_sources=sources, functions=FUNCTIONS,
                                           extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                                           extra_include_paths=[str(HEADER.parent)])
    except Exception as err:  # no compiler, no ninja, a build error: the torch-call path runs
        lines = str(err).strip().splitlines()
        reason = f"{type(err).__name__}: {lines[-1] if lines else ''}"
        log.warning("the compiled CPU kernels could not be built (%s); torch calls run instead", reason)
        return None, reason
    return module, None


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
    whatever the target's dtype), and says how that went (for setup)."""
    from .batch_invariant import bf16_gemm_available

    if kernel() is None:
        return f"[cpu kernels] not built: {unavailable_reason()}"
    if not bf16_gemm_available():
        return "[cpu kernels] ready (argmax; without bf16 units the target runs in float32)"
    linears = linear_kernel()
    return f"[cpu kernels] ready (attention{'' if linears is None else f', linear layers on {linears.linear_units()}'})"
