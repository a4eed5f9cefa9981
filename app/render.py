"""BlockEvents → the "Speculation view": one HTML span per token, coloured by where it came from.

Every token string and every title is HTML-escaped: tokens are arbitrary model output
(`<script>`, quotes, `&`), and the panel is injected as raw HTML.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from dflash_core.events import BlockEvent

ACCEPTED = "tok-accepted"  # a draft token the target kept
TARGET = "tok-target"  # the target's own token: correction, bonus, prefill or plain decoding
REJECTED = "tok-rejected"  # a draft token the target turned down (shown struck through)
TRIMMED = "tok-trimmed"  # committed, then cut from the reply (past max_new_tokens, EOS or a stop string)

LEGEND = (
    '<div class="spec-legend"><b>Speculation view</b> '
    f'<span class="tok {ACCEPTED}">accepted draft</span> '
    f'<span class="tok {TARGET}">target token</span> '
    f'<span class="tok {REJECTED}">rejected draft</span>'
    "<span class=\"spec-hint\">hover a token for details</span>"
    "</div>"
)
EMPTY = '<div class="spec-empty">The coloured tokens of the next reply appear here, block by block.</div>'


def _span(text: str, cls: str, title: str) -> str:
    return f'<span class="tok {cls}" title="{html.escape(title, quote=True)}">{html.escape(text, quote=True)}</span>'


def _fixed_step(ev: BlockEvent, i: int) -> int | None:
    """1-based denoising step at which draft position i (0-based) became final."""
    for s, step in enumerate(ev.steps):
        if i < len(step.fixed) and step.fixed[i]:
            return s + 1
    return None


def _draft_title(ev: BlockEvent, i: int, verdict: str) -> str:
    n_steps = len(ev.steps)
    p = ev.steps[-1].probs[i] if ev.steps and i < len(ev.steps[-1].probs) else None
    step = _fixed_step(ev, i)
    parts = [f"block {ev.index}", f"pos {i + 1}/{len(ev.draft)}"]
    parts.append(f"draft p={p:.3f}" if p is not None else "draft p=?")
    parts.append(f"fixed at step {step}/{n_steps}" if step is not None else "never fixed")
    parts.append(verdict)
    return " · ".join(parts)


def _text_of(texts: Sequence[str], i: int) -> str:
    return texts[i] if i < len(texts) else "\ufffd"


def block_html(ev: BlockEvent, keep: int | None = None) -> str:
    """One event: accepted drafts, then rejected drafts (struck), then the target's token.

    `keep`: length of the final reply. A block may commit past max_new_tokens or past EOS;
    those tokens are cut from the reply, so they are marked TRIMMED rather than hidden.
    """
    first = ev.tokens_so_far - len(ev.committed)  # reply index of this event's first token

    def committed(j: int, cls: str, title: str) -> str:
        if keep is not None and first + j >= keep:
            cls, title = f"{cls} {TRIMMED}", f"{title} · past the end of the reply (trimmed)"
        return _span(_text_of(ev.committed_text, j), cls, title)

    spans: list[str] = []
    parity = "blk-odd" if ev.index % 2 else "blk-even"
    if ev.is_draft_block:
        for i in range(ev.accepted):
            spans.append(committed(i, ACCEPTED, _draft_title(ev, i, "accepted")))
        for i in range(ev.accepted, len(ev.draft)):
            spans.append(_span(_text_of(ev.draft_text, i), REJECTED, _draft_title(ev, i, "rejected")))
        kind = "bonus (all drafts accepted)" if ev.accepted == len(ev.draft) else "correction"
        title = f"block {ev.index} · pos {ev.accepted + 1}/{len(ev.draft)} · target {kind}"
    else:
        kind = "prefill" if ev.index == 0 else "plain decoding"
        title = f"block {ev.index} · target token ({kind})"
    spans.append(committed(len(ev.committed) - 1, TARGET, title))
    return f'<span class="blk {parity}" data-block="{ev.index}">{"".join(spans)}</span>'


def render_view(events: Sequence[BlockEvent], keep: int | None = None) -> str:
    """The whole reply so far. `white-space: pre-wrap` (style.css) keeps newlines and indents.

    `keep`: the final reply's token count, once known (see `block_html`).
    """
    if not events:
        return f'<div class="spec-view">{LEGEND}{EMPTY}</div>'
    body = "".join(block_html(ev, keep) for ev in events)
    return f'<div class="spec-view">{LEGEND}<div class="spec-tokens">{body}</div></div>'
