"""Drafters the DFlash 2 tests share."""

from __future__ import annotations

import torch

from dflash_core.dflash2 import dflash2_config, upgrade
from dflash_core.drafter import DFlashDrafter

# How far each new DFlash 2 part moves from the upgrade's neutral start (parts not named stay).
SPREAD = {"hidden_projection": 0.3, "predecessor": 1.0, "base_kernel": 0.1, "kernel_projection": 0.02}


def perturbed_upgrade(v1: DFlashDrafter, seed: int = 0) -> DFlashDrafter:
    """A trained DFlash 1 drafter made DFlash 2, its new parts randomised enough to change its
    drafts (a trained drafter's acceptance with the selector and convolutions at work)."""
    v2 = upgrade(v1, DFlashDrafter(dflash2_config(v1.config)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in v2.named_parameters():
            for part, std in SPREAD.items():
                if part in name:
                    p.add_(torch.randn(p.shape, generator=g) * std)
    return v2.eval()
