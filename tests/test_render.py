"""The Speculation view and the charts, on hand-built events (no model needed)."""

from __future__ import annotations

import html
import json
from html.parser import HTMLParser

import plotly.graph_objects as go

from app import charts
from app.render import ACCEPTED, REJECTED, TARGET, TRIMMED, render_view
from app.session import RunStats, Session
from dflash_core.events import BlockEvent, DraftStep, Finished


def draft_block(index: int, start: int, draft_text: list[str], accepted: int, target_text: str,
                tokens_before: int, steps: int = 2, verified: int | None = None) -> BlockEvent:
    """A draft block: ids are made up; texts are what matters to the renderer."""
    n = len(draft_text)
    draft = list(range(100 + index * 50, 100 + index * 50 + n))
    history = []
    for s in range(steps):
        # Step s fixes positions up to a growing prefix; probabilities rise with the step.
        fixed = [i < (s + 1) * n // steps for i in range(n)]
        history.append(DraftStep(tokens=list(draft), probs=[0.5 + 0.1 * s + 0.01 * i for i in range(n)],
                                 fixed=fixed))
    committed = [*draft[:accepted], 7]
    return BlockEvent(
        index=index, start=start, steps=history, draft=draft, accepted=accepted, target_token=7,
        committed=committed, draft_ms=1.0, verify_ms=3.0, tokens_so_far=tokens_before + len(committed),
        text="", committed_text=[*draft_text[:accepted], target_text], draft_text=list(draft_text),
        verified=verified,
    )


def prefill(text: str) -> BlockEvent:
    return BlockEvent(index=0, start=10, steps=[], draft=[], accepted=0, target_token=5, committed=[5],
                      draft_ms=0.0, verify_ms=5.0, tokens_so_far=1, text=text, committed_text=[text])


class Spans(HTMLParser):
    """Collects (classes, title, text) of every token span."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.spans: list[tuple[set[str], str, str]] = []
        self._open: list[tuple[set[str], str] | None] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        classes = set((a.get("class") or "").split())
        self._open.append((classes, a.get("title") or "") if "tok" in classes else None)
        if "tok" in classes:
            self.spans.append((classes, a.get("title") or "", ""))

    def handle_endtag(self, tag: str) -> None:
        if self._open:  # the outer panel's closing tag was cut off with its opening
            self._open.pop()

    def handle_data(self, data: str) -> None:
        if self._open and self._open[-1] is not None and self.spans:
            classes, title, text = self.spans[-1]
            self.spans[-1] = (classes, title, text + data)


def token_spans(markup: str) -> list[tuple[set[str], str, str]]:
    """Token spans of the reply body (the legend's sample spans are skipped)."""
    body = markup.split('<div class="spec-tokens">', 1)
    assert len(body) == 2, "no token body rendered"
    p = Spans()
    p.feed('<div class="spec-tokens">' + body[1])
    return p.spans


def reply_text(markup: str) -> str:
    """The reply as the view shows it: accepted and target tokens, in order, unescaped."""
    return "".join(t for c, _, t in token_spans(markup) if (ACCEPTED in c or TARGET in c) and TRIMMED not in c)


def test_classes_follow_token_origin() -> None:
    ev = draft_block(1, 11, ["a", "b", "c", "d"], accepted=2, target_text="X", tokens_before=1)
    spans = token_spans(render_view([prefill("P"), ev]))
    kinds = [(next(k for k in (ACCEPTED, TARGET, REJECTED) if k in c), t) for c, _, t in spans]
    # Prefill token, two accepted drafts, the two rejected drafts, then the target's correction.
    assert kinds == [(TARGET, "P"), (ACCEPTED, "a"), (ACCEPTED, "b"), (REJECTED, "c"), (REJECTED, "d"),
                     (TARGET, "X")]


def test_titles_give_block_position_probability_and_step() -> None:
    ev = draft_block(3, 40, ["a", "b", "c", "d"], accepted=1, target_text="X", tokens_before=5, steps=2)
    spans = token_spans(render_view([ev]))
    first, second = spans[0][1], spans[1][1]
    assert "block 3" in first and "pos 1/4" in first and "accepted" in first
    assert "p=0.600" in first  # the final step's probability of position 1
    assert "fixed at step 1/2" in first
    assert "pos 2/4" in second and "fixed at step 1/2" in second and "rejected" in second
    assert "fixed at step 2/2" in spans[2][1]
    assert "correction" in spans[-1][1]


def test_all_accepted_block_ends_with_a_bonus_token() -> None:
    ev = draft_block(1, 11, ["a", "b"], accepted=2, target_text="c", tokens_before=1)
    spans = token_spans(render_view([ev]))
    assert [t for _, _, t in spans] == ["a", "b", "c"]
    assert not any(REJECTED in c for c, _, _ in spans)
    assert "bonus" in spans[-1][1]


def test_tokens_and_titles_are_escaped() -> None:
    nasty = '<script>alert("x")</script>'
    ev = draft_block(1, 11, [nasty, "'&'", "b"], accepted=1, target_text="\"q\" & <b>", tokens_before=0)
    markup = render_view([ev])
    body = markup.split('<div class="spec-tokens">', 1)[1]  # the legend has markup of its own
    assert "<script>" not in body and "<b>" not in body
    assert html.escape(nasty, quote=True) in markup
    assert "&#x27;&amp;&#x27;" in markup  # the rejected draft token, single quotes included
    spans = token_spans(markup)
    assert [t for _, _, t in spans] == [nasty, "'&'", "b", '"q" & <b>']


def test_fenced_code_reply_round_trips_to_plain_text() -> None:
    """The view's kept tokens spell the reply exactly, and the chatbot gets that same plain text."""
    pieces = ["Here", ":", "\n", "```", "python", "\n", "def", " f", "(x", "):", "\n", "    ", "return",
              " x", " <", " 2", " and", " '", "&", "'", "\n", "```", "\n"]
    events, pos, k = [prefill(pieces[0])], 1, 1
    while k < len(pieces):
        take = pieces[k:k + 3]  # two accepted drafts then the target's token, plus rejected noise
        drafts = [*take[:-1], "WRONG", "<nope>"] if len(take) > 1 else ["<nope>"]
        ev = draft_block(len(events), 10 + pos, drafts, accepted=len(take) - 1, target_text=take[-1],
                         tokens_before=pos)
        events.append(ev)
        pos += len(take)
        k += len(take)
    reply = "".join(pieces)
    assert reply_text(render_view(events)) == reply

    session = Session()
    session.begin("write code")
    for ev in events:
        ev.text = ""  # the engine's decoded text is what the chatbot shows; set it at the end
        session.on_event(ev)
    session.finish(Finished(reason="eos", token_ids=list(range(pos)), text=reply, prompt_tokens=10,
                            blocks=len(events) - 1, tau=1.0, elapsed_s=1.0, tokens_per_s=1.0, draft_s=0.1,
                            verify_s=0.5, prefill_s=0.1))
    assert session.chat_messages()[-1] == {"role": "assistant", "content": reply}
    assert "```python\ndef f(x):\n    return x < 2 and '&'\n```" in session.history[-1]["content"]


def test_tokens_past_the_final_reply_are_marked_trimmed() -> None:
    ev = draft_block(1, 11, ["a", "b", "c"], accepted=3, target_text="d", tokens_before=1)
    spans = token_spans(render_view([prefill("P"), ev], keep=3))
    assert [TRIMMED in c for c, _, _ in spans] == [False, False, False, True, True]


def test_empty_view_has_the_legend_but_no_tokens() -> None:
    markup = render_view([])
    assert ACCEPTED in markup and "spec-tokens" not in markup


def _stats(events: list[BlockEvent]) -> RunStats:
    stats = RunStats()
    for ev in events:
        stats.add(ev)
    return stats


def test_charts_return_figures_with_expected_traces() -> None:
    events = [prefill("P"), draft_block(1, 11, ["a", "b", "c", "d"], accepted=2, target_text="X", tokens_before=1),
              draft_block(2, 14, ["e", "f", "g", "h"], accepted=4, target_text="Y", tokens_before=4)]
    stats = _stats(events)
    assert stats.tau == (3 + 5) / 2

    heat = charts.heatmap_figure(events[1], [["a", "b", "c", "d"], ["a", "b", "c", "d"]])
    assert isinstance(heat, go.Figure)
    kinds = [t.type for t in heat.data]
    assert kinds[0] == "heatmap" and kinds.count("scatter") == 3
    assert len(heat.data[0].z) == 2 and len(heat.data[0].z[0]) == 4  # steps × positions
    names = {t.name: t for t in heat.data}
    assert list(names["accepted"].x) == ["1", "2"] and list(names["rejected"].x) == ["4"]
    assert list(names["target correction"].x) == ["3"]
    assert heat.layout.uirevision == "heatmap"

    acc = charts.acceptance_figure(stats)
    assert [t.type for t in acc.data] == ["bar", "bar", "scatter", "scatter"]
    assert list(acc.data[0].y) == [2, 4]  # accepted drafts per block; the prefill is not a block
    assert list(acc.data[3].y) == [3.0, 4.0]  # running tau
    assert acc.layout.uirevision == "acceptance"

    plain = _stats([prefill("P")] + [
        BlockEvent(index=i, start=10 + i, steps=[], draft=[], accepted=0, target_token=1, committed=[1],
                   draft_ms=0.0, verify_ms=2.0, tokens_so_far=i + 1, text="") for i in range(1, 9)])
    plain.finished = Finished(reason="length", token_ids=list(range(9)), text="", prompt_tokens=10, blocks=8,
                              tau=1.0, elapsed_s=1.0, tokens_per_s=1.0, draft_s=0.0, verify_s=0.1, prefill_s=0.1)
    speed = charts.speed_figure(stats, plain)
    assert [t.name for t in speed.data] == ["DFlash", "plain"]
    assert list(speed.data[0].y) == [0, 1, 4, 9]
    assert "speed-up" in speed.layout.title.text
    assert json.loads(speed.to_json())["layout"]["uirevision"] == "speed"

    for empty in (charts.heatmap_figure(None), charts.acceptance_figure(RunStats()), charts.speed_figure(RunStats())):
        assert isinstance(empty, go.Figure) and len(empty.data) == 0


def test_session_survives_deepcopy_with_a_fresh_cancel_flag() -> None:
    import copy

    s = Session()
    s.begin("hi")
    s.cancel.set()
    c = copy.deepcopy(s)
    assert c.history == s.history and c.history is not s.history
    assert not c.cancel.is_set() and c.cancel is not s.cancel


def test_partial_utf8_pieces_are_merged_with_the_token_that_completes_them() -> None:
    from app.render import merge_partial

    # "é" (2 bytes) split over tokens 1 and 2; "中" (3 bytes) over 4, 5, 6; token 7 is cut mid-character.
    table = {(1,): "\ufffd", (2,): "\ufffd", (1, 2): "é", (4,): "\ufffd", (5,): "\ufffd", (6,): "\ufffd",
             (4, 5): "\ufffd", (4, 5, 6): "中", (7,): "\ufffd", (3,): " ok"}

    def decode(ids: list[int]) -> str:
        return table.get(tuple(ids), "".join(table[(i,)] for i in ids))

    ids = [1, 2, 3, 4, 5, 6, 7]
    texts = [table[(i,)] for i in ids]
    assert merge_partial(ids, texts, decode) == ["", "é", " ok", "", "", "中", "\ufffd"]
    assert merge_partial(ids, texts, None) == texts  # no tokenizer: shown as the engine gave them

    # In the view: the pieces straddle a block boundary; the character shows once, on the
    # completing token, and the reply reads as the decoded text.
    events = [prefill("\ufffd"), draft_block(1, 11, ["\ufffd", "WRONG"], accepted=1, target_text=" ok",
                                             tokens_before=1)]
    events[0].committed = [1]
    events[1].committed = [2, 3]
    markup = render_view(events, decode=decode)
    assert reply_text(markup) == "é ok"
    assert "\ufffd" not in reply_text(markup)
    titles = [t for _, t, text in token_spans(markup) if text == "é"]
    assert titles and "multi-byte character" in titles[0]
    assert reply_text(render_view(events)) == "\ufffd\ufffd ok"  # without decode: unchanged


def test_drafts_past_the_verified_prefix_are_shown_as_not_verified() -> None:
    """Adaptive verify length: the target checked 2 of 4 drafts, kept 1, and corrected the 2nd."""
    from app import step

    ev = draft_block(1, 11, ["a", "b", "c", "d"], accepted=1, target_text="X", tokens_before=1, verified=2)
    assert ev.rejected == [ev.draft[1]] and ev.unverified == ev.draft[2:]
    spans = token_spans(render_view([prefill("P"), ev]))
    kinds = [(next(k for k in (ACCEPTED, TARGET, REJECTED) if k in c), t) for c, _, t in spans]
    assert kinds == [(TARGET, "P"), (ACCEPTED, "a"), (REJECTED, "b"), (TARGET, "X")]  # c, d were never judged
    assert "pos 2/2" in spans[-1][1] and "2 later drafts not verified" in spans[-1][1]

    heat = charts.heatmap_figure(ev, [["a", "b", "c", "d"], ["a", "b", "c", "d"]])
    names = {t.name: t for t in heat.data}
    assert list(names["accepted"].x) == ["1"] and list(names["rejected"].x) == []
    assert list(names["not verified"].x) == ["3", "4"] and list(names["target correction"].x) == ["2"]
    assert "1/2 drafts accepted (4 drafted)" in heat.layout.title.text

    full = draft_block(2, 13, ["e", "f", "g"], accepted=1, target_text="Y", tokens_before=3, verified=1)
    heat = charts.heatmap_figure(full)
    assert "target bonus" in {t.name for t in heat.data}  # all verified drafts accepted: the token is a bonus

    acc = charts.acceptance_figure(_stats([prefill("P"), ev, full]))
    verified = next(t for t in acc.data if t.name == "verified")
    assert list(verified.y) == [3, 2]  # anchor + verified drafts, per block

    markup = step.step_html(step.StepResult(events=[ev]), Session())
    assert markup.count("· not verified") == 2 and markup.count("✗ rejected") == 1
    assert "checked the first 2" in markup

    from app import teach

    sentence = teach.describe_block(ev)
    assert "2 more drafts it was unsure of" in sentence and "replaced the 2nd" in sentence
    assert "dropped" not in sentence  # nothing after the rejection was verified, so nothing was dropped
    assert "all 1 and added a bonus" in teach.describe_block(full)


def test_tree_block_shows_the_walked_branch_and_its_pass() -> None:
    """A tree block: the target checked 6 candidates (2 of them lookup guesses), walked 2
    deep, and one of the accepted tokens was a guess."""
    from app import step

    ev = draft_block(1, 11, ["a", "b", "c", "d"], accepted=2, target_text="X", tokens_before=1, verified=3)
    ev.tree_nodes, ev.lookup_nodes, ev.lookup_accepted = 6, 2, 1
    assert ev.pass_tokens == 7 and ev.rejected == [ev.draft[2]] and ev.unverified == [ev.draft[3]]
    markup = step.step_html(step.StepResult(events=[ev]), Session())
    assert "a tree of 6 candidates" in markup and "2 of them lookup guesses" in markup
    assert "1 of the accepted tokens came from those guesses" in markup
    acc = charts.acceptance_figure(_stats([prefill("P"), ev]))
    assert list(next(t for t in acc.data if t.name == "verified").y) == [7]  # the whole tree's pass
