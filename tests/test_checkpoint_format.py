"""The z-lab checkpoint format: DFlashDrafter.save / load_drafter, config parsing, fit checks."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import finish
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_core.config import GenerationConfig
from dflash_core.drafter import DFlashDrafter, init_weights, load_drafter
from dflash_core.drafter_config import DFlashConfig, config_for_target, default_target_layer_ids
from dflash_core.engine import Engine
from dflash_core.errors import DFlashError
from dflash_core.targets import Target

# The published z-lab config of z-lab/Qwen3-8B-DFlash-b16 (as written by transformers 4.x).
ZLAB_QWEN3_8B: dict[str, Any] = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 16,
    "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960,
    "max_window_layers": 5,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "transformers_version": "4.57.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}




def small_zlab(**changes: Any) -> dict[str, Any]:
    """The z-lab config with one drafter layer and tiny hidden sizes (vocab etc. unchanged)."""
    cfg = copy.deepcopy(ZLAB_QWEN3_8B)
    cfg.update(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               num_hidden_layers=1, layer_types=["full_attention"], max_window_layers=1)
    cfg.update(changes)
    return cfg


def write_checkpoint(folder: Path, cfg: dict[str, Any], prefix: str = "", extra: dict | None = None,
                     seed: int = 0) -> dict[str, torch.Tensor]:
    """A folder in the published layout, written without DFlashDrafter.save."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    drafter = init_weights(DFlashDrafter(DFlashConfig.from_dict(cfg)), seed=seed)
    state = {prefix + k: v.to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()}
    state.update(extra or {})
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return state


def small_config(num_layers: int = 3) -> DFlashConfig:
    return DFlashConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=1000, num_target_layers=8,
        target_layer_ids=default_target_layer_ids(8, num_layers), mask_token_id=999, block_size=4,
        rope_theta=10_000.0, max_position_embeddings=512,
    )


@pytest.fixture(scope="module")
def small_drafter() -> DFlashDrafter:
    return init_weights(DFlashDrafter(small_config()), std=0.1, seed=7).eval()


def expected_keys(n_layers: int) -> set[str]:
    keys = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(n_layers):
        p = f"layers.{i}."
        keys |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        keys |= {p + f"self_attn.{x}_norm.weight" for x in "qk"}
        keys |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        keys |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    return keys


def run_step(drafter: DFlashDrafter, seed: int = 0) -> list[torch.Tensor]:
    """Two inference steps over fresh context, the way the engine calls them."""
    cfg = drafter.config
    g = torch.Generator().manual_seed(seed)
    h, n_ctx = cfg.hidden_size, len(cfg.target_layer_ids)
    cache = drafter.new_cache(32)
    outs = []
    with torch.no_grad():
        ctx1 = torch.randn(1, 5, n_ctx * h, generator=g)
        outs.append(drafter.step(torch.randn(1, cfg.block_size, h, generator=g), 5, cache, ctx1))
        ctx2 = torch.randn(1, 2, n_ctx * h, generator=g)
        outs.append(drafter.step(torch.randn(1, cfg.block_size, h, generator=g), 7, cache, ctx2))
        outs.append(drafter.step(torch.randn(1, cfg.block_size, h, generator=g), 7, cache, None))  # 2nd step
    return outs


def run_train(drafter: DFlashDrafter, seed: int = 0) -> torch.Tensor:
    cfg = drafter.config
    g = torch.Generator().manual_seed(seed)
    h, n_ctx, bs = cfg.hidden_size, len(cfg.target_layer_ids), cfg.block_size
    T, n_blocks = 10, 2
    N = n_blocks * bs
    anchors = [3, 6]
    positions = torch.cat([torch.arange(a, a + bs) for a in anchors])
    mask = torch.zeros(1, 1, N, T + N, dtype=torch.bool)
    for b, a in enumerate(anchors):
        rows = slice(b * bs, (b + 1) * bs)
        mask[0, 0, rows, :a] = True  # the context before the anchor
        mask[0, 0, rows, T + b * bs : T + (b + 1) * bs] = True  # the block itself, bidirectional
    with torch.no_grad():
        return drafter.forward_train(torch.randn(2, T, n_ctx * h, generator=g),
                                     torch.randn(2, N, h, generator=g), positions, mask)


