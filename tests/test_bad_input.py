"""Bad input gets a DFlashError that says what is wrong, raised early, without a torch traceback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import finish

from dflash_core.config import GenerationConfig
from dflash_core.drafter import DFlashDrafter, init_weights, load_drafter
from dflash_core.engine import Engine
from dflash_core.errors import DFlashError
from dflash_core.targets import Target, load_target

LIBRARY_DIRS = ("site-packages/torch/", "site-packages/transformers/", "site-packages/safetensors/")




def assert_clean(info: pytest.ExceptionInfo[DFlashError]) -> None:
    """The error is ours, raised from our code, with no library exception chained to it."""
    err = info.value
    assert type(err) is DFlashError
    assert err.__cause__ is None
    assert err.__context__ is None or err.__suppress_context__
    deep = [str(entry.path) for entry in info.traceback if any(d in str(entry.path) for d in LIBRARY_DIRS)]
    assert not deep, deep


def raises(pattern: str, fn: Any, *args: Any, **kwargs: Any) -> DFlashError:
    with pytest.raises(DFlashError, match=pattern) as info:
        fn(*args, **kwargs)
    assert_clean(info)
    return info.value


@pytest.fixture
def forward_calls(target: Target) -> Iterator[list[int]]:
    """Counts forwards of the target model while a test runs."""
    calls: list[int] = []
    handle = target.model.register_forward_pre_hook(lambda *_: calls.append(1))
    yield calls
    handle.remove()


# ----- prompts -----


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "dflash"])
@pytest.mark.parametrize(
    "prompt",
    ["", "   ", "\n\t", [], [{"role": "user", "content": "  "}], [{"role": "system", "content": ""}]],
    ids=["empty", "spaces", "whitespace", "empty-list", "blank-message", "empty-system"],
)
def test_empty_prompt(engine: Engine, forward_calls: list[int], prompt: Any, plain: bool) -> None:
    raises(r"^the prompt is empty$", engine.generate, prompt, GenerationConfig(max_new_tokens=4), plain=plain)
    assert forward_calls == []


@pytest.mark.parametrize(
    ("prompt", "pattern"),
    [
        ([5, 49152], r"token ids \[49152\] are outside the vocabulary \(0\.\.49151\)"),
        ([-1, 3], r"token ids \[-1\] are outside the vocabulary"),
        ([{"content": "hi"}], r"chat messages must be \{'role': \.\.\., 'content': \.\.\.\} dicts"),
        (["hello", "world"], r"chat messages must be"),
    ],
    ids=["id-too-big", "id-negative", "message-without-role", "list-of-strings"],
)
def test_malformed_prompt(engine: Engine, forward_calls: list[int], prompt: Any, pattern: str) -> None:
    raises(pattern, engine.generate, prompt, GenerationConfig(max_new_tokens=4))
    assert forward_calls == []


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "dflash"])
@pytest.mark.parametrize("kind", ["ids", "ids-exact", "text", "chat"])
def test_over_long_prompt_fails_before_any_forward(target: Target, engine: Engine, forward_calls: list[int],
                                                   kind: str, plain: bool) -> None:
    ctx = target.max_context
    assert ctx == 8192
    tok = target.tokenizer.encode(" hello")[0]
    long_text = "The quick brown fox jumps over the lazy dog. " * 1000  # about 10k tokens
    prompt: Any = {
        "ids": [tok] * (ctx + 100),
        "ids-exact": [tok] * ctx,  # no room for even one new token
        "text": long_text,
        "chat": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                 {"role": "user", "content": long_text}],
    }[kind]
    err = raises(r"the prompt has \d+ tokens but the target's context window is 8192; shorten the prompt",
                 engine.generate, prompt, GenerationConfig(max_new_tokens=4), plain=plain)
    n = int(str(err).split("has ")[1].split(" tokens")[0])
    assert n >= ctx
    assert forward_calls == []  # raised by generate() itself, before the prefill


def test_dflash_without_drafter(target: Target) -> None:
    raises(r"DFlash decoding needs a drafter", Engine(target, None).generate, "Hi")


# ----- generation settings -----


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"block_size": 0}, r"block_size must be an integer from 2 to 32, got 0\."),
        ({"block_size": 1}, r"block_size must be an integer from 2 to 32, got 1\."),
        ({"block_size": 1000}, r"block_size must be an integer from 2 to 32, got 1000\."),
        ({"block_size": 4.0}, r"block_size must be an integer"),
        ({"temperature": -1}, r"temperature must be >= 0 \(0 = greedy\), got -1\."),
        ({"top_p": 0}, r"top_p must be in \(0, 1\], got 0\."),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1\.5\."),
        ({"top_k": -1}, r"top_k must be an integer >= 0"),
        ({"steps": 0}, r"steps \(denoising steps per block\) must be an integer >= 1, got 0\."),
        ({"max_new_tokens": 0}, r"max_new_tokens must be a positive integer, got 0\."),
        ({"max_new_tokens": -5}, r"max_new_tokens must be a positive integer, got -5\."),
        ({"stop": ("",)}, r"stop strings must be non-empty strings"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_bad_generation_config(kwargs: dict[str, Any], pattern: str) -> None:
    raises(pattern, GenerationConfig, **kwargs)


def test_good_generation_config_edges() -> None:
    cfg = GenerationConfig(block_size=2, top_p=1.0, temperature=0, steps=1, max_new_tokens=1, stop="x")
    assert cfg.stop == ("x",) and cfg.greedy
    assert GenerationConfig(block_size=32).block_size == 32
    raises(r"block_size must be", cfg.with_, block_size=33)  # with_ validates too


# ----- loading -----


def test_unknown_target_path() -> None:
    raises(r"target '/no/such/dir': no such folder", load_target, "/no/such/dir", device="cpu")


def test_target_path_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "model.gguf"
    f.write_text("not a model")
    raises(r"is a file; give a model folder", load_target, str(f), device="cpu")


def test_target_folder_without_a_model(tmp_path: Path) -> None:
    raises(r"could not load target", load_target, str(tmp_path), device="cpu")


def test_unknown_drafter_path() -> None:
    raises(r"drafter '/no/such/drafter': no such folder", load_drafter, "/no/such/drafter")


def _good_drafter_folder(folder: Path) -> dict[str, Any]:
    from dflash_core.drafter_config import DFlashConfig

    cfg = DFlashConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=100, num_target_layers=4,
                       target_layer_ids=[2], mask_token_id=99, block_size=4)
    init_weights(DFlashDrafter(cfg)).save(folder, dtype=torch.float32)
    return json.loads((folder / "config.json").read_text())


def test_good_drafter_folder_loads(tmp_path: Path) -> None:
    _good_drafter_folder(tmp_path)
    assert load_drafter(tmp_path).config.hidden_size == 32  # the broken variants below start from this


def _edit(cfg: dict[str, Any], change: str) -> dict[str, Any] | str:
    cfg = json.loads(json.dumps(cfg))
    if change == "truncated":
        return json.dumps(cfg)[:40]
    if change == "not-dflash":
        cfg["architectures"] = ["Qwen3ForCausalLM"]
    elif change == "no-architectures":
        del cfg["architectures"]
    elif change == "no-hidden-size":
        del cfg["hidden_size"]
    elif change == "no-dflash-config":
        del cfg["dflash_config"]
    elif change == "no-num-target-layers":
        del cfg["num_target_layers"]
    elif change == "hidden-size-null":
        cfg["hidden_size"] = None
    elif change == "hidden-size-text":
        cfg["hidden_size"] = "big"
    return cfg


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ("truncated", r"config\.json is not valid JSON"),
        ("not-dflash", r"is not a DFlash drafter \(architectures = \['Qwen3ForCausalLM'\]; known: DFlashDraftModel, "
                       r"DFlash2DraftModel\)"),
        ("no-architectures", r"is not a DFlash drafter \(architectures = None; known: "),
        ("no-hidden-size", r"drafter config\.json lacks the field 'hidden_size'"),
        ("no-dflash-config", r"drafter config\.json lacks the field 'mask_token_id'"),
        ("no-num-target-layers", r"drafter config\.json lacks the field 'num_target_layers'"),
        ("hidden-size-null", r"hidden_size = None is not a valid int"),
        ("hidden-size-text", r"hidden_size = 'big' is not a valid int"),
    ],
)
def test_broken_drafter_config(tmp_path: Path, change: str, pattern: str) -> None:
    cfg = _good_drafter_folder(tmp_path)
    edited = _edit(cfg, change)
    (tmp_path / "config.json").write_text(edited if isinstance(edited, str) else json.dumps(edited))
    raises(pattern, load_drafter, tmp_path)


def test_drafter_folder_without_config_or_weights(tmp_path: Path) -> None:
    raises(r"has no config\.json", load_drafter, tmp_path)
    _good_drafter_folder(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    raises(r"has no \*\.safetensors weights", load_drafter, tmp_path)


def test_drafter_weights_missing_a_tensor(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    _good_drafter_folder(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["layers.0.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    raises(r"lack \['layers\.0\.mlp\.up_proj\.weight'\] \(1 missing\)", load_drafter, tmp_path)


def test_drafter_weights_of_the_wrong_shape(tmp_path: Path) -> None:
    cfg = _good_drafter_folder(tmp_path)
    cfg["intermediate_size"] = 64  # the weights were saved with 48
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    raises(r"intermediate|shape|size", load_drafter, tmp_path)


# ----- max_new_tokens past the context window -----


class SmallWindow(Target):
    """The real embedded target, declared with a short context window so the edge is cheap to reach."""

    window: int = 0

    @property
    def max_context(self) -> int:
        return self.window


def small_window(target: Target, window: int) -> Target:
    t = SmallWindow(model=target.model, tokenizer=target.tokenizer, name=target.name, device=target.device,
                    dtype=target.dtype)
    t.window = window
    return t


@pytest.fixture(scope="module")
def hi_reference(target: Target, engine: Engine) -> tuple[list[int], list[int]]:
    prompt_ids = engine.prompt_ids("Hi")
    fin = finish(engine.generate(prompt_ids, GenerationConfig(max_new_tokens=6), plain=True))
    assert fin.reason == "length"
    return prompt_ids, fin.token_ids


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "dflash"])
def test_max_new_tokens_clamped_to_context(target: Target, random_drafter: DFlashDrafter,
                                           hi_reference: tuple[list[int], list[int]], plain: bool) -> None:
    prompt_ids, ref = hi_reference
    room = 5
    eng = Engine(small_window(target, len(prompt_ids) + room), random_drafter)
    fin = finish(eng.generate(prompt_ids, GenerationConfig(max_new_tokens=40, block_size=8), plain=plain))
    assert fin.warnings == [f"max_new_tokens lowered from 40 to {room} to fit the context window"]
    assert fin.reason == "context"
    assert fin.token_ids == ref[:room]


def test_one_token_of_room(target: Target, random_drafter: DFlashDrafter,
                           hi_reference: tuple[list[int], list[int]]) -> None:
    prompt_ids, ref = hi_reference
    eng = Engine(small_window(target, len(prompt_ids) + 1), random_drafter)
    fin = finish(eng.generate(prompt_ids, GenerationConfig(max_new_tokens=3, block_size=4)))
    assert fin.reason == "context" and fin.token_ids == ref[:1]
    assert "lowered from 3 to 1" in fin.warnings[0]
    raises(r"the prompt has \d+ tokens but the target's context window is", small_engine_generate, eng,
           [*prompt_ids, ref[0]])


def small_engine_generate(eng: Engine, ids: list[int]) -> object:
    return eng.generate(ids, GenerationConfig(max_new_tokens=3))


def test_no_warning_when_it_fits(target: Target, random_drafter: DFlashDrafter,
                                 hi_reference: tuple[list[int], list[int]]) -> None:
    prompt_ids, ref = hi_reference
    eng = Engine(small_window(target, len(prompt_ids) + 4), random_drafter)
    fin = finish(eng.generate(prompt_ids, GenerationConfig(max_new_tokens=3, block_size=4)))
    assert fin.warnings == [] and fin.reason == "length" and fin.token_ids == ref[:3]


# ----- damaged weight files -----


def _cut_short(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def test_truncated_drafter_weights_name_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dflash_core import __main__ as cli
    from dflash_core.loading import SHIPPED_DRAFTER

    folder = tmp_path / "drafter"
    folder.mkdir()
    for f in SHIPPED_DRAFTER.iterdir():
        if f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    _cut_short(folder / "model.safetensors")
    err = raises(r"model\.safetensors cannot be read .*damaged or incomplete; download or copy it again",
                 load_drafter, folder)
    assert str(folder / "model.safetensors") in str(err)
    rc = cli.main(["generate", "--prompt", "Hi", "--draft", str(folder), "--device", "cpu"])  # as a user would
    out, stderr = capsys.readouterr()
    assert rc == 2 and out == ""
    lines = stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "model.safetensors" in lines[-1] and "Traceback" not in stderr


def test_truncated_target_weights_name_the_file(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, vocab_size=128)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    embedded = load_target("embedded", device="cpu").tokenizer
    embedded.save_pretrained(tmp_path)
    assert load_target(str(tmp_path), device="cpu").vocab_size == 128  # intact, it loads
    _cut_short(tmp_path / "model.safetensors")
    err = raises(r"could not load target .*model\.safetensors is damaged or incomplete", load_target,
                 str(tmp_path), device="cpu")
    assert str(tmp_path / "model.safetensors") in str(err)


def test_damaged_embedded_cache_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A cut-short cached copy of the embedded target is converted again from the GGUF, with a note."""
    from dflash_core import targets

    stale = tmp_path / targets.EMBEDDED_NAME
    stale.mkdir()
    (stale / "STAMP").write_text(str(targets.embedded_gguf_path().stat().st_size))  # looks complete
    real = targets.embedded_model_dir()
    for f in real.iterdir():
        (stale / f.name).write_bytes(f.read_bytes())
    _cut_short(stale / "model.safetensors")
    monkeypatch.setenv("DFLASH_STUDIO_CACHE", str(tmp_path))
    target = load_target("embedded", device="cpu", dtype="float32")
    assert "cached embedded target is damaged" in capsys.readouterr().out
    assert targets.damaged_weights(stale) is None  # rebuilt in place
    assert target.vocab_size == load_target("embedded", device="cpu", dtype="float32").vocab_size
