"""BlockEvents → the "Speculation view": one HTML span per token, coloured by where it came from.

Every token string and every title is HTML-escaped: tokens are arbitrary model output
(`<script>`, quotes, `&`), and the panel is injected as raw HTML. Control and bidi-override
characters are shown as symbols (`visible`), so they cannot recolour or reorder the view.

Byte-level tokenizers split a multi-byte character (é, 中, an emoji) over several tokens, and each
piece alone decodes to "\ufffd". Given the tokenizer's `decode`, the view shows such a character
once, on the token that completes it (see `merge_partial`).
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence

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
PARTIAL = "\ufffd"  # what a lone piece of a multi-byte UTF-8 character decodes to
MAX_PIECES = 4  # a UTF-8 character has at most 4 bytes, so at most 4 byte-level tokens

Decode = Callable[[list[int]], str]


def merge_partial(ids: Sequence[int], texts: Sequence[str], decode: Decode | None) -> list[str]:
    """Display strings for a run of tokens: partial UTF-8 pieces merged into the token completing them.

    A piece whose text holds "\ufffd" is joined with the following tokens (up to MAX_PIECES in
    all) until `decode` of the group is clean; the group's text then goes on its last token and
    the earlier pieces show "". A piece that cannot be completed (the reply so far ends in the
    middle of a character) keeps its own text.
    """
    out = list(texts)
    if decode is None:
        return out
    i = 0
    while i < len(ids):
        if PARTIAL not in texts[i]:
            i += 1
            continue
        for end in range(i + 2, min(i + MAX_PIECES, len(ids)) + 1):
            joined = decode(list(ids[i:end]))
            if PARTIAL not in joined:
                out[i : end - 1] = [""] * (end - 1 - i)
                out[end - 1] = joined
                i = end
                break
        else:
            i += 1
    return out


# Invisible characters a token may hold, shown as symbols: C0 controls (an ANSI escape, NUL) as control
# pictures (␛, ␀), C1 controls and bidi overrides/isolates as [U+XXXX], because a bare U+202E would flip the
# display order of the tokens after it (the "Trojan Source" trick). Newlines and tabs stay as they are.
_INVISIBLE = {
    **{c: chr(0x2400 + c) for c in range(32) if chr(c) not in "\n\t"},
    0x7F: "\u2421",
    **{c: f"[U+{c:04X}]" for c in range(0x80, 0xA0)},
    **{ord(c): f"[U+{ord(c):04X}]" for c in "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"},
}


def visible(text: str) -> str:
    """`text` with control and bidi-override characters replaced by visible symbols (not yet escaped)."""
    return text.translate(_INVISIBLE)


def _span(text: str, cls: str, title: str) -> str:
    shown = html.escape(visible(text), quote=True)
    return f'<span class="tok {cls}" title="{html.escape(visible(title), quote=True)}">{shown}</span>'


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


def block_html(ev: BlockEvent, keep: int | None = None, texts: Sequence[str] | None = None) -> str:
    """One event: accepted drafts, then rejected drafts (struck), then the target's token.

    `keep`: length of the final reply. A block may commit past max_new_tokens or past EOS;
    those tokens are cut from the reply, so they are marked TRIMMED rather than hidden.
    `texts`: display strings of the committed tokens (default: `ev.committed_text`); "" drops a
    span whose text is shown merged into a later token's.
    """
    first = ev.tokens_so_far - len(ev.committed)  # reply index of this event's first token
    shown = ev.committed_text if texts is None else texts

    def committed(j: int, cls: str, title: str) -> str:
        text = _text_of(shown, j)
        if texts is not None and not text and j < len(ev.committed_text):
            return ""  # a partial UTF-8 piece: its character shows on the token that completes it
        if texts is not None and j < len(ev.committed_text) and text != ev.committed_text[j]:
            title += " · shown with the byte pieces before it (one multi-byte character)"
        if keep is not None and first + j >= keep:
            cls, title = f"{cls} {TRIMMED}", f"{title} · past the end of the reply (trimmed)"
        return _span(text, cls, title)

    spans: list[str] = []
    parity = "blk-odd" if ev.index % 2 else "blk-even"
    if ev.is_draft_block:
        for i in range(ev.accepted):
            spans.append(committed(i, ACCEPTED, _draft_title(ev, i, "accepted")))
        for i in range(ev.accepted, ev.checked):
            spans.append(_span(_text_of(ev.draft_text, i), REJECTED, _draft_title(ev, i, "rejected")))
        kind = "bonus (all verified drafts accepted)" if ev.accepted == ev.checked else "correction"
        title = f"block {ev.index} · pos {ev.accepted + 1}/{ev.checked} · target {kind}"
        if ev.unverified:
            title += f" · {len(ev.unverified)} later drafts not verified (adaptive verify length)"
    else:
        kind = "prefill" if ev.index == 0 else "plain decoding"
        title = f"block {ev.index} · target token ({kind})"
    spans.append(committed(len(ev.committed) - 1, TARGET, title))
    return f'<span class="blk {parity}" data-block="{ev.index}">{"".join(spans)}</span>'


def render_view(events: Sequence[BlockEvent], keep: int | None = None, decode: Decode | None = None) -> str:
    """The whole reply so far. `white-space: pre-wrap` (style.css) keeps newlines and indents.

    `keep`: the final reply's token count, once known (see `block_html`). `decode`: the
    tokenizer's ids → text, to merge partial UTF-8 pieces (which may straddle blocks).
    """
    if not events:
        return f'<div class="spec-view">{LEGEND}{EMPTY}</div>'
    per_event: list[Sequence[str] | None] = [None] * len(events)
    if decode is not None:
        ids = [t for ev in events for t in ev.committed]
        texts = [_text_of(ev.committed_text, j) for ev in events for j in range(len(ev.committed))]
        merged = merge_partial(ids, texts, decode)
        at = 0
        for k, ev in enumerate(events):
            per_event[k] = merged[at : at + len(ev.committed)]
            at += len(ev.committed)
    body = "".join(block_html(ev, keep, per_event[k]) for k, ev in enumerate(events))
    return f'<div class="spec-view">{LEGEND}<div class="spec-tokens">{body}</div></div>'
