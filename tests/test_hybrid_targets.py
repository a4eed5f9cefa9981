"""Hybrid targets as a user meets them: a Qwen3.5 folder in the hub's layout (vision-language
checkpoint, text decoding) loads, runs plain and DFlash exactly, from the CLI and the app;
sampling keeps the target's distribution; a target whose cache we cannot roll back is refused
in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gradio_client
import pytest
import torch
from conftest import serve_app
from test_sampling_distribution import LENGTH, chi_square_p, exact_distribution, sampled_counts
from tiny_targets import LINEAR, SHAPE, tiny_model, widen
from toy import ToyTokenizer
from transformers import AutoConfig, AutoModelForImageTextToText

import dflash_core.__main__ as cli
from dflash_core.config import GenerationConfig
from dflash_core.drafter import DFlashDrafter, init_weights
from dflash_core.drafter_config import config_for_target
from dflash_core.engine import Engine
from dflash_core.errors import DFlashError
from dflash_core.events import Finished
from dflash_core.targets import Target, load_target

PROMPT = "Tell me about the sea and the sky, please."
TOKENS = 16


@pytest.fixture(scope="module")
def qwen35_folder(tmp_path_factory: pytest.TempPathFactory, target: Target) -> Path:
    """A tiny Qwen3.5 saved as the hub ships it: `Qwen3_5ForConditionalGeneration` with a
    text_config and a vision_config, plus the embedded tokenizer."""
    cfg = AutoConfig.for_model(
        "qwen3_5", text_config=dict(SHAPE, **LINEAR, vocab_size=len(target.tokenizer)),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64))
    torch.manual_seed(0)
    model = widen(AutoModelForImageTextToText.from_config(cfg).eval())
    folder = tmp_path_factory.mktemp("qwen3.5-tiny")
    model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def drafter_folder(tmp_path_factory: pytest.TempPathFactory, qwen35_folder: Path) -> Path:
    cfg = config_for_target(AutoConfig.from_pretrained(qwen35_folder), num_layers=1, block_size=8, mask_token_id=0)
    folder = tmp_path_factory.mktemp("qwen3.5-tiny-dflash")
    init_weights(DFlashDrafter(cfg), seed=1).save(folder, dtype=torch.float32)
    return folder


@pytest.fixture(scope="module")
def hybrid_engine(qwen35_folder: Path, drafter_folder: Path) -> Engine:
    import dflash_core

    return dflash_core.load(str(qwen35_folder), str(drafter_folder), device="cpu")


def test_hub_layout_folder_loads_as_a_hybrid_text_target(qwen35_folder: Path, hybrid_engine: Engine) -> None:
    t = hybrid_engine.target
    assert t.hybrid and not t.supports_tree
    assert t.config.model_type == "qwen3_5_text" and t.num_layers == SHAPE["num_hidden_layers"]
    # The text weights are the checkpoint's own: the same logits as the full vision-language model.
    full = AutoModelForImageTextToText.from_pretrained(qwen35_folder).eval()
    ids = torch.tensor([t.encode_chat([{"role": "user", "content": PROMPT}])])
    with torch.no_grad():
        assert torch.allclose(full(input_ids=ids).logits[0, -1], t.model(input_ids=ids).logits[0, -1], atol=1e-5)
    *_, plain = hybrid_engine.generate(PROMPT, GenerationConfig(max_new_tokens=TOKENS), plain=True)
    ref = full.generate(ids, max_new_tokens=TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
    assert isinstance(plain, Finished) and plain.token_ids == ref


def test_cli_runs_a_hybrid_pair_and_says_once_why_no_tree(capsys: pytest.CaptureFixture[str],
                                                          qwen35_folder: Path, drafter_folder: Path) -> None:
    base = ["generate", "--target", str(qwen35_folder), "--draft", str(drafter_folder), "--device", "cpu",
            "--prompt", PROMPT, "--max-new-tokens", str(TOKENS)]
    assert cli.main([*base, "--plain"]) == 0
    plain_out, _ = capsys.readouterr()
    assert cli.main([*base, "--verify", "tree"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == plain_out.splitlines()[0]  # the same reply text
    warns = [line for line in (out + err).splitlines() if "recurrent" in line]
    assert len(warns) == 1 and "verified as 'adaptive'" in warns[0]


@pytest.mark.parametrize(("model_type", "extra"), [
    ("jamba", {}),  # Mamba layers: linear-attention caches we have not checked
    ("falcon_h1", {}),  # layers that are attention and Mamba at once
])
def test_unrollable_targets_are_refused_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                    target: Target, model_type: str, extra: dict[str, Any]) -> None:
    AutoConfig.for_model(model_type, vocab_size=len(target.tokenizer), **extra).save_pretrained(tmp_path)
    target.tokenizer.save_pretrained(tmp_path)  # no weights: the config alone is refused
    with pytest.raises(DFlashError, match=f"model type '{model_type}'.*supported: .*qwen3_5"):
        load_target(str(tmp_path), device="cpu")
    rc = cli.main(["generate", "--target", str(tmp_path), "--draft", "none", "--device", "cpu", "--prompt", "hi"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and model_type in lines[0], err


@pytest.mark.parametrize(("model_type", "message"), [
    ("rwkv", "keeps a state this engine's cache does not hold"),  # its state bypasses the cache
    ("xlstm", "cannot be decoded with this engine's cache"),  # asks the cache for a state it lacks
])
def test_a_state_the_config_does_not_declare_is_refused_at_load(tmp_path: Path, target: Target, model_type: str,
                                                                  message: str) -> None:
    """Recurrent models whose configs declare no such layers: the load-time probe finds them."""
    from transformers import AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=len(target.tokenizer), hidden_size=64, num_hidden_layers=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    target.tokenizer.save_pretrained(tmp_path)
    with pytest.raises(DFlashError, match=f"model type '{model_type}'.*{message}.*supported"):
        load_target(str(tmp_path), device="cpu")


def test_speculative_sampling_on_a_hybrid_keeps_the_target_distribution() -> None:
    # Far from uniform, so the test can tell distributions apart.
    model = widen(tiny_model("qwen3_5_text", vocab_size=4, seed=3), std=0.3, embeddings=True)
    target = Target(model=model, tokenizer=ToyTokenizer(), name="toy-hybrid", device=torch.device("cpu"),
                    dtype=torch.float32)
    cfg_d = config_for_target(model.config, num_layers=1, block_size=3, mask_token_id=3)
    engine = Engine(target, init_weights(DFlashDrafter(cfg_d), std=0.3, seed=5))
    cfg = GenerationConfig(max_new_tokens=LENGTH, temperature=1.0, block_size=3, steps=1)
    counts, tau = sampled_counts(engine, cfg)
    assert 1.0 < tau < 3.0, "the drafter should be right sometimes and wrong sometimes"
    assert chi_square_p(counts, exact_distribution(target, cfg)) > 1e-3


def test_the_app_serves_a_hybrid_target(hybrid_engine: Engine) -> None:
    *_, plain = hybrid_engine.generate(PROMPT, GenerationConfig(max_new_tokens=TOKENS, block_size=4), plain=True)
    assert isinstance(plain, Finished)
    with serve_app(hybrid_engine) as url:
        client = gradio_client.Client(url, verbose=False, analytics_enabled=False, download_files=False)
        # textbox, block size, steps, temperature, top-p, max new tokens, seed, compare, verify length
        final = client.submit(PROMPT, 4, 1, 0.0, 1.0, TOKENS, 0, True, "auto", api_name="/chat").result(timeout=600)
    _, chat, spec, *_, stats = final
    content = chat[-1]["content"]
    text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
    assert text == plain.text and plain.text.strip()
    assert "plain output identical ✓" in stats
    assert 'class="tok tok-target' in spec
    json.dumps(final)  # the whole update is plain data
