"""Vision-language checkpoints whose text side transformers has no causal LM class for, as a user
meets them: tiny Kimi-K2.5 (a DeepSeek-V3 language model: MLA, routed experts) and Muse Glimmer
folders in the hub's layout load as text targets and decode as the full model does; Muse Glimmer's
own transformers-native DFlash assistant loads as the drafter and drafts exactly as transformers'
DFlash generator does (raw embeddings, not the normalised ones); the CLI and the app run an MLA
pair; what cannot be served is refused in one clean line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gradio_client
import pytest
import torch
from conftest import serve_app
from tiny_targets import MLA, SHAPE, widen
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.cache_utils import DFlashCache
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

import dflash_core
import dflash_core.__main__ as cli
from dflash_core.config import GenerationConfig
from dflash_core.drafter import DFlashDrafter, init_weights
from dflash_core.drafter_config import config_for_target
from dflash_core.engine import Engine
from dflash_core.events import Finished
from dflash_core.targets import Target, load_target

CHAT = [{"role": "user", "content": "Tell me about the sea and the sky, please."}]
TOKENS = 24
VISION = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2)
# The assistant's first layer slides over 3 positions: transformers' rule is "at most 3 away".
ASSISTANT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, block_size=8, mask_token_id=5, target_layer_ids=[1, 2],
                 sliding_window=3, layer_types=["sliding_attention", "full_attention"], bos_token_id=None,
                 eos_token_id=None, pad_token_id=None)


def vl_config(kind: str, vocab: int) -> Any:
    ends = dict(vocab_size=vocab, bos_token_id=None, eos_token_id=None)
    if kind == "kimi_k25":
        return AutoConfig.for_model(kind, text_config={**SHAPE, **MLA, **ends, "model_type": "deepseek_v3"},
                                    vision_config=VISION, projection_hidden_size=32, image_token_id=vocab - 1,
                                    video_token_id=vocab - 2)
    return AutoConfig.for_model(kind, text_config=dict(SHAPE, **ends, sliding_window=8), vision_config=VISION,
                                out_hidden_size=32, projector_hidden_size=32, image_token_id=vocab - 1,
                                video_token_id=vocab - 2)


@pytest.fixture(scope="module", params=["kimi_k25", "muse_glimmer"])
def vl_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
              target: Target) -> tuple[Path, Any]:
    """A tiny vision-language model saved as the hub ships it, plus the embedded tokenizer."""
    torch.manual_seed(0)
    model = widen(AutoModelForImageTextToText.from_config(vl_config(request.param, len(target.tokenizer))).eval())
    model.generation_config.eos_token_id = None
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    return folder, model


def test_the_text_side_decodes_as_the_full_model(vl_folder: tuple[Path, Any]) -> None:
    folder, full = vl_folder
    t = load_target(str(folder), device="cpu")
    assert t.config.model_type == {"kimi_k25": "deepseek_v3", "muse_glimmer": "muse_glimmer_text"}[
        full.config.model_type]
    assert not t.supports_tree and t.dtype == torch.float32
    if t.config.model_type == "deepseek_v3":
        assert "multi-head latent attention" in t.forward_note  # why no fast forward, in words
    ids = torch.tensor([t.encode_chat(CHAT)])
    with torch.no_grad():  # the same bits: Muse Glimmer's multiplier and soft-cap in the same order
        assert torch.equal(full(input_ids=ids).logits, t.model(input_ids=ids).logits)
    ref = full.generate(ids, max_new_tokens=TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
    *_, plain = Engine(t, None).generate(CHAT, GenerationConfig(max_new_tokens=TOKENS), plain=True)
    assert isinstance(plain, Finished) and plain.token_ids == ref


@pytest.fixture(scope="module")
def muse_pair(tmp_path_factory: pytest.TempPathFactory, target: Target) -> tuple[Any, Any, Engine]:
    """A tiny Muse Glimmer and a random transformers-native assistant for it, both as folders, loaded
    as a user would (`dflash_core.load`)."""
    vocab = len(target.tokenizer)
    torch.manual_seed(0)
    full = widen(AutoModelForImageTextToText.from_config(vl_config("muse_glimmer", vocab)).eval())
    full.generation_config.eos_token_id = None
    torch.manual_seed(1)
    assistant = widen(AutoModel.from_config(AutoConfig.for_model("muse_glimmer_assistant", **ASSISTANT)).eval(), 0.3)
    folder, assistant_folder = tmp_path_factory.mktemp("muse"), tmp_path_factory.mktemp("muse-assistant")
    full.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    assistant.save_pretrained(assistant_folder)
    return full, assistant, dflash_core.load(str(folder), str(assistant_folder), device="cpu")


def test_muse_glimmer_assistant_drafts_as_transformers_dflash_generator(muse_pair: tuple[Any, Any, Engine]) -> None:
    full, assistant, engine = muse_pair
    t, drafter = engine.target, engine.drafter
    assert drafter is not None and drafter.config.layer_causal(0) is False
    ids = torch.tensor([t.encode_chat(CHAT)])
    n = ids.shape[1] - 1  # context; the last prompt token anchors the block
    block = torch.tensor([[int(ids[0, -1])] + [ASSISTANT["mask_token_id"]] * 7])
    generator: Any = type("Generator", (), {"main_model_input_embeddings": full.get_input_embeddings()})()
    noise = DFlashTokenCandidateGenerator._get_noise_embeds(generator, block)
    assert torch.equal(t.embed(block), noise)  # the raw rows ...
    assert not torch.allclose(noise, full.get_input_embeddings()(block))  # ... not the normalised ones
    with torch.no_grad():
        hidden = full(input_ids=ids[:, :n], output_hidden_states=True).hidden_states
        context = torch.cat([hidden[i + 1] for i in ASSISTANT["target_layer_ids"]], -1)
        cache = DFlashCache(config=assistant.config)
        cache.set_previous_accepted_tokens(n)
        theirs = assistant(noise_embeds=noise, context_hidden_states=context, position_ids=torch.arange(n + 8)[None],
                           cache=cache).last_hidden_state
    _, feats = t.forward(ids[:, :n], t.new_cache(64), layer_ids=drafter.config.target_layer_ids)
    ours = drafter.step(t.embed(block), n, drafter.new_cache(64), feats[None])
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0)  # one window off would be far off
    # The whole reply: transformers' own DFlash generate on the same pair = ours = plain decoding.
    position_ids = torch.arange(ids.shape[1])[None]
    ref = full.generate(ids, attention_mask=torch.ones_like(ids), position_ids=position_ids, assistant_model=assistant,
                        speculation_type="dflash", max_new_tokens=TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
    *_, plain = engine.generate(CHAT, GenerationConfig(max_new_tokens=TOKENS), plain=True)
    assert isinstance(plain, Finished) and plain.token_ids == ref
    for verify in ("full", "adaptive"):
        *_, fin = engine.generate(CHAT, GenerationConfig(max_new_tokens=TOKENS, block_size=8, verify=verify))
        assert isinstance(fin, Finished) and fin.token_ids == ref


@pytest.fixture(scope="module")
def kimi_pair(tmp_path_factory: pytest.TempPathFactory, target: Target) -> tuple[Path, Path]:
    vocab = len(target.tokenizer)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("kimi-cli")
    widen(AutoModelForImageTextToText.from_config(vl_config("kimi_k25", vocab))).save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    cfg = config_for_target(AutoConfig.from_pretrained(folder), num_layers=1, block_size=8, mask_token_id=0)
    drafter = tmp_path_factory.mktemp("kimi-cli-dflash")
    init_weights(DFlashDrafter(cfg), seed=1).save(drafter, dtype=torch.float32)
    return folder, drafter


def test_cli_runs_an_mla_pair(capsys: pytest.CaptureFixture[str], kimi_pair: tuple[Path, Path]) -> None:
    folder, drafter = kimi_pair
    base = ["generate", "--target", str(folder), "--draft", str(drafter), "--device", "cpu",
            "--prompt", CHAT[0]["content"], "--max-new-tokens", "16"]
    assert cli.main([*base, "--plain"]) == 0
    plain_out, _ = capsys.readouterr()
    assert cli.main([*base, "--verify", "tree"]) == 0  # no fast forward: falls back to a chain
    out, _ = capsys.readouterr()
    assert out.splitlines()[0] == plain_out.splitlines()[0] and plain_out.strip()


def test_the_app_serves_an_mla_pair(kimi_pair: tuple[Path, Path]) -> None:
    """A visitor's reply through the app equals plain decoding on the Kimi-K2.5 (MLA) target."""
    engine = dflash_core.load(str(kimi_pair[0]), str(kimi_pair[1]), device="cpu")
    *_, plain = engine.generate(CHAT[0]["content"], GenerationConfig(max_new_tokens=16, block_size=4), plain=True)
    assert isinstance(plain, Finished) and plain.text.strip()
    with serve_app(engine) as url:
        client = gradio_client.Client(url, verbose=False, analytics_enabled=False, download_files=False)
        # textbox, block size, steps, temperature, top-p, max new tokens, seed, compare, verify length
        final = client.submit(CHAT[0]["content"], 4, 1, 0.0, 1.0, 16, 0, True, "auto",
                              api_name="/chat").result(timeout=600)
    _, chat, spec, *_, stats = final
    content = chat[-1]["content"]
    text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
    assert text == plain.text.strip()  # gradio's chatbot trims a message's outer whitespace
    assert "plain output identical ✓" in stats
    assert 'class="tok tok-target' in spec
    json.dumps(final)  # the whole update is plain data


@pytest.mark.parametrize(("kind", "expected"), [
    # head_dim must equal qk_rope_head_dim: transformers' own forward fails with a tensor-size error
    ("deepseek_v3", "does not run in transformers' own forward either"),
    ("llava", "has no text-generating (causal LM) model"),  # a vision-language type with no text side here
])
def test_unservable_families_are_refused_in_one_clean_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                           target: Target, kind: str, expected: str) -> None:
    if kind == "deepseek_v3":
        cfg = AutoConfig.for_model(kind, **{**SHAPE, **MLA, "qk_rope_head_dim": 64}, vocab_size=len(target.tokenizer))
        AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    else:
        AutoConfig.for_model(kind).save_pretrained(tmp_path)
    target.tokenizer.save_pretrained(tmp_path)
    capsys.readouterr()
    rc = cli.main(["generate", "--target", str(tmp_path), "--draft", "none", "--device", "cpu", "--prompt", "hi"])
    out, err = capsys.readouterr()
    lines = [line for line in err.strip().splitlines() if not line.startswith("Loading weights")]  # transformers' bar
    assert rc == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("error: ") and f"model type '{kind}'" in lines[0] and expected in lines[0]
    assert "supported: " in lines[0] and "size of tensor" not in lines[0]
