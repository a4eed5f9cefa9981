"""Shared fixtures: the real embedded target (loaded once per session) and drafters for it."""

from __future__ import annotations

import os

import pytest
import torch

from dflash_core.drafter import DFlashDrafter, config_for_target, init_weights
from dflash_core.engine import Engine
from dflash_core.events import Finished
from dflash_core.targets import Target, load_target

# On a machine shared with other busy processes, DFLASH_TEST_THREADS=1 avoids oversubscription.
if os.environ.get("DFLASH_TEST_THREADS"):
    torch.set_num_threads(int(os.environ["DFLASH_TEST_THREADS"]))


@pytest.fixture(scope="session")
def target() -> Target:
    return load_target("embedded", device="cpu")


@pytest.fixture(scope="session")
def random_drafter(target: Target) -> DFlashDrafter:
    """A randomly initialised 2-layer drafter: it almost never guesses right."""
    cfg = config_for_target(target.config, num_layers=2, block_size=16, mask_token_id=0)
    return init_weights(DFlashDrafter(cfg), seed=1).eval()


@pytest.fixture(scope="session")
def engine(target: Target, random_drafter: DFlashDrafter) -> Engine:
    return Engine(target, random_drafter)


def finish(events) -> Finished:
    """Drain a generate() iterator and return its Finished event."""
    last = None
    for ev in events:
        last = ev
    assert isinstance(last, Finished)
    return last
