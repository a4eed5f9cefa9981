"""The real app, served on a free port, driven over HTTP by gradio_client.

One engine (the embedded SmolLM2 target with the shipped drafter) and one server
serve every test here; replies stay short so the file runs in a few minutes on two cores.
"""

from __future__ import annotations

import html
import json
import os
import re
import time
from collections.abc import Iterator
from html.parser import HTMLParser
from typing import Any

import pytest
from conftest import serve_app

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no network calls from a test

import dflash_core
from dflash_core.engine import Engine
from dflash_core.events import Finished

gradio_client = pytest.importorskip("gradio_client")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow

PROMPT = "Write a Python function that adds two numbers."
BLOCK = 4  # small blocks keep each verify forward cheap on CPU
MAX_NEW = 10


@pytest.fixture(scope="module")
def engine(app_engine: Engine) -> Engine:
    return app_engine


@pytest.fixture(scope="module")
def url(engine: Engine) -> Iterator[str]:
    with serve_app(engine) as url:
        yield url


@pytest.fixture()
def client(url: str) -> Any:
    # A fresh client is a fresh session hash, hence a fresh per-visitor Session.
    return gradio_client.Client(url, verbose=False, analytics_enabled=False, download_files=False)


def chat_args(prompt: str, max_new: int = MAX_NEW, compare: bool = False, temperature: float = 0.0) -> tuple[Any, ...]:
    # textbox, block size, steps, temperature, top-p, max new tokens, seed, race plain decoding, verify length
    return (prompt, BLOCK, 1, temperature, 1.0, max_new, 0, compare, "auto")


def message_text(message: dict[str, Any]) -> str:
    """Chatbot content comes back as a string or as a list of {"type": "text", "text": ...}."""
    content = message["content"]
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def figure(payload: Any) -> dict[str, Any]:
    """A gr.Plot payload: {"type": "plotly", "plot": "<figure JSON>"}; returns the parsed figure."""
    assert isinstance(payload, dict), payload
    assert payload["type"] == "plotly"
    fig = json.loads(payload["plot"])
    assert {"data", "layout"} <= set(fig)
    return fig


RACE_PANE = re.compile(r'data-side="(\w+)"><div class="race-head">(.*?)</div><div class="race-text">(.*?)</div>', re.S)


def race_panes(race: str) -> dict[str, tuple[str, str]]:
    """The race view's panes: side → (heading, text as shown)."""
    return {side: (html.unescape(head), html.unescape(text)) for side, head, text in RACE_PANE.findall(race)}


def plain_greedy(engine: Engine, prompt: str, max_new: int) -> Finished:
    cfg = dflash_core.GenerationConfig(max_new_tokens=max_new, block_size=BLOCK)
    *_, fin = engine.generate(prompt, cfg, plain=True)
    assert isinstance(fin, Finished)
    return fin


