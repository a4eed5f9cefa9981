"""The target cache of a hybrid model (Qwen3.5, Qwen3.6, Qwen3-Next): attention layers keep
preallocated keys/values (`cache.PreallocatedLayer`); linear-attention (Gated DeltaNet) layers
keep a recurrent state and a short-convolution window, which no length can roll back.

A pass that may be rolled back (a verify block) records every position's state as it goes:
transformers computes the last `recurrent_states_to_keep` tokens of a pass one at a time and
hands the cache each state, and keeps the convolution's whole input until a crop. Rolling back
to any accepted length is then picking one recorded state and slicing the window; no token is
run twice. Why this over re-running the accepted tokens from a snapshot: docs/decoding.md.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import cache_utils
from transformers.cache_utils import Cache

from .cache import PreallocatedLayer
from .errors import DFlashError

# Recording per-token states inside a verify pass arrived in transformers 5.25; before it a
# hybrid's pass yields only its final state, and no rollback could be exact.
RECORDS_STATES = hasattr(Cache, "get_recurrent_states_to_keep") and hasattr(cache_utils, "LinearAttentionLayer")
LinearAttentionLayer: Any = getattr(cache_utils, "LinearAttentionLayer", object)

# Layer kinds whose cache is keys/values by position: rollback moves a length. Sliding and chunked
# layers keep every key here (the model's own mask applies the window); "dummy" layers keep nothing;
# "indexed_attention" (DeepSeek-V3.2) keeps its indexer's keys by position too.
ATTENTION_KINDS = {"full_attention", "sliding_attention", "chunked_attention", "dummy", "indexed_attention"}
RECURRENT_KINDS = {"linear_attention"}
# Hybrid families whose linear layers are checked here to roll back exactly (tests/test_architectures.py).
HYBRID_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
SUPPORTED_TARGETS = ("supported: attention-only models (Llama, Qwen2/3, Qwen3-MoE, gpt-oss, Gemma, DeepSeek-V3/V3.2, "
                     "Kimi-K2.5, Muse Glimmer, ...) and the "
                     f"hybrid Qwen3.5 / Qwen3.6 / Qwen3-Next ({', '.join(HYBRID_TYPES)}); "
                     "see the README's Supported targets")


def layer_kinds(config: Any) -> list[str]:
    """Each decoder layer's cache kind ("full_attention", "linear_attention", ...), as transformers
    itself dispatches a `DynamicCache` for this config."""
    text = config.get_text_config(decoder=True)
    n = int(text.num_hidden_layers)
    if hasattr(cache_utils, "get_layer_types_and_kwargs"):
        kinds, _ = cache_utils.get_layer_types_and_kwargs(text)
    else:
        kinds = getattr(text, "layer_types", None) or ["full_attention"] * n
    return list(kinds[:n])


def unsupported_reason(config: Any) -> str | None:
    """Why DFlash Studio cannot roll back this target's cache, or None."""
    kinds = layer_kinds(config)
    odd = sorted(set(kinds) - ATTENTION_KINDS - RECURRENT_KINDS)
    model_type = getattr(config, "model_type", "?")
    if odd:
        return (f"model type {model_type!r} has {', '.join(odd)} layers, whose cache cannot be rolled back here; "
                f"{SUPPORTED_TARGETS}")
    if RECURRENT_KINDS & set(kinds) and model_type not in HYBRID_TYPES:
        return (f"model type {model_type!r} has linear-attention layers not checked here for exact rollback; "
                f"{SUPPORTED_TARGETS}")
    if RECURRENT_KINDS & set(kinds) and not RECORDS_STATES:
        return (f"model type {model_type!r} is a hybrid target, whose rollback needs transformers >= 5.25 "
                f"(pip install -U transformers)")
    return None


class RecurrentLayer(LinearAttentionLayer):
    """A linear-attention layer's states; `begin_pass` says whether the coming pass may be rolled back."""

    def begin_pass(self, tokens: int, record: bool) -> None:
        self._settle()
        self.record_past = record
        self.recurrent_states_to_keep = tokens if record else 0
        self.recurrent_states_history = {i: [] for i in range(self.number_of_states)}

    def _settle(self) -> None:
        # A recorded pass left the convolution's whole input and the states after each of its
        # tokens; the next pass needs only the last window and the current state.
        for i in range(self.number_of_states):
            conv = self.conv_states[i]
            k = self.conv_kernel_size[i]
            if conv is None or k is None or conv.shape[-1] == k:
                continue
            # A prompt shorter than the window leaves fewer columns: the missing ones are zeros.
            self.conv_states[i] = torch.nn.functional.pad(conv[..., -k:], (max(0, k - conv.shape[-1]), 0)).contiguous()

    def rollback(self, tokens: int) -> None:
        if tokens <= 0:
            return
        if not self.record_past:
            raise RuntimeError("a linear-attention layer rolled back after a pass that did not record its states")
        self.crop(-tokens)

    @property
    def length(self) -> int:
        return int(self.cumulative_length_linear)


class HybridTargetCache(Cache):
    """A transformers cache mixing `PreallocatedLayer`s and `RecurrentLayer`s, with the same
    `length` / `truncate` the engine uses on `TargetCache`."""

    def __init__(self, kinds: list[str], max_cache_len: int, max_rollback: int) -> None:
        layers: list[Any] = [RecurrentLayer() if k in RECURRENT_KINDS else PreallocatedLayer(max_cache_len)
                             for k in kinds]
        super().__init__(layers=layers)
        self.attention = [layer for layer in layers if isinstance(layer, PreallocatedLayer)]
        self.recurrent = [layer for layer in layers if isinstance(layer, RecurrentLayer)]
        if not self.attention:
            raise DFlashError("a target with no attention layer at all is not supported")
        self.max_rollback = max_rollback

    @classmethod
    def for_config(cls, config: Any, max_cache_len: int, max_rollback: int) -> HybridTargetCache:
        return cls(layer_kinds(config), max_cache_len, max_rollback)

    @property
    def max_cache_len(self) -> int:
        return self.attention[0].max_cache_len

    @property
    def length(self) -> int:
        return self.attention[0].length

    def begin_pass(self, tokens: int) -> None:
        """Before a forward of `tokens` tokens: passes no longer than a verify block record each
        position's state (they may be rolled back); a prompt's prefill does not."""
        record = tokens <= self.max_rollback
        for layer in self.recurrent:
            layer.begin_pass(tokens, record)

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions: the state after the accepted prefix."""
        for layer in self.attention:
            layer.length = min(layer.length, length)
        for layer in self.recurrent:
            layer.rollback(layer.length - length)

    def keep_rows(self, start: int, rows: list[int]) -> None:
        raise DFlashError("a hybrid target verifies chains only: its recurrent layers cannot check a tree")


def is_hybrid(config: Any) -> bool:
    return bool(RECURRENT_KINDS & set(layer_kinds(config)))


def recurrent_state_bytes(cache: HybridTargetCache) -> int:
    """Memory the recurrent layers hold now (states, recorded history and windows)."""
    total = 0
    for layer in cache.recurrent:
        for i in range(layer.number_of_states):
            for t in [layer.conv_states[i], layer.recurrent_states[i],
                      *getattr(layer, "recurrent_states_history", {}).get(i, [])]:
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    return total
