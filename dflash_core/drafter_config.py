"""The drafter's shape and settings (`DFlashConfig`), as config.json holds them in the z-lab layout.

Checkpoints use the published z-lab layout, so vLLM and SGLang load ours and we load theirs.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import DFlashError
from .layers import ROPE_TYPES

_REQUIRED = object()  # `take`'s default: the field must be present
V1_FIELDS: dict[str, float | None] = {"output_multiplier": 1.0, "final_logit_softcapping": None,
                                      "input_embedding_scale": 1.0}
V2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_top_k", "selector_rank")
ARCHITECTURES = {1: "DFlashDraftModel", 2: "DFlash2DraftModel"}
# Fields a drafter's config.json may carry that change nothing here (transformers' bookkeeping,
# settings fixed in this architecture, or read elsewhere): anything else is named at load.
HARMLESS_FIELDS = frozenset({
    "architectures", "model_type", "attention_dropout", "hidden_act", "tie_word_embeddings", "use_cache",
    "dtype", "torch_dtype", "transformers_version", "initializer_range", "max_window_layers", "auto_map",
    "pad_token_id", "sliding_window", "_name_or_path", "mlp_bias", "num_target_layers", "layer_types",
    "use_sliding_window", "output_attentions", "output_hidden_states", "return_dict", "is_encoder_decoder",
    "chunk_size_feed_forward", "problem_type", "id2label", "label2id", "tokenizer_class", "task_specific_params",
    "quantization_config"})
FULL, SLIDING = "full_attention", "sliding_attention"
# RoPE parameters a scaled type reads (transformers' names); rope_theta is kept apart.
_ROPE_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
              "mscale", "mscale_all_dim", "truncate")


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
    # Per layer, "full_attention" or "sliding_attention" (None: all full). As in z-lab's reference
    # (and vLLM's and SGLang's DFlash drafters), a sliding layer's query at position q sees only
    # keys k with q - k < sliding_window, context and block alike, and is causal inside the block
    # unless `is_causal` says otherwise; a full layer sees every key and the whole block.
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    is_causal: bool | None = None  # the checkpoint's explicit causality, for every layer; None: as above
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear" | "yarn", ...}; None: plain RoPE
    # Applied as z-lab's package applies them: logits times the multiplier, then soft-capped;
    # the block's embeddings times the scale (1, None, 1: off).
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    # DFlash 2 (z-lab's DFlash2DraftModel; all None for DFlash 1): a grouped dynamic causal
    # convolution around each layer's attention and MLP, and a candidate selector that walks
    # the block choosing among each position's top-k logits (drafter.py).
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_top_k: int | None = None
    selector_rank: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # other fields, kept for round trips
    dflash_extra: dict[str, Any] = field(default_factory=dict)  # other dflash_config fields, likewise

    def __post_init__(self) -> None:
        if self.layer_types is None:
            self.layer_types = [FULL] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            raise DFlashError(f"drafter config.json: layer_types has {len(self.layer_types)} entries for "
                              f"{self.num_hidden_layers} layers")
        unknown = sorted({t for t in self.layer_types if t not in (FULL, SLIDING)})
        if unknown:
            raise DFlashError(f"drafter config.json: layer type(s) {unknown} are not supported (only {FULL!r} "
                              f"and {SLIDING!r})")
        if SLIDING in self.layer_types and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise DFlashError(f"drafter config.json: sliding_attention layers need a positive integer "
                              f"sliding_window, got {self.sliding_window!r}")
        if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
            self.final_logit_softcapping = None  # z-lab's reading of a non-positive cap: none
        v2 = [getattr(self, k) for k in V2_FIELDS]
        if any(v is not None for v in v2) and None in v2:
            missing = [k for k, v in zip(V2_FIELDS, v2, strict=True) if v is None]
            raise DFlashError(f"drafter config.json: a DFlash 2 drafter needs {', '.join(V2_FIELDS)}; "
                              f"{', '.join(missing)} missing")
        if self.version == 2 and (self.hidden_size % self.conv_group_size or min(*v2) < 1):
            raise DFlashError(f"drafter config.json: conv_group_size {self.conv_group_size} must divide "
                              f"hidden_size {self.hidden_size}, and the DFlash 2 sizes must be positive")

    @property
    def version(self) -> int:
        """1 for DFlash (DFlashDraftModel), 2 for DFlash 2 (DFlash2DraftModel)."""
        return 1 if self.conv_kernel_size is None else 2

    def ignored_fields(self) -> list[str]:
        """config.json fields this engine neither models nor knows to be harmless: named in a
        warning at load, since a drafter that relies on one would draft worse, silently."""
        top = [k for k in self.extra if k not in HARMLESS_FIELDS]
        inner = [f"dflash_config.{k}" for k in self.dflash_extra if k not in ("block_size", "causal")]
        return sorted(top) + sorted(inner)

    def layer_window(self, layer: int) -> int | None:
        """How far back a query of this layer sees (keys k with q - k < window); None: everything."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def layer_causal(self, layer: int) -> bool:
        """Whether the block's own positions see only earlier ones in this layer."""
        return self.layer_types[layer] == SLIDING if self.is_causal is None else self.is_causal

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
        # Newer z-lab configs (Qwen3.5 and later) put block_size in dflash_config; the reference
        # reads it there first, then at the top level.
        block = take("block_size", default=None, src=dflash)
        block = take("block_size", default=16) if block is None else block
        d.pop("block_size", None)
        rope_theta, rope_scaling = _rope(d)
        layer_types = d.pop("layer_types", None)
        if layer_types is not None and (not isinstance(layer_types, list)
                                        or not all(isinstance(t, str) for t in layer_types)):
            raise DFlashError(f"drafter config.json: layer_types must be a list of strings, got {layer_types!r}")
        window = d.pop("sliding_window", None)
        if not d.pop("use_sliding_window", layer_types is not None):
            window = None  # transformers' Qwen3Config, which the reference reads, drops it then too
        if layer_types is None and window is not None:  # Qwen3Config's layer_types when none are given
            first = take("max_window_layers", default=28)
            layer_types = [SLIDING if i >= first else FULL for i in range(n_layers)]
        if d.pop("attention_bias", False) or d.get("mlp_bias"):
            raise DFlashError("drafter config.json: attention or MLP biases are not supported "
                              "(z-lab drafters have none)")
        if d.get("hidden_act", "silu") != "silu":
            raise DFlashError(f"drafter config.json: hidden_act {d['hidden_act']!r} is not supported (only 'silu')")

        def value(key: str, cast: type, default: Any = None) -> Any:
            """z-lab's rule: dflash_config first, then the top level."""
            raw = dflash.pop(key) if key in dflash else d.pop(key, None)
            return default if raw is None else take(key, cast, src={key: raw})

        extras = {k: value(k, float, default) for k, default in V1_FIELDS.items()}
        v2 = {k: value(k, int) for k in V2_FIELDS}
        causal = d.pop("is_causal", None)
        causal = dflash.get("causal") if causal is None else causal  # vLLM's name for it
        if causal is not None and not isinstance(causal, bool):
            raise DFlashError(f"drafter config.json: is_causal must be true or false, got {causal!r}")
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
            block_size=block,
            rms_norm_eps=take("rms_norm_eps", float, default=1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=take("max_position_embeddings", default=40960),
            bos_token_id=d.pop("bos_token_id", None),
            eos_token_id=d.pop("eos_token_id", None),
            layer_types=layer_types,
            sliding_window=window if layer_types is not None and SLIDING in layer_types else None,
            is_causal=causal,
            rope_scaling=rope_scaling,
            **extras,
            **v2,
            extra=d,
            # Kept by name so to_dict writes them back (with this config's values for the two we model).
            dflash_extra={k: v for k, v in dflash.items() if k not in ("target_layer_ids", "mask_token_id")},
        )
        if window is not None and cfg.sliding_window is None:
            cfg.extra["sliding_window"] = window  # unused here (no sliding layer), kept for the round trip
        return cfg

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        extra, dflash = d.pop("extra"), d.pop("dflash_extra")
        # z-lab's package reads these in dflash_config first; written only where they change something.
        fields = {k: d.pop(k) for k in (*V1_FIELDS, *V2_FIELDS)}
        dflash.update({k: v for k, v in fields.items() if v is not None and v != V1_FIELDS.get(k)})
        ids, mask = d.pop("target_layer_ids"), d.pop("mask_token_id")
        if d["is_causal"] is None:
            d.pop("is_causal")
        sliding = SLIDING in self.layer_types
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.version]],
            "model_type": "qwen3",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "use_cache": True,
            "dtype": "bfloat16",
            "max_window_layers": self.num_hidden_layers,
        }
        out.update(extra)
        out.update(d)
        out["architectures"] = [ARCHITECTURES[self.version]]
        # transformers' Qwen3Config drops sliding_window unless use_sliding_window is set, and
        # z-lab's reference reads the window from that config.
        out["use_sliding_window"] = sliding
        if not sliding:
            out["sliding_window"] = extra.get("sliding_window")
        if "block_size" in dflash:
            dflash["block_size"] = self.block_size
        dflash.pop("causal", None)
        if self.is_causal is not None:
            dflash["causal"] = self.is_causal  # vLLM releases that read only this name
        out["dflash_config"] = {**dflash, "target_layer_ids": ids, "mask_token_id": mask}
        return out


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and the scaling parameters (None for plain RoPE), taken out of `d`. Published
    z-lab configs carry a top-level rope_theta and rope_scaling; transformers 5 writes one
    rope_parameters dict, which rope_scaling replaces when both are given (as transformers reads them)."""
    params, scaling = d.pop("rope_parameters", None) or {}, d.pop("rope_scaling", None) or {}
    theta = d.pop("rope_theta", None)
    partial = d.pop("partial_rotary_factor", None)
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise DFlashError("drafter config.json: rope_parameters and rope_scaling must be objects")
    rope = scaling or params
    if any(isinstance(v, dict) for v in rope.values()):
        raise DFlashError(f"drafter config.json: per-layer-type RoPE parameters ({sorted(rope)}) are not supported")
    theta = theta or rope.get("rope_theta") or params.get("rope_theta") or 1_000_000.0
    partial = rope.get("partial_rotary_factor", partial)
    if partial not in (None, 1, 1.0):
        raise DFlashError(f"drafter uses partial rotary embeddings (partial_rotary_factor {partial}); only "
                          "full-width RoPE is supported")
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise DFlashError(f"drafter uses RoPE scaling {kind!r}; supported: {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return float(theta), None
    kept = {k: rope[k] for k in _ROPE_KEYS if rope.get(k) is not None}
    numbers = [k for k in _ROPE_KEYS[:-1] if k in kept and (isinstance(kept[k], bool)
                                                           or not isinstance(kept[k], (int, float)) or kept[k] <= 0)]
    if numbers or "factor" not in kept:
        raise DFlashError(f"drafter config.json: RoPE scaling {kind!r} needs a positive factor (and positive "
                          f"numbers for its other parameters); got {rope}")
    return float(theta), {"rope_type": kind, **kept}


# transformers-native DFlash assistants (their own layout: `encoder.fc`, `encoder.output_norm_enc`).
ASSISTANT_TYPES = ("muse_glimmer_assistant",)
_ASSISTANT_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "max_position_embeddings",
                   "layer_types", "bos_token_id", "eos_token_id")


def zlab_from_assistant(full: dict[str, Any], vocab_size: int, num_target_layers: int) -> dict[str, Any]:
    """A transformers-native assistant's config (every field, as its config class fills them in) in
    the z-lab shape `DFlashConfig.from_dict` reads. Its layers attend bidirectionally, a sliding one
    to keys at most `sliding_window` positions away (transformers' rule; z-lab's is "fewer than",
    hence + 1). It names neither the vocabulary nor the target's depth: the target's are taken."""
    d = {k: full[k] for k in _ASSISTANT_KEYS if k in full}
    window = full.get("sliding_window")
    return {**d, "architectures": ["DFlashDraftModel"], "vocab_size": vocab_size,
            "num_target_layers": num_target_layers, "is_causal": False, "use_sliding_window": window is not None,
            "sliding_window": None if window is None else int(window) + 1,
            "dflash_config": {"block_size": full.get("block_size", 16), "mask_token_id": full["mask_token_id"],
                              "target_layer_ids": full["target_layer_ids"]}}


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
    if hasattr(target_config, "get_text_config"):  # a vision-language checkpoint's text side (Qwen3.5)
        target_config = copy.deepcopy(target_config.get_text_config())
        # Gemma 4 sizes heads per layer and refuses a global read: any layer's values shape a drafter.
        target_config.allow_global_per_layer_attribute_access = True
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
