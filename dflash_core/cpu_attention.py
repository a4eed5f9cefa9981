"""The batch-invariant attention as one compiled call per layer (`cpu_attention.cpp`).

At a handful of rows, attention written as torch calls is nearly all call overhead: SmolLM2's
tree pass spent ~0.25-0.45 ms per layer in ~40 small calls (three bf16 GEMMs through oneDNN at
~40 µs each, for a few microseconds of arithmetic), a plain step ~0.2 ms. The kernel computes
each (query head, row) whole in ~1-2 µs, over exactly the keys the row sees, in position order,
so a row's bits cannot depend on the pass: what `FastForward.rows_agree` checks on every load.

It is built once per machine by torch's C++ extension loader (g++ and ninja; ~30 s on 2 cores,
cached in torch's extensions folder under a name that hashes the source, this CPU's vector
instructions and the torch version). scripts/setup.sh builds it ahead
(`describe()`). Where it cannot be built (no compiler, a CPU without AVX-512),
`kernel()` is None, `unavailable_reason()` says why, and batch_invariant.py's torch-call
attention runs instead; `DFLASH_CPU_KERNEL=0` picks that path on purpose.
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

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
HEAD_DIMS = (16, 32, 64, 128, 256)  # the kernel's instantiations (other sizes take the torch calls)
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
    source = SOURCE.read_text()
    tag = hashlib.sha1(f"{source}{FLAGS}{torch.backends.cpu.get_cpu_capability()}{torch.__version__}".encode())
    name = f"dflash_cpu_attention_{tag.hexdigest()[:12]}"
    try:
        from torch.utils import cpp_extension

        _ninja_on_path()
        if not Path(cpp_extension._get_build_directory(name, verbose=False), f"{name}.so").exists():
            print("[cpu attention] building the compiled attention for this machine (once, ~30 s) ...",
                  file=sys.stderr, flush=True)
        module = cpp_extension.load_inline(name=name, cpp_sources=[source], extra_cflags=FLAGS,
                                           extra_ldflags=["-fopenmp"])
    except Exception as err:  # no compiler, no ninja, a build error: the torch-call path runs
        lines = str(err).strip().splitlines()
        reason = f"{type(err).__name__}: {lines[-1] if lines else ''}"
        log.warning("the compiled CPU attention could not be built (%s); attention runs as torch calls", reason)
        return None, reason
    return module, None


def kernel() -> Any:
    """The compiled module (its `attention`), built on first call; None where it cannot be."""
    return _load()[0]


def unavailable_reason() -> str | None:
    """Why `kernel()` is None (None when it is built)."""
    return _load()[1]


def describe() -> str:
    """Builds the kernel where the target would use it, and says how that went (for setup)."""
    from .batch_invariant import bf16_gemm_available

    if not bf16_gemm_available():
        return "[cpu attention] not needed here: without bf16 units the target runs in float32"
    return f"[cpu attention] {'ready' if kernel() is not None else 'not built: ' + str(unavailable_reason())}"
