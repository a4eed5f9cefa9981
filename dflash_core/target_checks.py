"""Which targets this engine refuses, each in one line that names the model type and what is
supported: from the config before any weight loads, and by a short decoding probe after."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .errors import DFlashError
from .hybrid_cache import SUPPORTED_TARGETS
from .hybrid_cache import unsupported_reason as cache_unsupported_reason
from .text_side import TEXT_SIDES

if TYPE_CHECKING:
    from .targets import Target

# The probe's prompt length, and the relative logit gap it allows between a continued and a whole
# pass: rounding in bf16 stays well under it, a forgotten context is far over it.
PROBE_TOKENS = 8
PROBE_TOLERANCE = 0.05
# What a model's forward raises on shapes or a cache it cannot use.
FORWARD_ERRORS = (ValueError, TypeError, AttributeError, RuntimeError, NotImplementedError, IndexError)


def read_config(path: str) -> Any | None:
    """The target's transformers config, read before its weights; None where it cannot be read."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError):
        return None


def config_refusal(config: Any, spec: str) -> str | None:
    """Why a target is refused from its config alone (None: load it): a cache this engine cannot
    roll back, or no text-generating class in transformers."""
    from transformers import __version__
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if (reason := cache_unsupported_reason(config)) is not None:
        return f"target {spec!r}: {reason}"
    kind = getattr(config, "model_type", None)
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and kind not in TEXT_SIDES:
        return (f"target {spec!r}: model type {kind!r} has no text-generating (causal LM) model in transformers "
                f"{__version__}; {SUPPORTED_TARGETS}")
    return None


def probe_decoding(target: Target, spec: str) -> None:
    """A short pass continued through the engine's own cache, and rolled back, must give the
    logits of one pass over the same tokens: a model that keeps a state its config does not
    declare (so this cache does not hold it) is refused here, once, instead of failing or
    decoding wrongly in the middle of a reply. What a failing forward raised is not shown (a
    tensor error means nothing to the user); whether transformers' own forward fails too is."""
    ids = (torch.arange(PROBE_TOKENS, device=target.device)[None] * 7919 + 11) % target.vocab_size
    kind = getattr(target.config, "model_type", "?")
    try:
        whole, _ = target.forward(ids, target.new_cache(2 * PROBE_TOKENS))
        cache = target.new_cache(2 * PROBE_TOKENS, rollback=2)
        target.forward(ids[:, :-2], cache)
        target.forward(ids[:, -2:].flip(1), cache)  # two tokens, then rolled back
        cache.truncate(PROBE_TOKENS - 2)
        steps, _ = target.forward(ids[:, -2:], cache)
    except FORWARD_ERRORS as e:
        if not runs_alone(target, ids):
            raise DFlashError(f"target {spec!r} (model type {kind!r}) does not run in transformers' own forward "
                              f"either ({type(e).__name__}): its config.json describes a model this transformers "
                              f"cannot run (inconsistent head sizes?); {SUPPORTED_TARGETS}") from None
        raise DFlashError(f"target {spec!r} (model type {kind!r}) cannot be decoded with this engine's cache "
                          f"(its layers ask the cache for something it does not keep); {SUPPORTED_TARGETS}") from None
    gap = float((steps - whole[-2:]).abs().max() / whole[-2:].abs().max().clamp_min(1e-6))
    if gap > PROBE_TOLERANCE:
        raise DFlashError(f"target {spec!r} (model type {kind!r}) keeps a state this engine's cache does not "
                          f"hold: continuing from the cache changes its logits by {gap:.0%}; {SUPPORTED_TARGETS}")


def runs_alone(target: Target, ids: torch.Tensor) -> bool:
    """Whether transformers' own forward runs the target on `ids` (one pass, no cache at all)."""
    try:
        with torch.inference_mode():
            target.model(input_ids=ids, use_cache=False)
    except FORWARD_ERRORS:
        return False
    return True