# ----- save / load round trip -----


def test_fp32_round_trip_is_exact(small_drafter: DFlashDrafter, tmp_path: Path) -> None:
    small_drafter.save(tmp_path, dtype=torch.float32)
    loaded = load_drafter(tmp_path, dtype=torch.float32)
    assert loaded.config.target_layer_ids == small_drafter.config.target_layer_ids
    for k, v in small_drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    for a, b in zip(run_step(small_drafter), run_step(loaded), strict=True):
        assert a.shape == (1, 4, 64)
        assert torch.equal(a, b)
    assert torch.equal(run_train(small_drafter), run_train(loaded))


def test_draft_vocabulary_round_trip_and_bad_files(small_drafter: DFlashDrafter, tmp_path: Path) -> None:
    d = copy.deepcopy(small_drafter)
    d.draft_vocab = torch.tensor([3, 7, 11])
    d.save(tmp_path / "with")
    assert torch.equal(load_drafter(tmp_path / "with").draft_vocab, torch.tensor([3, 7, 11]))
    # It is not a weight file: the z-lab weights are unchanged, and a plain save has no vocabulary.
    assert sorted(f.name for f in (tmp_path / "with").glob("*.safetensors")) == ["model.safetensors"]
    small_drafter.save(tmp_path / "without")
    assert load_drafter(tmp_path / "without").draft_vocab is None
    vocab = small_drafter.config.vocab_size
    for bad, message in (("[1, 1]", "distinct"), (f"[0, {vocab}]", "inside the vocabulary"), ("[]", "non-empty"),
                         ("{", "not valid JSON")):
        (tmp_path / "with" / "draft_vocab.json").write_text(bad)
        with pytest.raises(DFlashError, match=message):
            load_drafter(tmp_path / "with")


def test_bf16_save_loads_close(small_drafter: DFlashDrafter, tmp_path: Path) -> None:
    small_drafter.save(tmp_path)  # bf16 is the default, as published
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load_drafter(tmp_path, dtype=torch.float32)
    for k, v in small_drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v.to(torch.bfloat16).float()), k
    for a, b in zip(run_step(small_drafter), run_step(loaded), strict=True):
        assert not torch.equal(a, b)  # bf16 rounding is visible ...
        assert float((a - b).abs().max()) < 0.05 * float(a.abs().max())  # ... but small
    a, b = run_train(small_drafter), run_train(loaded)
    assert float((a - b).abs().max()) < 0.05 * float(a.abs().max())
    loaded16 = load_drafter(tmp_path, dtype=torch.bfloat16)
    assert loaded16.fc.weight.dtype == torch.bfloat16


def test_saved_config_and_keys(small_drafter: DFlashDrafter, tmp_path: Path) -> None:
    small_drafter.save(tmp_path, dtype=torch.float32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 4
    assert cfg["num_target_layers"] == 8
    assert cfg["dflash_config"] == {"target_layer_ids": [1, 3, 5], "mask_token_id": 999}
    assert cfg["dtype"] == "float32"
    usual = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000, "rms_norm_eps": 1e-6,
             "rope_theta": 10_000.0, "max_position_embeddings": 512, "hidden_act": "silu",
             "attention_bias": False, "tie_word_embeddings": False, "rope_scaling": None}
    assert {k: cfg.get(k) for k in usual} == usual
    assert "target_layer_ids" not in cfg and "mask_token_id" not in cfg  # only inside dflash_config
    assert "extra" not in cfg
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("fc.weight").shape == (64, 3 * 64)
    assert keys == expected_keys(3)
    assert not [k for k in keys if "embed" in k or "lm_head" in k]


