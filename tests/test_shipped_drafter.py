"""The drafter shipped in assets/drafter: it loads, fits the embedded target, is the default, and
accepts more than an untrained drafter of the same shape (a loose floor, not a speed test)."""

from __future__ import annotations

import copy
import json

import pytest
from conftest import finish

import dflash_core
from dflash_core.config import GenerationConfig
from dflash_core.drafter import DFlashDrafter, init_weights, load_drafter
from dflash_core.drafter_config import check_fit
from dflash_core.engine import Engine
from dflash_core.loading import SHIPPED_DRAFTER

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the factorial of n.",
]


@pytest.fixture(scope="module")
def shipped(target) -> DFlashDrafter:
    return load_drafter(SHIPPED_DRAFTER, device=target.device, dtype=target.dtype)


def test_shipped_drafter_fits_and_has_a_card(shipped: DFlashDrafter, target) -> None:
    check_fit(shipped.config, hidden_size=target.hidden_size, vocab_size=target.vocab_size,
              num_layers=target.num_layers)
    assert shipped.config.block_size == 16
    report = json.loads((SHIPPED_DRAFTER / "train_report.json").read_text())
    card = (SHIPPED_DRAFTER / "MODEL_CARD.md").read_text()
    # The card states the run's own numbers: data size, steps, hardware.
    answers = report["data"].get("answer_samples", 0)
    assert f"{report['data']['samples'] - answers} replies" in card
    assert not answers or f"{answers} ShareGPT answers" in card
    assert f"{report['train']['steps']} optimizer steps" in card
    assert "CPU" in card or "GPU" in card
    # ...and the benchmark's, row for row (bench/*.json are the runs the README tables show).
    for name in ("humaneval", "gsm8k"):
        bench = json.loads((SHIPPED_DRAFTER.parent.parent / "bench" / f"{name}.json").read_text())["summary"]
        b16 = bench["per_method"]["dflash-b16-full"]  # every draft verified: tau as published (the bar)
        assert f"| {name} | {bench['prompts']} | {bench['max_new_tokens']} | `dflash-b16-full` | {b16['tau']:.2f} |" \
            in card
        assert bench["mismatches"] == 0
    size_mb = (SHIPPED_DRAFTER / "model.safetensors").stat().st_size / 2**20
    assert size_mb < 64  # "tens of MB at most"


def test_shipped_drafter_is_the_default() -> None:
    engine = dflash_core.load(device="cpu")
    assert engine.drafter_name == str(SHIPPED_DRAFTER)
    assert not engine.warnings


def test_shipped_drafter_accepts_more_than_an_untrained_one(shipped: DFlashDrafter, target) -> None:
    untrained = init_weights(DFlashDrafter(shipped.config), seed=0).to(target.device, target.dtype).eval()
    config = GenerationConfig(max_new_tokens=48, temperature=0.0, block_size=16, verify="full")  # drafter quality
    committed = {}
    outputs = {}
    for name, drafter in (("shipped", shipped), ("untrained", untrained)):
        engine = Engine(target, drafter)
        fins = [finish(engine.generate(p, config)) for p in PROMPTS]
        committed[name] = sum(f.tau * f.blocks for f in fins) / sum(f.blocks for f in fins)
        outputs[name] = [f.token_ids for f in fins]
    assert outputs["shipped"] == outputs["untrained"]  # exact either way: only tau differs
    assert committed["shipped"] > committed["untrained"] + 0.1


def test_shipped_draft_vocabulary_is_used_and_exact(shipped: DFlashDrafter, target) -> None:
    assert shipped.draft_vocab is not None and shipped.draft_vocab.shape == (8192,)
    vocab = set(shipped.draft_vocab.tolist())
    engine = Engine(target, shipped)
    # The drafter's candidates only: prompt-lookup guesses come from the text, not the draft vocabulary.
    config = GenerationConfig(max_new_tokens=40, temperature=0.0, block_size=8, lookup=False)
    for prompt in PROMPTS:
        drafted: list[int] = []
        fin = None
        for ev in engine.generate(prompt, config):
            drafted.extend(getattr(ev, "draft", []))
            fin = ev
        assert set(drafted) <= vocab  # drafts come from the draft vocabulary only...
        assert fin.token_ids == finish(engine.generate(prompt, config, plain=True)).token_ids  # ...output is exact
    assert Engine(target, shipped).drafting.head is not None
    whole = copy.deepcopy(shipped)
    whole.draft_vocab = None
    assert Engine(target, whole).drafting.head is None  # without one: draft over the full vocabulary
