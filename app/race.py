"""The live race: plain decoding streamed beside DFlash, each on its own engine clock.

One machine cannot run the two at once without slowing both (two cores share every matmul; one GPU
shares its streams), so the app takes turns: `race` always advances whichever run is *behind on its
own clock*, the sum of its events' measured times (draft + verify, the prefill in the first event's
verify time). At any moment of the race both panes then show what each run had produced after the
same engine time: each grows at the pace it would have alone, and the race as a whole runs at the
speed of the two together.

Nothing here touches torch: the engine's events are plain dataclasses, the panes plain HTML.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Iterator
from typing import Literal

from dflash_core.events import BlockEvent, Finished

from .render import visible
from .session import RunStats

Side = Literal["dflash", "plain"]
Event = BlockEvent | Finished
SIDES: tuple[Side, Side] = ("dflash", "plain")
NOTE = ("Plain decoding races DFlash on this one machine: the two take turns, each on its own engine clock, "
        "so each pane grows at the pace that run would have alone.")
HINT = "Tick “race plain decoding” to stream plain decoding beside DFlash, live."


def event_s(ev: BlockEvent) -> float:
    """Engine seconds an event took (the prefill's time rides in the first event's verify time)."""
    return (ev.draft_ms + ev.verify_ms) / 1e3


def race(dflash: Iterable[Event], plain: Iterable[Event]) -> Iterator[tuple[Side, Event]]:
    """Merge two `Engine.generate` streams by engine clock: (side, event) pairs, each side's in order.

    The side whose clock is behind goes next (DFlash on a tie, so it prefills first); a side's
    Finished (or the end of its stream) retires it and the other runs on alone. Closing the
    merged generator (Stop, a closed connection) closes both streams, freeing their caches.
    """
    streams = {"dflash": iter(dflash), "plain": iter(plain)}
    clock = {side: 0.0 for side in SIDES}
    running: list[Side] = list(SIDES)
    try:
        while running:
            side = min(running, key=clock.__getitem__)  # min keeps the first of equals: DFlash
            ev = next(streams[side], None)
            if ev is None or isinstance(ev, Finished):
                running.remove(side)
            if ev is None:
                continue
            if isinstance(ev, BlockEvent):
                clock[side] += event_s(ev)
            yield side, ev
    finally:
        for stream in streams.values():
            close = getattr(stream, "close", None)
            if close is not None:
                close()


# ----- the two panes -----

CSS = """
.race { font-size: 14px; }
.race-note { color: #868e96; font-size: 12px; margin: 0 0 6px; }
.race-panes { display: flex; gap: 10px; }
.race-pane { flex: 1 1 0; min-width: 0; border: 1px solid #dee2e6; border-radius: 8px; padding: 6px 10px; }
.race-dflash { border-top: 4px solid #4c6ef5; }
.race-plain { border-top: 4px solid #868e96; }
.race-head { font-weight: 600; margin-bottom: 4px; }
.race-text { white-space: pre-wrap; overflow-wrap: anywhere; max-height: 220px; overflow-y: auto;
             font-family: ui-monospace, monospace; font-size: 13px; }
.race-finish { margin-top: 6px; font-weight: 600; }
.race-hint { color: #868e96; font-size: 13px; }
"""


def _pane(side: Side, name: str, run: RunStats, text: str) -> str:
    head = f"{name} · {run.tokens} tokens · {run.engine_s:.2f} s · {run.tokens_per_s:.1f} tok/s"
    if run.finished is not None:
        head += " · stopped" if run.finished.reason == "cancelled" else " · finished"
    return (f'<div class="race-pane race-{side}" data-side="{side}">'
            f'<div class="race-head">{html.escape(head)}</div>'
            f'<div class="race-text">{html.escape(visible(text), quote=True)}</div></div>')


def verdict(dflash: RunStats, plain: RunStats, greedy: bool) -> str:
    """The finish line, once both runs are done: the measured speed-up and whether the texts match."""
    d, p = dflash.finished, plain.finished
    if d is None or p is None:
        return ""
    if "cancelled" in (d.reason, p.reason):
        return "Race stopped: no speed-up measured."
    parts = []
    if plain.tokens_per_s > 0:
        parts.append(f"DFlash {dflash.tokens_per_s / plain.tokens_per_s:.2f}× the speed of plain decoding "
                     "(engine time, prefill included)")
    same = d.token_ids == p.token_ids
    if greedy:
        parts.append("texts identical ✓" if same else "texts DIFFER ✗")
    elif same:
        parts.append("texts identical (sampling: by chance)")
    else:
        parts.append("texts differ, as sampling allows: both runs draw from the target's distribution, but "
                     "DFlash spends its random numbers differently, so not on the same sample")
    return " · ".join(parts)


def race_html(dflash: RunStats, plain: RunStats | None, dflash_text: str, plain_text: str, greedy: bool) -> str:
    """Both panes side by side (the plain one empty until its prefill), then the finish line."""
    if plain is None:
        return f'<div class="race"><div class="race-hint">{html.escape(HINT)}</div></div>'
    line = verdict(dflash, plain, greedy)
    finish = f'<div class="race-finish">Finish line: {html.escape(line)}</div>' if line else ""
    return (f'<div class="race"><div class="race-note">{html.escape(NOTE)}</div><div class="race-panes">'
            f'{_pane("dflash", "DFlash", dflash, dflash_text)}{_pane("plain", "plain decoding", plain, plain_text)}'
            f"</div>{finish}</div>")
