"""The drafter's shape and settings (`DFlashConfig`), as config.json holds them in the z-lab layout.

Checkpoints use the published z-lab layout, so vLLM and SGLang load ours and we load theirs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import DFlashError

_REQUIRED = object()  # `take`'s default: the field must be present


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Layers spread from shallow to deep, as in the reference (`round(1 + i*(L-4)/(n-1))`)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    """The drafter's shape and the target layers it reads; `from_dict`/`to_dict` are config.json."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # other fields, kept for round trips

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DFlashConfig:
        d = dict(d)
        dflash = d.pop("dflash_config", None) or {}
        if not isinstance(dflash, dict):
            raise DFlashError("drafter config.json: dflash_config must be an object")

        def take(key: str, cast: type = int, default: Any = _REQUIRED, src: dict[str, Any] = d) -> Any:
            if key not in src and default is _REQUIRED:
                raise DFlashError(f"drafter config.json lacks the field {key!r}")
            value = src.pop(key, default) if src is d else src.get(key, default)
            if value is None and default is not _REQUIRED:
                return default
            try:
                return cast(value)
            except (TypeError, ValueError):
                raise DFlashError(f"drafter config.json: {key} = {value!r} is not a valid {cast.__name__}") from None

        n_layers, n_target = take("num_hidden_layers"), take("num_target_layers")
        hidden, heads = take("hidden_size"), take("num_attention_heads")
        if min(n_layers, n_target, hidden, heads) < 1:
            raise DFlashError("drafter config.json: layer counts, hidden size and heads must be positive")
        ids = dflash.get("target_layer_ids") or default_target_layer_ids(n_target, n_layers)
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise DFlashError(f"drafter config.json: target_layer_ids must be a list of integers, got {ids!r}")
        cfg = cls(
            hidden_size=hidden,
            intermediate_size=take("intermediate_size"),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=take("num_key_value_heads", default=heads),
            head_dim=take("head_dim", default=hidden // heads),
            vocab_size=take("vocab_size"),
            num_target_layers=n_target,
            target_layer_ids=list(ids),
            mask_token_id=take("mask_token_id", src=dflash),
            block_size=take("block_size", default=16),
            rms_norm_eps=take("rms_norm_eps", float, default=1e-6),
            rope_theta=float(_rope_theta(d)),
            max_position_embeddings=take("max_position_embeddings", default=40960),
            bos_token_id=d.pop("bos_token_id", None),
            eos_token_id=d.pop("eos_token_id", None),
        )
        d.pop("rope_theta", None)
        d.pop("rope_parameters", None)
        cfg.extra = d
        return cfg

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        ids, mask = d.pop("target_layer_ids"), d.pop("mask_token_id")
        out: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "use_cache": True,
            "rope_scaling": None,
            "dtype": "bfloat16",
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "max_window_layers": self.num_hidden_layers,
            "use_sliding_window": False,
            "sliding_window": None,
        }
        out.update(extra)
        out.update(d)
        out["dflash_config"] = {"target_layer_ids": ids, "mask_token_id": mask}
        return out


def _rope_theta(d: dict[str, Any]) -> float:
    # Published z-lab configs carry a top-level rope_theta; transformers 5 writes rope_parameters.
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or params
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise DFlashError(f"drafter uses RoPE scaling {kind!r}; only the default RoPE is supported")
    return d.get("rope_theta") or params.get("rope_theta") or 1_000_000.0


def check_fit(cfg: DFlashConfig, *, hidden_size: int, vocab_size: int, num_layers: int) -> None:
    """Refuse a drafter built for another target, naming both values."""
    problems = []
    if cfg.hidden_size != hidden_size:
        problems.append(f"hidden size: drafter {cfg.hidden_size}, target {hidden_size}")
    if cfg.vocab_size != vocab_size:
        problems.append(f"vocabulary: drafter {cfg.vocab_size}, target {vocab_size}")
    if cfg.num_target_layers != num_layers:
        problems.append(f"target depth: drafter trained for {cfg.num_target_layers} layers, target has {num_layers}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} beyond the target's {num_layers} layers")
    if not 0 <= cfg.mask_token_id < vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} outside the target's vocabulary of {vocab_size}")
    if problems:
        raise DFlashError("drafter does not fit this target: " + "; ".join(problems))


def config_for_target(target_config: Any, *, num_layers: int = 2, block_size: int = 16,
                      mask_token_id: int, intermediate_size: int | None = None) -> DFlashConfig:
    """A drafter shaped like the target's own layers (the usual choice), from its HF config."""
    heads = int(target_config.num_attention_heads)
    hidden = int(target_config.hidden_size)
    n_target = int(target_config.num_hidden_layers)
    rope = getattr(target_config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") or getattr(target_config, "rope_theta", None) or 10_000.0
    return DFlashConfig(
        hidden_size=hidden,
        intermediate_size=intermediate_size or int(target_config.intermediate_size),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(target_config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(target_config, "head_dim", None) or hidden // heads),
        vocab_size=int(target_config.vocab_size),
        num_target_layers=n_target,
        target_layer_ids=default_target_layer_ids(n_target, num_layers),
        mask_token_id=mask_token_id,
        block_size=block_size,
        rms_norm_eps=float(getattr(target_config, "rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=int(getattr(target_config, "max_position_embeddings", 8192)),
        bos_token_id=getattr(target_config, "bos_token_id", None),
        eos_token_id=getattr(target_config, "eos_token_id", None),
    )
