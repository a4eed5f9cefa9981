"""Shared fixtures: the real embedded target (loaded once per session) and drafters for it."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from dflash_core.drafter import DFlashDrafter, init_weights
from dflash_core.drafter_config import config_for_target
from dflash_core.engine import Engine
from dflash_core.events import Finished
from dflash_core.targets import Target, load_target
from dflash_core.verify_length import PassCosts, VerifyCost

# On a machine shared with other busy processes, DFLASH_TEST_THREADS=1 avoids oversubscription.
if os.environ.get("DFLASH_TEST_THREADS"):
    torch.set_num_threads(int(os.environ["DFLASH_TEST_THREADS"]))


# A 2-core CPU's pass costs (ms) and drafting time. Blocks sized from times measured while the
# tests run would make verdicts depend on how busy the machine is, so every test sizes its trees
# and adaptive chains from these; tests of the measuring itself unpin them.
CPU_LIKE = VerifyCost((1, 2, 4, 16), (60.0, 69.0, 90.0, 138.0))
PINNED_COSTS = PassCosts(chain=CPU_LIKE, tree=CPU_LIKE, draft_ms=8.0)
# Pinned for the whole session, not by a per-test fixture: module- and session-scoped fixtures are
# set up before any test's own (a module's sampled replies once measured their pass costs, so the
# same seed drew other tokens when the machine was busy). Tests that unpin them use monkeypatch,
# which restores these. Nor may the thread count follow the machine's load.
Engine.pinned_costs = PINNED_COSTS
Engine.fit_threads = False


@pytest.fixture(scope="session")
def target() -> Target:
    """The default: bf16 and batch-invariant on a CPU with bf16 units (AMX, AVX512-BF16), float32
    elsewhere (over bf16 weights where the compiled float32 linears build)."""
    return load_target("embedded", device="cpu")


@pytest.fixture(scope="session")
def target_fp32(target: Target) -> Target:
    """The target with float32 weights and maths, as vLLM serves it in float32 (the same object
    where that is the default; CPUs without bf16 units compute in float32 over bf16 weights)."""
    widened = target.fast_forward is not None and target.fast_forward.bf16_weights
    if target.dtype == torch.float32 and not widened:
        return target
    return load_target("embedded", device="cpu", dtype="float32")


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve_app(engine: Engine) -> Iterator[str]:
    """The real Gradio app on a free local port, in a background thread; yields its URL."""
    from app.ui import build_app, launch_kwargs

    demo = build_app(engine)
    port = free_port()
    # prevent_thread_lock: the server runs in a background thread and launch() returns.
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                **launch_kwargs())
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


@pytest.fixture(scope="session")
def app_engine() -> Engine:
    """What launch.py serves: the embedded target with the shipped (or fallback) drafter."""
    import dflash_core

    return dflash_core.load(device="cpu")
