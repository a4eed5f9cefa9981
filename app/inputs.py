"""What visitors send, made safe before it reaches the engine.

The API accepts anything a client posts, not only what the sliders allow: gradio checks slider
ranges and radio choices itself, but NaN, infinities, an enormous seed or a lone UTF-16 surrogate
get through and would end in a traceback. Each becomes one clear message (a DFlashError) or, for
text, a harmless replacement character.
"""

from __future__ import annotations

import math
import re

from dflash_core.config import GenerationConfig
from dflash_core.errors import DFlashError

# A lone surrogate (invalid UTF-8 decoded with "surrogateescape", or a "\ud800" JSON escape) cannot be
# encoded as UTF-8, which the tokenizer needs; valid pairs were already joined by the JSON decoder.
_SURROGATE = re.compile("[\ud800-\udfff]")
MAX_SEED = 2**32 - 1


def clean_text(text: object) -> str:
    """The visitor's text with lone surrogates replaced by U+FFFD, as a UTF-8 decoder would show them."""
    return _SURROGATE.sub("\ufffd", "" if text is None else str(text))


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DFlashError(f"{name} must be a finite number, got {value!r}.")
    return float(value)


def _seed(value: object) -> int:
    seed = 0 if value is None else _number("seed", value)
    if seed != int(seed) or not 0 <= seed <= MAX_SEED:
        raise DFlashError(f"seed must be a whole number from 0 to {MAX_SEED}, got {value!r}.")
    return int(seed)


def generation_config(block_size: object, steps: object, temperature: object, top_p: object, max_new: object,
                      seed: object, verify: object = "auto", drafted: bool = True) -> GenerationConfig:
    """The UI's values as a validated config. `drafted`: False without a drafter (block size unused).

    GenerationConfig checks the ranges; this adds what arrives only through the API (NaN, ±inf,
    strings, a seed torch cannot take). Raises DFlashError with the parameter's name.
    """
    block = int(_number("block size", block_size))
    return GenerationConfig(
        max_new_tokens=int(_number("max new tokens", max_new)), block_size=block if drafted else None,
        steps=int(_number("denoising steps", steps)), temperature=_number("temperature", temperature),
        top_p=_number("top-p", top_p), seed=_seed(seed), verify=str(verify or "auto"),
    )