def test_streamed_reply_equals_plain_greedy_decoding(client: Any, engine: Engine) -> None:
    job = client.submit(*chat_args(PROMPT, compare=True), api_name="/chat")
    final = job.result(timeout=600)
    updates = job.outputs()
    # The prefill update, one per block of either racing run: far more than one streamed update.
    assert len(updates) > 2
    _, chat, spec, heat, acc, position, speed, tree, race, stats = final
    # The first update empties the textbox; later ones leave it alone (the visitor may be typing).
    assert updates[0][0] == ""
    assert all(u[0] != "" for u in updates[1:])

    expected = plain_greedy(engine, PROMPT, MAX_NEW)
    assert [m["role"] for m in chat] == ["user", "assistant"]
    assert message_text(chat[0]) == PROMPT
    assert message_text(chat[-1]) == expected.text
    assert expected.text.strip(), "the reference reply is empty, so the comparison proves nothing"

    # The reply grew over the stream (not one final dump).
    lengths = [len(message_text(u[1][-1])) for u in updates if len(u[1]) == 2]
    assert lengths[0] < lengths[-1]

    assert 'class="tok tok-target' in spec and "spec-tokens" in spec
    heat_fig, acc_fig, speed_fig = figure(heat), figure(acc), figure(speed)
    assert heat_fig["data"][0]["type"] == "heatmap"
    assert len(heat_fig["data"][0]["z"][0]) == BLOCK - 1  # one column per drafted position
    # bars: accepted, target token; lines: block size, running tau (and "verified" when the adaptive
    # verify length checked fewer drafts than were drafted)
    assert [t["type"] for t in acc_fig["data"]][:4] == ["bar", "bar", "scatter", "scatter"]
    assert [t["name"] for t in speed_fig["data"]] == ["DFlash", "plain"]
    assert speed_fig["data"][0]["y"][-1] >= MAX_NEW  # every committed token is on the curve
    assert "speed-up" in speed_fig["layout"]["title"]["text"]
    assert "plain output identical ✓" in stats and "finished: length" in stats
    # The race: both panes hold the whole reply, the same text at T=0, and the finish line says so.
    panes = race_panes(race)
    assert panes["dflash"][1] == panes["plain"][1] == expected.text
    assert "finished" in panes["dflash"][0] and "finished" in panes["plain"][0]
    assert "texts identical ✓" in race and "the speed of plain decoding" in race and "own engine clock" in race
    # Live: the plain pane and the speed chart's plain line grew while the reply streamed, not after it.
    partial = [u for u in updates[:-1] if 0 < len(race_panes(u[8]).get("plain", ("", ""))[1]) < len(expected.text)]
    assert partial, "the plain pane never showed a partial reply"
    assert any([t["name"] for t in figure(u[6])["data"]] == ["DFlash", "plain"] for u in partial)
    # Acceptance by position: one bar per draft position; 1 + their sum is the reply's τ (the stats line's).
    bars = figure(position)["data"][0]
    assert bars["type"] == "bar" and bars["x"][0] == 1 and len(bars["x"]) == BLOCK - 1
    tau = float(re.search(r"τ (\d+\.\d+)", stats).group(1))
    assert 1 + sum(bars["y"]) == pytest.approx(tau, abs=0.006)
    # The tree picture shows the latest draft block, its committed path ending in the target's own token.
    tree_fig = figure(tree)
    assert tree_fig["layout"]["title"]["text"].startswith("Block ")
    assert any(t.get("name") == "the target's own token" and t.get("x") for t in tree_fig["data"])


def test_stop_halts_a_reply_and_the_next_one_completes(client: Any, engine: Engine) -> None:
    long_run = 200
    job = client.submit(*chat_args("Tell me a long story about a dragon.", max_new=long_run), api_name="/chat")
    deadline = time.monotonic() + 300
    # Wait until blocks are streaming (prefill update + at least one block update), then stop.
    while len(job.outputs()) < 3 and not job.done():
        assert time.monotonic() < deadline, "no streamed updates arrived"
        time.sleep(0.2)
    assert not job.done(), "the long reply finished before it could be stopped"
    client.predict(api_name="/stop")
    final = job.result(timeout=300)
    chat, stats = final[1], final[-1]
    assert "finished: cancelled" in stats
    stopped_reply = message_text(chat[-1])
    # Far short of the requested length: cancelled within a block or so, not run to the end.
    assert len(engine.target.tokenizer(stopped_reply)["input_ids"]) < long_run // 2

    # The same visitor asks again: this reply runs to its end, after the kept partial turn.
    final = client.predict(*chat_args(PROMPT), api_name="/chat")
    chat, stats = final[1], final[-1]
    assert [m["role"] for m in chat] == ["user", "assistant", "user", "assistant"]
    assert message_text(chat[-2]) == PROMPT
    assert "finished: length" in stats
    # The history went back to the model: the second reply continues the conversation, and it
    # still matches plain greedy decoding of that very conversation.
    messages = [{"role": m["role"], "content": message_text(m)} for m in chat[:-1]]
    cfg = dflash_core.GenerationConfig(max_new_tokens=MAX_NEW, block_size=BLOCK)
    *_, fin = engine.generate(messages, cfg, plain=True)
    assert message_text(chat[-1]) == fin.text
    reply = message_text(chat[-1])

    # Regenerate replaces the last reply (here with fewer tokens: greedy, so a strict prefix of
    # the old one); Clear empties everything.
    final = client.predict(*chat_args(PROMPT, max_new=4)[1:], api_name="/regenerate")
    chat = final[0]
    assert [m["role"] for m in chat] == ["user", "assistant", "user", "assistant"]
    short = message_text(chat[-1])
    assert short != reply and reply.startswith(short)
    final = client.predict(api_name="/clear")
    assert final[0] == [] and "spec-tokens" not in final[1]


