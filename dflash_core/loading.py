"""One call from names to a ready Engine: the target, then the drafter that fits it."""

from __future__ import annotations

from pathlib import Path

import torch

from .drafter import load_drafter
from .engine import Engine
from .errors import DFlashError
from .targets import EMBEDDED, load_target

ASSETS = Path(__file__).resolve().parent.parent / "assets"
SHIPPED_DRAFTER = ASSETS / "drafter"


def default_drafter_for(target_spec: str | None) -> str | None:
    """The shipped drafter serves the embedded target; other targets need `--draft`."""
    if (target_spec in (None, EMBEDDED)) and (SHIPPED_DRAFTER / "config.json").is_file():
        return str(SHIPPED_DRAFTER)
    return None


def load(target: str | None = None, draft: str | None = None, device: str | None = None,
         dtype: str | torch.dtype | None = None) -> Engine:
    """`draft="none"` loads no drafter (plain decoding only); None picks the shipped default."""
    tgt = load_target(target, device=device, dtype=dtype)
    if draft == "none":
        return Engine(tgt, None)
    spec = draft or default_drafter_for(target)
    if spec is None:
        raise DFlashError(f"no drafter for target {tgt.name!r}: pass --draft ID|PATH (or --draft none)")
    drafter = load_drafter(spec, device=tgt.device, dtype=tgt.dtype)
    return Engine(tgt, drafter)
