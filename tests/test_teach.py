"""The "How it works" text and the Step panel, on hand-built events (no model needed)."""

from __future__ import annotations

from test_render import draft_block, prefill

from app import step, teach
from app.render import ACCEPTED, REJECTED, TARGET
from app.session import BlockStat, RunStats, Session
from dflash_core.events import Finished


def session_with(events, greedy: bool = True) -> Session:
    s = Session()
    s.begin("hi")
    s.greedy = greedy
    for ev in events:
        s.on_event(ev)
    return s


def reply_events():
    """Prefill, a partly accepted block, a fully accepted one, one with nothing accepted."""
    return [
        prefill("The"),
        draft_block(1, 11, [" cat", " sat", " on", " mat"], accepted=3, target_text=" the", tokens_before=1),
        draft_block(2, 15, [" mat", ".", " It"], accepted=3, target_text=" purred", tokens_before=5),
        draft_block(3, 19, [" a", " b", " c"], accepted=0, target_text=" loudly", tokens_before=9),
    ]


def test_before_any_reply_the_generic_text_defines_tau_speedup_and_losslessness() -> None:
    text = teach.explain(None)
    assert text == teach.explain(Session())  # an empty session: same generic page
    assert "τ (tau)" in text and "accepted drafts + 1" in text
    assert "τ × t(1 token) / (t(block) + t(draft))" in text
    assert "identical" in text and "min(1, p(x)/q(x))" in text and "max(0, p − q)" in text
    assert "Ask something" in text
    assert "Your last reply" not in text


def test_partly_accepted_block_is_told_with_its_real_tokens() -> None:
    ev = reply_events()[1]
    line = teach.describe_block(ev)
    assert "block 1" in line
    assert "agreed with the first 3" in line and "replaced the 4th" in line
    assert "4 tokens were committed for one target forward" in line
    # The drafts appear as chips: three accepted, the rejected one, then the target's own token.
    assert line.count(f'class="tok {ACCEPTED}"') == 3
    assert f'<span class="tok {REJECTED}">·mat</span>' in line  # spaces made visible
    assert f'<span class="tok {TARGET}">·the</span>' in line


def test_fully_accepted_and_fully_rejected_blocks() -> None:
    _, _, full, none = reply_events()
    full_line = teach.describe_block(full)
    assert "all 3" in full_line and "bonus" in full_line and "4 tokens were committed" in full_line
    none_line = teach.describe_block(none)
    assert "disagreed at the very first position" in none_line
    assert "1 token was committed for one target forward" in none_line
    assert "2 drafts after it were dropped" in none_line
    # Sampling words it as the acceptance test, not as agreement with an argmax.
    assert "min(1, p/q)" in teach.describe_block(full, greedy=False)


def test_examples_are_real_blocks_of_the_reply_in_order() -> None:
    events = reply_events()
    picked = teach.pick_examples(events)
    assert [ev.index for ev in picked] == [1, 2, 3]  # best (tie → earliest), a correction, a bonus … in order
    assert teach.pick_examples(events[:1]) == []  # the prefill is not a draft block
    many = [draft_block(i, 10 + i, ["x", "y"], accepted=0, target_text="z", tokens_before=i) for i in range(1, 9)]
    assert len(teach.pick_examples(many)) == 2  # all alike: two examples, not all eight


def test_reply_page_quotes_the_reply_and_states_the_guarantee() -> None:
    s = session_with(reply_events())
    text = teach.explain(s)
    assert text.index("Your last reply") < text.index("The cycle")  # own reply first, theory after
    assert "3 blocks" in text and f"τ = **{s.dflash.tau:.2f}**" in text
    assert s.dflash.tau == (4 + 4 + 1) / 3
    assert "block 1" in text and "block 2" in text and "block 3" in text
    assert "token for token what plain greedy decoding" in text
    assert "Tick *race plain decoding*" in text  # no plain run: no t(1 token) to quote

    sampled = teach.explain(session_with(reply_events(), greedy=False))
    assert "same distribution as plain sampling" in sampled and "token for token what plain" not in sampled


def test_speed_paragraph_fills_the_formula_with_measured_times() -> None:
    s = session_with(reply_events())  # every draft block: draft 1 ms, verify 3 ms
    plain = RunStats()
    plain.blocks = [BlockStat(index=i, block_size=1, accepted=0, committed=1, draft_ms=0.0,
                              verify_ms=5.0 if i == 0 else 2.0, tokens=i + 1, engine_s=0.0) for i in range(5)]
    s.plain = plain
    text = teach.speed_paragraph(s.dflash, s.plain)
    # t(1 token) is the plain run's per-token forward (the prefill excluded): 3.00 × 2 / (3 + 1) = 1.50.
    assert "t(1 token) = 2.0 ms" in text and "≈ **1.50×**" in text


def test_markdown_and_html_in_tokens_are_neutralised() -> None:
    chip = teach.chip("**<b>x</b>**", ACCEPTED)
    assert "<b>" not in chip and "**" not in chip
    assert "&lt;b&gt;" in chip and "&#42;&#42;" in chip


def test_step_panel_shows_verdict_per_position_and_what_was_committed() -> None:
    ev = reply_events()[1]
    s = session_with([ev])
    markup = step.step_html(step.StepResult(events=[ev]), s)
    assert markup.count("✓ accepted") == 3 and markup.count("✗ rejected") == 1
    assert "4 tokens for one target forward" in markup and "3 accepted + 1 correction" in markup
    full = reply_events()[2]
    markup = step.step_html(step.StepResult(events=[full]), s)
    assert "– dropped" not in markup and "1 bonus" in markup
    none = reply_events()[3]
    markup = step.step_html(step.StepResult(events=[none]), s)
    assert markup.count("– dropped") == 2 and "1 token for one target forward" in markup
    fin = Finished(reason="eos", token_ids=[1, 2], text="", prompt_tokens=3, blocks=1, tau=2.0, elapsed_s=1.0,
                   tokens_per_s=2.0, draft_s=0.1, verify_s=0.1, prefill_s=0.1)
    assert "Finished (eos)" in step.step_html(step.StepResult(finished=fin), s)
    assert "Type a prompt" in step.step_html(None, Session())