def test_config_round_trip() -> None:
    cfg = small_config()
    d = cfg.to_dict()
    back = DFlashConfig.from_dict(d)
    for name in DFlashConfig.__dataclass_fields__:
        if name != "extra":
            assert getattr(back, name) == getattr(cfg, name), name
    assert back.to_dict() == d  # stable under a second round trip


# ----- the published z-lab format -----


def test_zlab_config_parses() -> None:
    cfg = DFlashConfig.from_dict(ZLAB_QWEN3_8B)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4096, 32, 8, 128)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers) == (12288, 151936, 5)
    assert cfg.num_target_layers == 36
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33]
    assert cfg.mask_token_id == 151669
    assert cfg.block_size == 16
    assert cfg.rope_theta == 1_000_000.0
    assert (cfg.bos_token_id, cfg.eos_token_id) == (151643, 151645)
    assert cfg.extra["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}  # kept for the round trip
    assert DFlashConfig.from_dict(ZLAB_QWEN3_8B) == cfg  # from_dict does not consume its input
    assert ZLAB_QWEN3_8B["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33]


def test_zlab_qwen3_8b_parameter_shapes_on_meta() -> None:
    with torch.device("meta"):
        drafter = DFlashDrafter(DFlashConfig.from_dict(ZLAB_QWEN3_8B))
    shapes = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    assert set(shapes) == expected_keys(5)
    assert shapes["fc.weight"] == (4096, 5 * 4096)
    assert shapes["hidden_norm.weight"] == shapes["norm.weight"] == (4096,)
    layer = {k.removeprefix("layers.0."): v for k, v in shapes.items() if k.startswith("layers.0.")}
    assert layer == {
        "self_attn.q_proj.weight": (32 * 128, 4096),
        "self_attn.k_proj.weight": (8 * 128, 4096),
        "self_attn.v_proj.weight": (8 * 128, 4096),
        "self_attn.o_proj.weight": (4096, 32 * 128),
        "self_attn.q_norm.weight": (128,),
        "self_attn.k_norm.weight": (128,),
        "mlp.gate_proj.weight": (12288, 4096),
        "mlp.up_proj.weight": (12288, 4096),
        "mlp.down_proj.weight": (4096, 12288),
        "input_layernorm.weight": (4096,),
        "post_attention_layernorm.weight": (4096,),
    }
    # About 1.0B parameters for the 5-layer drafter, as published.
    n = sum(v.numel() for v in drafter.state_dict().values())
    assert 0.9e9 < n < 1.1e9


@pytest.mark.parametrize("prefix", ["", "model."])
def test_zlab_format_folder_loads(tmp_path: Path, prefix: str) -> None:
    cfg = small_zlab(rope_theta=123456)
    extra = {"embed_tokens.weight": torch.zeros(8, 64, dtype=torch.bfloat16)}  # some exporters add one
    state = write_checkpoint(tmp_path, cfg, prefix=prefix, extra=extra)
    drafter = load_drafter(tmp_path)
    assert drafter.config.rope_theta == 123456.0  # the top-level rope_theta is read, not defaulted
    assert drafter.config.target_layer_ids == [1, 9, 17, 25, 33]
    assert drafter.config.mask_token_id == 151669 and drafter.block_size == 16
    assert drafter.fc.weight.shape == (64, 5 * 64)
    assert drafter.fc.weight.device.type == "cpu" and drafter.fc.weight.dtype == torch.float32
    assert torch.equal(drafter.fc.weight, state[prefix + "fc.weight"].float())
    out = run_step(drafter)
    assert all(torch.isfinite(o).all() for o in out)


def test_transformers5_rope_parameters(tmp_path: Path) -> None:
    cfg = small_zlab()
    del cfg["rope_theta"], cfg["rope_scaling"]
    cfg["rope_parameters"] = {"rope_theta": 250000.0, "rope_type": "default"}
    write_checkpoint(tmp_path, cfg)
    drafter = load_drafter(tmp_path)
    assert drafter.config.rope_theta == 250000.0
    saved = drafter.config.to_dict()
    assert saved["rope_theta"] == 250000.0 and "rope_parameters" not in saved


def test_rope_theta_changes_the_output(tmp_path: Path) -> None:
    # Guard for the two tests above: rope_theta really reaches the computation.
    a = write_checkpoint(tmp_path / "a", small_zlab(rope_theta=10000))
    write_checkpoint(tmp_path / "b", small_zlab(rope_theta=500000))
    da, db = load_drafter(tmp_path / "a"), load_drafter(tmp_path / "b")
    assert torch.equal(da.fc.weight, db.fc.weight) and torch.equal(da.fc.weight, a["fc.weight"].float())
    assert not torch.equal(run_step(da)[1], run_step(db)[1])


def test_unknown_rope_scaling_is_refused(tmp_path: Path) -> None:
    # default, linear and yarn are supported (tests/test_drafter_configs.py); others are named.
    write_checkpoint(tmp_path, small_zlab())
    cfg = small_zlab(rope_scaling={"rope_type": "longrope", "factor": 4.0})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match=r"RoPE scaling 'longrope'"):
        load_drafter(tmp_path)


def test_default_target_layer_ids() -> None:
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, 2) == [1, 27]
    assert default_target_layer_ids(30, 1) == [15]
    ids = default_target_layer_ids(30, 4)
    assert ids == sorted(ids) and len(set(ids)) == 4 and ids[0] >= 0 and ids[-1] < 30