def test_a_stopped_race_keeps_one_clean_turn_and_sampling_explains_a_difference(client: Any) -> None:
    job = client.submit(*chat_args("Tell me a long story about a dragon.", max_new=200, compare=True),
                        api_name="/chat")
    deadline = time.monotonic() + 300
    while not any(race_panes(u[8]).get("plain", ("", ""))[1] for u in job.outputs()) and not job.done():
        assert time.monotonic() < deadline, "the plain pane never started"
        time.sleep(0.2)
    assert not job.done(), "the race finished before it could be stopped"
    client.predict(api_name="/stop")
    final = job.result(timeout=300)
    chat, race, stats = final[1], final[8], final[-1]
    assert "finished: cancelled" in stats and "Race stopped" in race  # one Stop stopped both runs
    panes = race_panes(race)
    assert "stopped" in panes["dflash"][0] and "stopped" in panes["plain"][0]
    assert [m["role"] for m in chat] == ["user", "assistant"]  # one turn, the DFlash reply kept
    assert message_text(chat[-1]) == panes["dflash"][1]

    # Sampling: both runs draw from the same distribution, not the same sample; the finish line says why.
    final = client.predict(*chat_args(PROMPT, max_new=6, compare=True, temperature=0.9), api_name="/chat")
    chat, race = final[1], final[8]
    assert [m["role"] for m in chat] == ["user", "assistant", "user", "assistant"]
    panes = race_panes(race)
    # Gradio's chatbot drops a reply's trailing whitespace (a sampled reply may end in a newline).
    assert panes["dflash"][1].rstrip() == message_text(chat[-1]).rstrip() and panes["plain"][1].strip()
    assert ("as sampling allows" in race) != (panes["dflash"][1] == panes["plain"][1])


def test_two_visitors_are_served_one_at_a_time_without_mixing(url: str, engine: Engine) -> None:
    prompts = ["What is 2 + 2?", "Name a colour."]
    clients = [gradio_client.Client(url, verbose=False, analytics_enabled=False, download_files=False)
               for _ in prompts]
    jobs = [c.submit(*chat_args(p, max_new=6), api_name="/chat") for c, p in zip(clients, prompts, strict=True)]
    for job, prompt in zip(jobs, prompts, strict=True):
        chat = job.result(timeout=300)[1]
        # Each visitor sees only their own turn, and the reply the model gives to it alone.
        assert [message_text(m) for m in chat[:-1]] == [prompt]
        assert message_text(chat[-1]) == plain_greedy(engine, prompt, 6).text


