"""Long chats: which part of a conversation goes to the model, so that prompt + reply fit its window.

The visitor keeps seeing the whole conversation; only what the model reads is trimmed. Whole
turns are dropped, oldest first (a turn = one user message and the reply to it), never the newest
user message: a cut inside a message would silently change what was asked. Room is kept for the
reply: `reply_room` = min(max new tokens, a quarter of the window), so a long chat still gets a
useful reply while a short max-new-tokens does not waste context.

`fit_history` is pure (messages and a token-counting callable in, a `Fitted` out), so it is tested
on the real tokenizer without generating; `begin_reply` wires it to a Session and an Engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflash_core.errors import DFlashError

from .inputs import clean_text
from .session import Message, Session

if TYPE_CHECKING:
    from dflash_core.config import GenerationConfig
    from dflash_core.engine import Engine, Event

Count = Callable[[list[Message]], int]  # messages → prompt tokens, chat template included
REPLY_SHARE = 4  # the reply's reserved room is at most 1/REPLY_SHARE of the window


class MessageTooLong(DFlashError):
    """The newest message alone (with the chat template and the reply's room) does not fit the window."""


def reply_room(window: int, max_new_tokens: int) -> int:
    """Tokens kept free for the reply: the requested length, capped at a quarter of the window."""
    return max(1, min(max_new_tokens, window // REPLY_SHARE))


@dataclass(frozen=True)
class Fitted:
    """The messages the model reads, and how many earlier turns were left out to fit."""

    messages: list[Message]
    dropped: int  # earlier turns (user message + its reply) left out
    prompt_tokens: int
    window: int
    room: int

    @property
    def note(self) -> str | None:
        """What the visitor is told when turns were left out; None when the whole chat fits."""
        if not self.dropped:
            return None
        turns = "turn was" if self.dropped == 1 else "turns were"
        return (f"long chat: the {self.dropped} earliest {turns} left out of what the model reads (they stay "
                f"visible here), so the remaining {self.prompt_tokens} prompt tokens + {self.room} kept for the "
                f"reply fit its {self.window}-token context window")


def _turn_starts(messages: Sequence[Message], first: int) -> list[int]:
    """Where a kept tail may begin: the first message after the system prompt, then every later user message."""
    return [first] + [i for i in range(first + 1, len(messages)) if messages[i]["role"] == "user"]


def fit_history(messages: Sequence[Message], count: Count, window: int, max_new_tokens: int) -> Fitted:
    """The longest tail of whole turns (leading system messages always kept) that fits with the reply's room.

    Raises MessageTooLong when even the newest user message alone does not fit. Fewer messages never
    take more tokens, so the cut is found by binary search: O(log turns) calls of `count`.
    """
    first = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    system, starts = list(messages[:first]), _turn_starts(messages, first)
    room = reply_room(window, max_new_tokens)
    sizes: dict[int, int] = {}

    def size(k: int) -> int:  # prompt tokens when the first k turns are left out
        if k not in sizes:
            sizes[k] = count(system + list(messages[starts[k]:]))
        return sizes[k]

    lo, hi = 0, len(starts)  # invariant: every k < lo overflows; k = hi would mean "nothing fits"
    while lo < hi:
        mid = (lo + hi) // 2
        if size(mid) + room <= window:
            hi = mid
        else:
            lo = mid + 1
    if lo == len(starts):
        raise _too_long(messages[-1]["content"], size(len(starts) - 1), window, room)
    kept = system + [dict(m) for m in messages[starts[lo]:]]
    return Fitted(kept, dropped=lo, prompt_tokens=size(lo), window=window, room=room)


def _too_long(text: str, tokens: int, window: int, room: int) -> MessageTooLong:
    fits = window - room
    chars = len(text) * fits // max(tokens, 1)  # the same characters-per-token as this message
    return MessageTooLong(
        f"This message is too long for the model: it needs {tokens} tokens (chat template included), but the "
        f"context window is {window} tokens and {room} are kept for the reply, so at most {fits} fit. "
        f"Shorten it to about {chars} characters and send it again.")


def count_tokens(engine: Engine) -> Count:
    return lambda messages: len(engine.prompt_ids(messages))


def begin_reply(session: Session, engine: Engine, text: str, cfg: GenerationConfig,
                plain: bool = False) -> tuple[list[Message], Iterator[Event]]:
    """Add the visitor's turn and start the engine on the part of the chat that fits its window.

    Returns the messages the model reads and the engine's (not yet started) event iterator. On any
    error the turn is taken back, so history stays a clean user/assistant alternation.
    """
    messages = session.begin(clean_text(text))
    session.greedy = cfg.greedy
    try:
        fitted = fit_history(messages, count_tokens(engine), engine.target.max_context, cfg.max_new_tokens)
        events = engine.generate(fitted.messages, cfg, plain=plain, cancel=session.cancel)
    except Exception:
        session.pop_last_turn()
        session.reply = None
        raise
    if fitted.note:
        session.notes.append(fitted.note)
    return fitted.messages, events
