"""A slice of scripts/fuzz_exact.py in CI: random prompts and settings, every reply equal to plain
greedy (the full runs' figures are in docs/robustness.md)."""

from __future__ import annotations

import importlib.util
import sys

from dflash_core import load_drafter
from dflash_core.engine import Engine
from dflash_core.loading import SHIPPED_DRAFTER
from dflash_core.targets import Target

spec = importlib.util.spec_from_file_location("fuzz_exact", SHIPPED_DRAFTER.parent.parent / "scripts" / "fuzz_exact.py")
fuzz_exact = importlib.util.module_from_spec(spec)
sys.modules["fuzz_exact"] = fuzz_exact  # its dataclass looks its module up
spec.loader.exec_module(fuzz_exact)


def test_cases_are_reproducible_and_varied() -> None:
    cases = [fuzz_exact.make_case(seed, 49152) for seed in range(300)]
    assert cases[7] == fuzz_exact.make_case(7, 49152)
    assert {c.kind for c in cases} == {"piece", "words", "short", "long", "chat", "ids"}
    assert {c.verify for c in cases} == {"auto", "adaptive", "full", "tree", "tree-full"}
    assert {c.steps for c in cases} == {1, 2, 3} and {c.lookup for c in cases} == {True, False}
    assert min(c.block_size for c in cases) == 2 and max(c.block_size for c in cases) == 32
    assert all(c.steps == 1 for c in cases if c.verify.startswith("tree"))


def test_fuzz_slice_is_exact(target: Target) -> None:
    engine = Engine(target, load_drafter(SHIPPED_DRAFTER, device=target.device, dtype=target.dtype))
    pinned = Engine.pinned_costs
    summary = fuzz_exact.fuzz(engine, cases=24, first_seed=1000, progress=False)
    assert Engine.pinned_costs is pinned and "pinned_costs" not in vars(engine)  # the fuzz's own tables are undone
    assert summary["cases"] == 24
    assert summary["mismatches"] == 0, summary["mismatching_cases"]
    assert len(summary["by_mode"]) >= 3
