"""Long chats: trimming on the real tokenizer, and a chat past a small context window through the app."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import serve_app

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no network calls from a test

import dflash_core
from app.history import Count, MessageTooLong, count_tokens, fit_history, reply_room
from app.session import Message
from dflash_core.engine import Engine
from dflash_core.targets import Target

SMALL_WINDOW = 160  # a few short turns fill it, so the e2e chat overflows after three replies
MAX_NEW = 4


def small_window(target: Target, window: int) -> Target:
    """The same model (shared weights) reporting a smaller context window.

    A shallow copy skips Target.__post_init__ (nothing is rebuilt); the subclass overrides only
    the `max_context` property, so the shared target everyone else uses is untouched.
    """
    small = copy.copy(target)
    small.__class__ = type("SmallWindowTarget", (type(target),), {"max_context": window})
    return small


def conversation(turns: int) -> list[Message]:
    """`turns` finished exchanges, then the newest user message."""
    msgs: list[Message] = []
    for i in range(turns):
        msgs.append({"role": "user", "content": f"Question {i}: what is {i} plus {i}? Answer briefly."})
        msgs.append({"role": "assistant", "content": f"{i} plus {i} is {2 * i}."})
    msgs.append({"role": "user", "content": "And what is the newest question?"})
    return msgs


@pytest.fixture(scope="module")
def count(target: Target) -> Count:
    return count_tokens(Engine(target))  # the chat template and tokenizer the app counts with


def test_a_chat_that_fits_is_sent_whole(count: Count) -> None:
    msgs = conversation(3)
    fitted = fit_history(msgs, count, window=8192, max_new_tokens=128)
    assert fitted.messages == msgs and fitted.dropped == 0 and fitted.note is None
    assert fitted.prompt_tokens == count(msgs) and fitted.room == 128


def test_oldest_turns_are_dropped_whole_and_the_newest_message_is_kept(count: Count) -> None:
    msgs = conversation(6)
    room = reply_room(4096, 16)
    # A window that holds exactly the last two exchanges and the newest message, plus the reply's room.
    window = count(msgs[-5:]) + room
    fitted = fit_history(msgs, count, window=window, max_new_tokens=16)
    assert fitted.dropped == 4
    assert fitted.messages == msgs[-5:]  # starts at a user message: whole exchanges only
    assert fitted.messages[-1] == msgs[-1]
    assert fitted.prompt_tokens + fitted.room <= window
    # One more turn would not have fitted: no turn is dropped needlessly.
    assert count(msgs[-7:]) + fitted.room > window
    note = fitted.note or ""
    assert "4 earliest turns were left out" in note and f"{window}-token context window" in note
    assert f"{fitted.room} kept for the reply" in note


def test_system_prompt_stays_and_turns_are_counted_with_few_tokenizer_calls(count: Count) -> None:
    msgs = [{"role": "system", "content": "You are terse."}, *conversation(40)]
    calls: list[int] = []

    def counting(m: list[Message]) -> int:
        calls.append(len(m))
        return count(m)

    window = count([msgs[0], *msgs[-3:]]) + reply_room(10_000, 8)
    fitted = fit_history(msgs, counting, window=window, max_new_tokens=8)
    assert fitted.messages == [msgs[0], *msgs[-3:]] and fitted.dropped == 39
    assert len(calls) <= 8  # binary search over 41 possible cuts, not one count per turn


def test_reply_room_is_the_reply_length_capped_at_a_quarter_of_the_window() -> None:
    assert reply_room(8192, 128) == 128
    assert reply_room(8192, 4096) == 2048
    assert reply_room(100, 1024) == 25


def test_a_single_message_over_the_window_is_a_clear_error(count: Count) -> None:
    huge = [{"role": "user", "content": "word " * 3000}]
    with pytest.raises(MessageTooLong) as err:
        fit_history(huge, count, window=2048, max_new_tokens=128)
    text = str(err.value)
    assert f"needs {count(huge)} tokens" in text and "context window is 2048 tokens" in text
    assert "128 are kept for the reply" in text and "Shorten it to about" in text
    # With earlier turns too: they are dropped, and the newest one still does not fit alone.
    with pytest.raises(MessageTooLong):
        fit_history([*conversation(2)[:-1], *huge], count, window=2048, max_new_tokens=128)


# ----- through the app -----

gradio_client = pytest.importorskip("gradio_client")


@pytest.fixture(scope="module")
def small_engine(app_engine: Engine) -> Engine:
    """The app's engine (same weights, same drafter) behind a SMALL_WINDOW-token context window."""
    engine = Engine(small_window(app_engine.target, SMALL_WINDOW), app_engine.drafter)
    assert engine.target.max_context == SMALL_WINDOW and app_engine.target.max_context > SMALL_WINDOW
    return engine


@pytest.fixture(scope="module")
def small_url(small_engine: Engine) -> Iterator[str]:
    with serve_app(small_engine) as url:
        yield url


def chat_args(prompt: str) -> tuple[Any, ...]:
    # textbox, block size, steps, temperature, top-p, max new tokens, seed, compare, verify length
    return (prompt, 4, 1, 0.0, 1.0, MAX_NEW, 0, False, "auto")


def text_of(message: dict[str, Any]) -> str:
    content = message["content"]
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


@pytest.mark.slow
def test_a_chat_longer_than_the_window_keeps_working_with_a_note(small_url: str, small_engine: Engine) -> None:
    client = gradio_client.Client(small_url, verbose=False, analytics_enabled=False, download_files=False)
    count = count_tokens(small_engine)
    noted = None
    for i in range(8):
        prompt = f"Question {i}: name one animal that lives in the sea, in two words."
        out = client.predict(*chat_args(prompt), api_name="/chat")
        chat, stats = out[1], out[-1]
        assert len(chat) == 2 * (i + 1), "every turn stays visible in the chat"
        sent = [{"role": m["role"], "content": text_of(m)} for m in chat[:-1]]
        fitted = fit_history(sent, count, SMALL_WINDOW, MAX_NEW)
        # What the model read is the trimmed chat: the reply is plain greedy decoding of exactly that.
        *_, fin = small_engine.generate(fitted.messages, dflash_core.GenerationConfig(max_new_tokens=MAX_NEW),
                                        plain=True)
        assert text_of(chat[-1]) == fin.text
        if fitted.dropped:
            assert f"{fitted.dropped} earliest turn" in stats and "left out" in stats, stats
            noted = i
            break
        assert "left out" not in stats
    assert noted is not None, "the chat never outgrew the small window"

    # A single message over the window: one clear message, the turn is not kept, and the app goes on.
    with pytest.raises(Exception, match="too long for the model") as err:
        client.predict(*chat_args("Please repeat: " + "sea otter " * 200), api_name="/chat")
    assert f"context window is {SMALL_WINDOW} tokens" in str(err.value)
    chat = client.predict(*chat_args("Thank you!"), api_name="/chat")[1]
    assert len(chat) == 2 * (noted + 2) and text_of(chat[-2]) == "Thank you!"
    assert text_of(chat[-1]).strip()