# ----- a drafter that does not fit the target -----


def _meta_drafter(target: Target, **changes: Any) -> DFlashDrafter:
    cfg = config_for_target(target.config, num_layers=2, mask_token_id=0)
    for k, v in changes.items():
        setattr(cfg, k, v)
    with torch.device("meta"):
        return DFlashDrafter(cfg)


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"hidden_size": 512, "head_dim": 64}, r"hidden size: drafter 512, target 576"),
        ({"vocab_size": 151936}, r"vocabulary: drafter 151936, target 49152"),
        ({"target_layer_ids": [1, 35]}, r"target_layer_ids \[35\] beyond the target's 30 layers"),
        ({"mask_token_id": 151669}, r"mask_token_id 151669 outside the target's vocabulary of 49152"),
    ],
    ids=["hidden", "vocab", "layer", "mask"],
)
def test_mismatched_drafter_refused(target: Target, changes: dict[str, Any], pattern: str) -> None:
    with pytest.raises(DFlashError, match=r"does not fit this target: .*" + pattern):
        Engine(target, _meta_drafter(target, **changes))


def test_zlab_qwen3_drafter_refused_by_smollm(target: Target) -> None:
    with torch.device("meta"):
        drafter = DFlashDrafter(DFlashConfig.from_dict(ZLAB_QWEN3_8B))
    with pytest.raises(DFlashError) as info:
        Engine(target, drafter)
    msg = str(info.value)
    for want in ("drafter 4096, target 576", "drafter 151936, target 49152", "[33]", "30 layers"):
        assert want in msg, msg


def test_saved_drafter_runs_in_engine(target: Target, random_drafter: DFlashDrafter, tmp_path: Path) -> None:
    """A round trip through the checkpoint format drafts exactly the same tokens."""
    random_drafter.save(tmp_path, dtype=torch.float32)
    loaded = load_drafter(tmp_path)
    cfg = GenerationConfig(max_new_tokens=4, block_size=4, steps=2)
    prompt = "Name a colour."
    drafts = []
    for d in (random_drafter, loaded):
        events = list(Engine(target, d).generate(prompt, cfg))
        drafts.append([e.draft for e in events[:-1]])
    assert drafts[0] == drafts[1] and any(drafts[0])
    plain = finish(Engine(target, loaded).generate(prompt, cfg, plain=True))
    assert finish(Engine(target, loaded).generate(prompt, cfg)).token_ids == plain.token_ids
