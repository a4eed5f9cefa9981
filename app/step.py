"""Step mode: one draft → verify → accept cycle per "Next block" click.

The engine's generator is suspended between clicks and kept in the visitor's Session; every
click resumes it for exactly one block. So a stepped reply is the very same computation as a
streamed one, only paused: it commits exactly the same tokens.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field

from dflash_core.config import GenerationConfig
from dflash_core.engine import Engine
from dflash_core.events import BlockEvent, Finished

from .history import begin_reply
from .render import ACCEPTED, REJECTED, TARGET
from .session import Session
from .teach import shown

DISCARDED = "tok-discarded"  # a draft token after the first rejection: never compared, dropped


@dataclass
class StepResult:
    """What one click did: the events it consumed (prefill and/or one block) and the end, if reached."""

    events: list[BlockEvent] = field(default_factory=list)
    finished: Finished | None = None

    @property
    def block(self) -> BlockEvent | None:
        """The cycle to show in the Step panel: the last event of this click."""
        return self.events[-1] if self.events else None


def start(session: Session, engine: Engine, text: str, cfg: GenerationConfig, plain: bool = False) -> None:
    """Begin a stepped reply to `text` (ending any previous one); nothing is computed yet.

    DFlashError (empty prompt, a message too long for the window) propagates with the turn taken back.
    """
    session.stepper = begin_reply(session, engine, text, cfg, plain=plain)[1]


def advance(session: Session) -> StepResult:
    """Resume the suspended generation for one block.

    The prefill event (the target's first token, no draft) is folded into the first click, so
    every click of a DFlash reply shows a drafted block. Reaching `Finished` commits the reply
    and discards the generator.
    """
    result = StepResult()
    if session.stepper is None:
        return result
    for ev in session.stepper:
        if isinstance(ev, Finished):
            session.finish(ev)
            session.stepper = None  # exhausted: nothing left to close
            result.finished = ev
            return result
        session.on_event(ev)
        result.events.append(ev)
        if ev.is_draft_block or ev.index > 0:  # one drafted block, or one plain-decoding step
            return result
    session.stepper = None  # the generator ended without a Finished (it never does; be safe)
    return result


def _tok(text: str, cls: str, title: str = "") -> str:
    attr = f' title="{html.escape(title, quote=True)}"' if title else ""
    return f'<span class="tok {cls}"{attr}>{html.escape(shown(text), quote=True)}</span>'


def _cell(text: str, cls: str, title: str) -> str:
    return f"<td>{_tok(text, cls, title)}</td>"


def _row(label: str, cells: Sequence[str]) -> str:
    return f"<tr><th>{label}</th>{''.join(cells)}</tr>"


def step_html(result: StepResult | None, session: Session) -> str:
    """The Step panel: the drafted block, the target's verdict per position, what was committed."""
    if result is None or (not result.events and result.finished is None):
        if session.stepper is not None:
            return '<div class="step-panel">Press <b>Next block</b> to run the next cycle.</div>'
        return ('<div class="step-panel">Type a prompt and press <b>Next block</b>: the reply is then generated one '
                "draft → verify → accept cycle per click.</div>")
    parts: list[str] = []
    ev = result.block
    if ev is not None and not ev.is_draft_block:
        what = "the prefill pass read the prompt and" if ev.index == 0 else "plain decoding:"
        tok = ev.committed_text[-1] if ev.committed_text else "?"
        parts.append(f"<p><b>Block {ev.index}</b>: {what} the target chose "
                     f"{_tok(tok, TARGET)} itself (no draft).</p>")
    elif ev is not None:
        n = len(ev.draft)
        heads = [f"<th>{i + 1}</th>" for i in range(n)] + ["<th>+1</th>"]
        drafts, verdicts = [], []
        for i in range(n):
            if i < ev.accepted:
                cls, verdict = ACCEPTED, "✓ accepted"
            elif i >= ev.checked:
                cls, verdict = DISCARDED, "· not verified"
            elif i == ev.accepted:
                cls, verdict = REJECTED, "✗ rejected"
            else:
                cls, verdict = f"{REJECTED} {DISCARDED}", "– dropped"
            drafts.append(_cell(ev.draft_text[i] if i < len(ev.draft_text) else "?", cls, f"draft position {i + 1}"))
            verdicts.append(f"<td class=\"verdict\">{verdict}</td>")
        drafts.append("<td></td>")
        target_tok = ev.committed_text[-1] if ev.committed_text else "?"
        kind = "bonus" if ev.accepted == ev.checked else "correction"
        col = ev.accepted  # the target's own token sits where the first rejection was (or after the block)
        targets = ["<td></td>"] * (n + 1)
        targets[col] = _cell(target_tok, TARGET, f"target {kind}")
        verdicts.append('<td class="verdict">bonus</td>' if kind == "bonus" else "<td></td>")
        if ev.tree_nodes is not None:
            guesses = (f", {ev.lookup_nodes} of them lookup guesses (text that already occurred, or that the "
                       "target often writes)"
                       if ev.lookup_nodes else "")
            from_lookup = (f"; {ev.lookup_accepted} of the accepted tokens came from those guesses"
                           if ev.lookup_accepted else "")
            checked = (f"checked a tree of {ev.tree_nodes} candidates (its likeliest alternatives at each position "
                       f"too{guesses}) in one forward pass; shown is the branch the target walked{from_lookup} (the "
                       "tree picture under the charts shows every candidate)")
        elif ev.checked == n:
            checked = "checked them all in one forward pass"
        else:
            checked = (f"checked the first {ev.checked} in one forward pass (the adaptive verify length: the "
                       f"drafter was unsure of the rest, and on this machine each extra verified token costs time)")
        parts.append(f"<p><b>Block {ev.index}</b>: the drafter proposed {n} tokens in one pass; the target "
                     f"{checked}.</p>")
        parts.append('<table class="step-table"><tr><th>position</th>' + "".join(heads) + "</tr>"
                     + _row("draft", drafts) + _row("verdict", verdicts) + _row("target", targets) + "</table>")
        if ev.selector:
            parts.append(selector_table(ev))
        committed = " ".join(_tok(t, ACCEPTED if j < ev.accepted else TARGET) for j, t in enumerate(ev.committed_text))
        k = len(ev.committed)
        # The reply can end inside a block (EOS, max new tokens): then fewer tokens are kept.
        why = f"{ev.accepted} accepted + 1 {kind}" if k == ev.accepted + 1 else "the reply ended inside this block"
        parts.append(f"<p>Committed: {committed} — <b>{k} token{'s' if k != 1 else ''} for one target forward</b> "
                     f"({why}).</p>")
    if result.finished is not None:
        fin = result.finished
        parts.append(f"<p><b>Finished ({fin.reason})</b>: {len(fin.token_ids)} tokens in {fin.blocks} blocks, "
                     f"τ = {fin.tau:.2f}. Type a new prompt to step again.</p>")
    return f'<div class="step-panel">{"".join(parts)}</div>'


SHOWN_CANDIDATES = 3


def selector_table(ev: BlockEvent) -> str:
    """DFlash 2: each position's best candidates by the selector's score (given what it chose
    before), the chosen one marked; its first choice is the draft token above."""
    assert ev.selector is not None
    rows = []
    for r in range(SHOWN_CANDIDATES):
        cells = []
        for choice in ev.selector:
            if r >= len(choice.tokens):
                cells.append("<td></td>")
                continue
            mark = "✔ " if r == choice.chosen else ""
            cls = "tok-candidate" if r == choice.chosen else f"tok-candidate {DISCARDED}"
            cells.append(f"<td>{_tok(choice.texts[r], cls, f'{mark}selector probability {choice.probs[r]:.2f}')}"
                         f"<br><small>{choice.probs[r]:.2f}</small></td>")
        rows.append(_row(f"choice {r + 1}", cells))
    return ("<p>DFlash 2: at each position the <b>candidate selector</b> rescored the drafter's top "
            f"{len(ev.selector[0].tokens)} tokens knowing the token it had just chosen before (left to right) "
            "and took the best: its candidates, best first:</p><table class=\"step-table\">"
            + "".join(rows) + "</table>")