def test_stop_pressed_while_waiting_in_the_queue_stops_that_reply(url: str, engine: Engine) -> None:
    first, second = (gradio_client.Client(url, verbose=False, analytics_enabled=False, download_files=False)
                     for _ in range(2))
    busy = first.submit(*chat_args("Tell me a long story about a dragon.", max_new=120), api_name="/chat")
    deadline = time.monotonic() + 300
    while len(busy.outputs()) < 2 and not busy.done():  # the engine is busy with the first visitor
        assert time.monotonic() < deadline
        time.sleep(0.1)
    waiting = second.submit(*chat_args(PROMPT, max_new=40), api_name="/chat")
    while waiting.status().code.name not in ("IN_QUEUE", "PROCESSING", "ITERATING", "FINISHED"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not busy.done(), "the first reply ended before the second visitor could wait behind it"
    second.predict(api_name="/stop")
    chat, stats = (lambda r: (r[1], r[-1]))(waiting.result(timeout=300))
    assert "finished: cancelled" in stats
    assert len(engine.target.tokenizer(message_text(chat[-1]))["input_ids"]) <= 2  # stopped at once
    assert "finished: length" in busy.result(timeout=300)[-1]  # the other visitor was not touched
    # The Stop was used up: the same visitor's next message runs in full.
    chat, stats = (lambda r: (r[1], r[-1]))(second.predict(*chat_args(PROMPT), api_name="/chat"))
    assert "finished: cancelled" not in stats
    messages = [{"role": m["role"], "content": message_text(m)} for m in chat[:-1]]
    *_, fin = engine.generate(messages, dflash_core.GenerationConfig(max_new_tokens=MAX_NEW), plain=True)
    assert message_text(chat[-1]) == fin.text


def test_stop_while_idle_does_not_cancel_the_next_reply(client: Any, engine: Engine) -> None:
    client.predict(api_name="/stop")
    final = client.predict(*chat_args(PROMPT), api_name="/chat")
    assert "finished: length" in final[-1] and message_text(final[1][-1]) == plain_greedy(engine, PROMPT, MAX_NEW).text


def test_next_block_steps_one_block_per_click_to_the_plain_greedy_reply(client: Any, engine: Engine) -> None:
    max_new = 6
    nothing = client.predict("", *chat_args("")[1:], api_name="/next_block")
    assert "Type a prompt" in nothing[9]  # no prompt and nothing suspended: a hint, no engine work

    first = client.predict(*chat_args(PROMPT, max_new=max_new), api_name="/next_block")
    textbox, chat, _spec, heat, acc, _position, _speed, tree, _race, stats, panel, how = first
    assert figure(tree)["layout"]["title"]["text"].startswith("Block 1 ")  # the stepped block's candidates
    assert figure(acc)["data"][0]["type"] == "bar"
    assert textbox == ""  # the prompt was taken; the next clicks continue its reply
    assert message_text(chat[0]) == PROMPT and chat[-1]["role"] == "assistant"
    assert "step mode: block 1 done" in stats
    assert "✓ accepted" in panel or "✗ rejected" in panel  # the target's verdict per drafted position
    assert "for one target forward" in panel
    assert "Your last reply" in how and "block 1" in how
    assert figure(heat)["data"][0]["type"] == "heatmap"

    clicks, out = 1, first
    while "finished" not in out[9]:
        out = client.predict("", *chat_args("")[1:], api_name="/next_block")
        clicks += 1
        assert clicks <= max_new + 1, "step mode does not finish"
    chat, spec, stats, panel = out[1], out[2], out[9], out[10]
    assert "Finished (length)" in panel and "finished: length" in stats
    # Greedy: the stepped reply is plain greedy decoding, token for token (here: its text).
    assert message_text(chat[-1]) == plain_greedy(engine, PROMPT, max_new).text
    assert [m["role"] for m in chat] == ["user", "assistant"]
    assert spec.count('class="blk ') >= clicks  # every block (and the prefill) is in the view
    # Finished: the next empty click starts nothing.
    out = client.predict("", *chat_args("")[1:], api_name="/next_block")
    assert "Type a prompt" in out[9] and len(out[1]) == 2


# ----- hostile input: each prompt gets a reply or one clear message, and the app keeps serving -----

HOSTILE = {
    "html and js": 'Repeat exactly: <script>alert(1)</script> <img src=x onerror="alert(2)"> &amp; "quotes"',
    "control characters": "Say hi\x00 to \x1b[31mred\x1b[0m text \u202eevil\u202c and a bell\x07.",
    "invalid utf-8 as text": b"caf\xc3\xa9 \xff\xfe broken \xed\xa0\x80 bytes".decode("utf-8", "replace"),
    "emoji and rtl": "👋🏽 שלום! مرحبا 👨‍👩‍👧 — say hello back.",
}
SPEC_TAGS = {"div", "span", "b"}  # all the Speculation view itself writes
SPEC_ATTRS = {"class", "title", "data-block"}


class Tags(HTMLParser):
    """Every tag and attribute name in a piece of HTML, as a browser's parser would see them."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: set[str] = set()
        self.attrs: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        self.attrs.update(name for name, _ in attrs)


def assert_only_view_markup(spec: str) -> None:
    parser = Tags()
    parser.feed(spec)
    assert parser.tags <= SPEC_TAGS and parser.attrs <= SPEC_ATTRS, (parser.tags, parser.attrs)


def call_raw(url: str, api: str, data: list[Any]) -> tuple[str, Any]:
    """One call through gradio's REST API, with JSON gradio_client cannot send (a lone surrogate, NaN).

    Returns the final server-sent event's name ("complete" or "error") and its data.
    """
    body = json.dumps({"data": data})  # ensure_ascii: "\ud800" and NaN go out as JSON escapes/literals
    with httpx.Client(timeout=300) as http:
        posted = http.post(f"{url}gradio_api/call/{api}", content=body, headers={"content-type": "application/json"})
        event_id = posted.json()["event_id"]
        event = ""
        with http.stream("GET", f"{url}gradio_api/call/{api}/{event_id}") as stream:
            for line in stream.iter_lines():
                if line.startswith("event:"):
                    event = line.removeprefix("event:").strip()
                elif line.startswith("data:") and event in ("complete", "error"):
                    return event, json.loads(line.removeprefix("data:"))
    raise AssertionError("the stream ended without a result")


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_hostile_prompts_get_a_reply_and_the_view_stays_plain_markup(client: Any, kind: str) -> None:
    prompt = HOSTILE[kind]
    _, chat, spec, *_, stats = client.predict(*chat_args(prompt, max_new=4), api_name="/chat")
    assert [m["role"] for m in chat] == ["user", "assistant"]
    assert message_text(chat[0]) == prompt  # plain text to the chatbot, which sanitises its markdown
    assert "spec-tokens" in spec and "finished:" in stats
    assert_only_view_markup(spec)
    assert "\x1b" not in spec and "\u202e" not in spec and "\x00" not in spec


def test_lone_surrogates_nan_and_huge_pastes_get_one_clear_message(url: str, client: Any, engine: Engine) -> None:
    # A lone surrogate cannot be encoded for the tokenizer: it is shown and read as U+FFFD.
    event, data = call_raw(url, "chat", list(chat_args("Hello \ud800 there", max_new=4)))
    assert event == "complete" and message_text(data[1][0]) == "Hello \ufffd there"
    event, data = call_raw(url, "chat", [*chat_args("Hello")[:3], float("nan"), *chat_args("Hello")[4:]])
    assert event == "error" and "temperature must be a finite number" in data["error"]

    with pytest.raises(Exception, match="too long for the model") as err:
        client.predict(*chat_args("spam " * 20_000), api_name="/chat")  # a 100,000-character paste
    assert f"context window is {engine.target.max_context} tokens" in str(err.value)
    with pytest.raises(Exception, match="too long for the model"):
        client.predict(*chat_args("spam " * 20_000), api_name="/next_block")
    chat = client.predict(*chat_args(PROMPT, max_new=6), api_name="/chat")[1]
    assert [message_text(m) for m in chat[:-1]] == [PROMPT]  # the refused pastes left no turn behind
    assert message_text(chat[-1]) == plain_greedy(engine, PROMPT, 6).text


@pytest.mark.parametrize(("index", "value", "message"), [
    (1, 99, "greater than maximum value 32"),  # block size
    (1, 1, "less than minimum value 2"),
    (1, "four", "Expected a `float`"),
    (2, 9, "greater than maximum value 4"),  # denoising steps
    (3, -1, "less than minimum value 0"),  # temperature
    (4, 0, "less than minimum value 0.05"),  # top-p
    (5, 0, "less than minimum value 1"),  # max new tokens
    (5, 100_000, "greater than maximum value 1024"),
    (6, 1e30, "seed must be a whole number"),
    (8, "sideways", "not in the list of choices"),  # verify length
])
def test_out_of_range_parameters_get_a_clear_message(client: Any, index: int, value: Any, message: str) -> None:
    args = list(chat_args("Hello", max_new=2))
    args[index] = value
    with pytest.raises(Exception, match=re.escape(message)):
        client.predict(*args, api_name="/chat")
    # The visitor's session and the server are fine: the next request is answered.
    chat = client.predict(*chat_args("Hello", max_new=2), api_name="/chat")[1]
    assert [m["role"] for m in chat] == ["user", "assistant"]
