"""Hostile input without a model: text cleaning, API parameter checks, and what the token view shows."""

from __future__ import annotations

import html
import re

import pytest

from app.inputs import MAX_SEED, clean_text, generation_config
from app.render import render_view, visible
from app.teach import shown
from dflash_core.errors import DFlashError
from dflash_core.events import BlockEvent

NASTY_TOKENS = ["<script>alert(1)</script>", '<img src=x onerror="alert(2)">', "\x1b[31m", "\u202e", "\x00", "&amp;"]


def test_lone_surrogates_become_replacement_characters_and_the_rest_is_kept() -> None:
    raw = b"ok \xff then \xed\xa0\x80".decode("utf-8", "surrogateescape")  # invalid UTF-8 as lone surrogates
    assert clean_text(raw) == "ok \ufffd then \ufffd\ufffd\ufffd"
    assert clean_text("a\ud800b") == "a\ufffdb"
    kept = "👋🏽 שלום <b>\x00\x1b[31m"
    assert clean_text(kept) == kept and clean_text(None) == "" and clean_text(12) == "12"
    clean_text(raw).encode("utf-8")  # the tokenizer needs UTF-8


def test_control_and_bidi_characters_are_shown_as_symbols() -> None:
    assert visible("a\x00b\x1b[0m\x07") == "a␀b␛[0m␇"
    assert visible("x\u202ey\u2066z") == "x[U+202E]y[U+2066]z"
    assert visible("line\n\ttab 👨‍👩‍👧 مرحبا") == "line\n\ttab 👨‍👩‍👧 مرحبا"  # ZWJ emoji and RTL letters untouched
    assert shown("\u202e ") == "[U+202E]·"


def test_hostile_token_strings_are_escaped_in_text_and_titles() -> None:
    n = len(NASTY_TOKENS)
    ev = BlockEvent(index=1, start=10, steps=[], draft=list(range(n)), accepted=2, target_token=9,
                    committed=[0, 1, 9], draft_ms=1.0, verify_ms=2.0, tokens_so_far=3, text="",
                    committed_text=[*NASTY_TOKENS[:2], "\u202e"], draft_text=NASTY_TOKENS)
    markup = render_view([ev])
    for raw in ("<script", "<img", "\x1b", "\u202e", "\x00"):
        assert raw not in markup
    assert html.escape(NASTY_TOKENS[0], quote=True) in markup
    assert "&amp;amp;" in markup  # an entity in a token is shown as text, not decoded


@pytest.mark.parametrize(("args", "message"), [
    ((4, 1, float("nan"), 1.0, 16, 0), "temperature must be a finite number"),
    ((4, 1, 0.0, float("inf"), 16, 0), "top-p must be a finite number"),
    (("four", 1, 0.0, 1.0, 16, 0), "block size must be a finite number"),
    ((None, 1, 0.0, 1.0, 16, 0), "block size must be a finite number"),
    ((4, 1, 0.0, 1.0, 16, 1e30), "seed must be a whole number"),
    ((4, 1, 0.0, 1.0, 16, -1), "seed must be a whole number"),
    ((4, 1, 0.0, 1.0, 16, 0.5), "seed must be a whole number"),
    ((99, 1, 0.0, 1.0, 16, 0), "block_size must be an integer from 2 to 32"),
    ((4, 0, 0.0, 1.0, 16, 0), "steps"),
    ((4, 1, 0.0, 0.0, 16, 0), "top_p must be in (0, 1]"),
])
def test_parameters_outside_the_sliders_are_one_clear_error(args: tuple[object, ...], message: str) -> None:
    with pytest.raises(DFlashError, match=re.escape(message)):
        generation_config(*args)


def test_parameters_within_range_make_a_config() -> None:
    cfg = generation_config(4.0, 1, 0.7, 0.9, 32.0, MAX_SEED, "full")
    assert (cfg.block_size, cfg.steps, cfg.temperature, cfg.top_p, cfg.max_new_tokens, cfg.seed, cfg.verify) == (
        4, 1, 0.7, 0.9, 32, MAX_SEED, "full")
    assert generation_config(4, 1, 0, 1, 8, None, None, drafted=False).block_size is None
