"""The live race (app/race.py): two event streams merged by engine clock, and the two panes."""

from __future__ import annotations

from collections.abc import Iterator

from app.race import event_s, race, race_html, verdict
from app.session import RunStats, Session
from dflash_core.config import GenerationConfig
from dflash_core.engine import Engine
from dflash_core.events import BlockEvent, Finished

PROMPT = "Write a Python function that adds two numbers."


def block(index: int, ms: float, text: str = "") -> BlockEvent:
    return BlockEvent(index=index, start=0, steps=[], draft=[], accepted=0, target_token=1, committed=[1],
                      draft_ms=0.0, verify_ms=ms, tokens_so_far=index + 1, text=text)


def finished(text: str, ids: list[int], reason: str = "length") -> Finished:
    return Finished(reason=reason, token_ids=ids, text=text, prompt_tokens=3, blocks=len(ids), tau=1.0,
                    elapsed_s=1.0, tokens_per_s=1.0, draft_s=0.0, verify_s=1.0, prefill_s=0.1)


def stream(times: list[float], closed: list[str], name: str) -> Iterator[BlockEvent | Finished]:
    try:
        for i, ms in enumerate(times):
            yield block(i, ms)
        yield finished(name, [1] * len(times))
    finally:
        closed.append(name)


def test_the_side_behind_on_its_own_clock_goes_next() -> None:
    closed: list[str] = []
    # DFlash: a 100 ms prefill, then 50 ms blocks; plain: a 100 ms prefill, then 20 ms tokens.
    merged = list(race(stream([100, 50, 50], closed, "d"), stream([100, 20, 20, 20, 20, 20], closed, "p")))
    order = [(side, ev.index if isinstance(ev, BlockEvent) else "end") for side, ev in merged]
    # A tie goes to DFlash (it prefills first); then always the one whose clock is behind.
    assert order[:4] == [("dflash", 0), ("plain", 0), ("dflash", 1), ("plain", 1)]
    clocks, done = {"dflash": 0.0, "plain": 0.0}, set()
    for side, ev in merged:
        assert clocks[side] == min(c for s, c in clocks.items() if s not in done)  # none running was further behind
        if isinstance(ev, BlockEvent):
            clocks[side] += event_s(ev)
        else:
            done.add(side)
    # Each side's events come in their own order, each ends with its Finished, and both streams closed.
    for side, n in (("dflash", 3), ("plain", 6)):
        mine = [ev for s, ev in merged if s == side]
        assert [ev.index for ev in mine[:-1]] == list(range(n)) and isinstance(mine[-1], Finished)
    assert sorted(closed) == ["d", "p"]


def test_closing_the_race_early_closes_both_streams() -> None:
    closed: list[str] = []
    merged = race(stream([10] * 50, closed, "d"), stream([10] * 50, closed, "p"))
    next(merged), next(merged), next(merged)
    merged.close()
    assert sorted(closed) == ["d", "p"]


def test_a_real_race_at_temperature_zero_gives_identical_texts(engine: Engine) -> None:
    cfg = GenerationConfig(max_new_tokens=8, block_size=4)
    session = Session()
    for side, ev in race(engine.generate(PROMPT, cfg), engine.generate(PROMPT, cfg, plain=True)):
        if side == "plain":
            session.on_plain(ev)
        elif isinstance(ev, Finished):
            session.dflash.finished = ev
        else:
            session.on_event(ev)
    d, p = session.dflash, session.plain
    assert p is not None and d.finished is not None and p.finished is not None
    assert d.finished.token_ids == p.finished.token_ids and session.plain_text == d.finished.text
    assert len(p.blocks) == 8  # plain decoding: one event per token
    assert "texts identical ✓" in verdict(d, p, greedy=True) and "×" in verdict(d, p, greedy=True)
    page = race_html(d, p, d.finished.text, session.plain_text, greedy=True)
    assert page.count("data-side=") == 2 and "Finish line:" in page


def test_the_panes_escape_model_text_and_explain_sampling() -> None:
    d, p = RunStats(), RunStats()
    d.add(block(0, 100)), p.add(block(0, 100)), p.add(block(1, 50))
    hostile = '<script>alert(1)</script> & "q" \u202eevil'
    page = race_html(d, p, hostile, "plain so far", greedy=True)
    assert "<script>" not in page and "&lt;script&gt;" in page and "\u202e" not in page
    assert "race-finish" not in page  # neither run has finished: no verdict yet
    d.finished, p.finished = finished("a", [1, 2]), finished("b", [1, 3])
    assert "texts DIFFER ✗" in verdict(d, p, greedy=True)
    assert "as sampling allows" in verdict(d, p, greedy=False)
    p.finished = finished("b", [1], reason="cancelled")
    assert verdict(d, p, greedy=True) == "Race stopped: no speed-up measured."
    assert "race plain decoding" in race_html(d, None, "", "", greedy=True)  # no race: the hint
