"""Per-visitor state: the plain-text conversation and the per-block numbers behind the charts.

Nothing here touches torch: the engine's events are plain dataclasses, and the history fed
back to the model is plain text, never the coloured HTML.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from dflash_core.events import BlockEvent, Finished, tau

Message = dict[str, str]


@dataclass
class BlockStat:
    """One engine event reduced to the numbers the charts need."""

    index: int
    block_size: int  # B for a draft block; 1 for the prefill token and plain-decoding steps
    accepted: int  # draft tokens the target kept
    committed: int  # tokens the event added to the reply
    draft_ms: float
    verify_ms: float
    tokens: int  # reply length after the event
    engine_s: float  # cumulative engine time (prefill + draft + verify) at the end of the event
    verified: int = 1  # tokens in the block's verify pass (anchor + verified drafts); 1 without a draft


@dataclass
class RunStats:
    """One decoding run (DFlash or plain) of one reply.

    Speed is measured on engine time (the sum of the events' draft and verify times, prefill
    included), not on wall time: the UI renders between blocks while the engine's generator is
    suspended, and that rendering must not count against DFlash in the comparison.
    """

    blocks: list[BlockStat] = field(default_factory=list)
    finished: Finished | None = None

    def add(self, ev: BlockEvent) -> BlockStat:
        prev = self.blocks[-1].engine_s if self.blocks else 0.0
        stat = BlockStat(
            index=ev.index, block_size=len(ev.draft) + 1, verified=ev.pass_tokens, accepted=ev.accepted,
            committed=len(ev.committed),
            draft_ms=ev.draft_ms, verify_ms=ev.verify_ms, tokens=ev.tokens_so_far,
            engine_s=prev + (ev.draft_ms + ev.verify_ms) / 1e3,
        )
        self.blocks.append(stat)
        return stat

    @property
    def draft_blocks(self) -> list[BlockStat]:
        return [b for b in self.blocks if b.block_size > 1]

    @property
    def tokens(self) -> int:
        # The final reply may be shorter than what was committed (a block can overshoot
        # max_new_tokens or run past EOS), so prefer the trimmed count once it is known.
        if self.finished is not None:
            return len(self.finished.token_ids)
        return self.blocks[-1].tokens if self.blocks else 0

    @property
    def engine_s(self) -> float:
        return self.blocks[-1].engine_s if self.blocks else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.engine_s if self.engine_s > 0 else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens committed per draft block (accepted + 1), as in the DFlash paper."""
        return tau(b.accepted for b in self.draft_blocks)

    @property
    def draft_share(self) -> float:
        """Fraction of draft+verify time spent drafting (prefill excluded)."""
        d = sum(b.draft_ms for b in self.draft_blocks)
        v = sum(b.verify_ms for b in self.draft_blocks)
        return d / (d + v) if d + v > 0 else 0.0


def survival(blocks: Sequence[BlockStat], positions: int) -> list[int]:
    """For k = 1..positions: how many of the draft `blocks` kept at least k drafts, i.e. whose
    draft survived to position k. Divided by len(blocks) these are the per-position acceptance
    rates serving engines log, and they sum to τ − 1 (the mean accepted drafts)."""
    return [sum(b.accepted >= k for b in blocks) for k in range(1, positions + 1)]


class Session:
    """One visitor's chat. Stored in a gr.State, so it must survive `deepcopy`.

    The cancel flag lives here so the Stop handler (a separate, unqueued-in-practice event of
    the same visitor) can reach the running generation; a `threading.Event` cannot be deep
    copied, hence the custom `__deepcopy__`.

    Step mode keeps the engine's suspended generator here between "Next block" clicks. A live
    generator can be neither copied nor pickled, so copies and pickles (ZeroGPU ships handler
    arguments to a worker process) leave it out: such a copy simply has no reply in progress.
    """

    _NOT_COPIED = ("cancel", "stepper")

    def __init__(self) -> None:
        self.history: list[Message] = []  # completed turns, plain text
        self.reply: str | None = None  # the assistant reply being streamed, if any
        self.events: list[BlockEvent] = []  # events of the latest reply
        self.earlier: list[BlockStat] = []  # draft blocks of the replies before it, since Clear
        self.dflash = RunStats()
        self.plain: RunStats | None = None  # the plain-decoding race, when asked for
        self.plain_text = ""  # the racing plain reply so far
        self.notes: list[str] = []  # per-reply warnings (e.g. max_new_tokens lowered)
        self.greedy = True  # whether the latest reply decoded greedily (exact token match expected)
        self.cancel = threading.Event()
        # When the visitor last pressed Stop, and when their last reply ended (monotonic seconds):
        # a Stop newer than the last reply's end was meant for a reply still waiting in the queue.
        self.stopped_at = 0.0
        self.idle_since = 0.0
        self.stepper: Iterator[BlockEvent | Finished] | None = None  # step mode's suspended generation

    def __deepcopy__(self, memo: dict[int, object]) -> Session:
        new = Session()
        for name, value in self.__dict__.items():
            if name not in self._NOT_COPIED:
                setattr(new, name, copy.deepcopy(value, memo))
        return new

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in self._NOT_COPIED}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()
        self.__dict__.update(state)

    # ----- the conversation -----

    def begin(self, user_text: str) -> list[Message]:
        """Start a reply to `user_text`; returns the plain-text messages to send to the model."""
        self.close_step()  # a new prompt ends a stepped reply (kept as it stands, like Stop)
        self.earlier.extend(self.dflash.draft_blocks)
        self.history.append({"role": "user", "content": user_text})
        self.reply = ""
        self.events = []
        self.dflash = RunStats()
        self.plain = None
        self.plain_text = ""
        self.notes = []
        if not self.stopped_while_queued:
            self.cancel.clear()  # a Stop of an earlier reply; one pressed while this one waited stands
        return [dict(m) for m in self.history]

    def request_stop(self, queued: bool = False) -> None:
        """The Stop button: halts a running reply within a block; `queued` (a reply of this visitor
        still waits its turn) makes that reply stop as soon as it starts."""
        if queued:
            self.stopped_at = time.monotonic()
        self.cancel.set()

    @property
    def stopped_while_queued(self) -> bool:
        return self.cancel.is_set() and self.stopped_at > self.idle_since

    def on_event(self, ev: BlockEvent) -> None:
        self.events.append(ev)
        self.dflash.add(ev)
        self.reply = ev.text

    def on_plain(self, ev: BlockEvent | Finished) -> None:
        """An event of the plain-decoding run racing the reply (ui.run_reply starts it)."""
        if self.plain is None:
            self.plain = RunStats()
        if isinstance(ev, Finished):
            self.plain.finished = ev
        else:
            self.plain.add(ev)
        self.plain_text = ev.text

    @property
    def dflash_text(self) -> str:
        """The DFlash reply as it stands: streaming, or finished."""
        fin = self.dflash.finished
        return fin.text if fin is not None else (self.reply or "")

    def finish(self, fin: Finished) -> None:
        """Commit the reply (even a cancelled, partial one: it is what the visitor saw)."""
        self.dflash.finished = fin
        self.notes.extend(fin.warnings)
        self.reply = None
        self.history.append({"role": "assistant", "content": fin.text})

    def abort(self) -> None:
        """The reply ended (or failed before finishing): keep what streamed so far as the answer."""
        self.idle_since = time.monotonic()
        if self.reply is not None:
            self.history.append({"role": "assistant", "content": self.reply})
            self.reply = None

    def close_step(self, keep: bool = True) -> None:
        """End step mode's suspended generation, if any. `keep`: keep the partial reply in history.

        `close()` raises GeneratorExit inside the engine's loop, so it stops where it is and
        its KV caches are freed now rather than whenever the generator is collected.
        """
        if self.stepper is None:
            return
        stepper, self.stepper = self.stepper, None
        stepper.close()
        if keep:
            self.abort()

    def pop_last_turn(self) -> str | None:
        """Remove the last user turn (and its reply) for Regenerate; returns the user's text."""
        self.close_step()
        if self.history and self.history[-1]["role"] == "assistant":
            self.history.pop()
        if self.history and self.history[-1]["role"] == "user":
            return self.history.pop()["content"]
        return None

    def reset(self) -> None:
        """Clear in place: a running generation's handler holds this same object."""
        self.close_step(keep=False)
        cancel, stopped_at = self.cancel, self.stopped_at
        self.__init__()
        self.cancel, self.stopped_at, self.idle_since = cancel, stopped_at, time.monotonic()

    def chat_messages(self) -> list[Message]:
        """What the gr.Chatbot shows: plain text, rendered as markdown by the chatbot."""
        msgs = [dict(m) for m in self.history]
        if self.reply is not None:
            msgs.append({"role": "assistant", "content": self.reply})
        return msgs

    @property
    def all_draft_blocks(self) -> list[BlockStat]:
        """Every draft block since Clear: earlier replies' (a regenerated one's too), then this one's."""
        return [*self.earlier, *self.dflash.draft_blocks]

    def event(self, index: int) -> BlockEvent | None:
        """The latest reply's event with block number `index` (0: the prefill token)."""
        return next((ev for ev in self.events if ev.index == index), None)

    @property
    def current_block(self) -> BlockEvent | None:
        """The latest event that has a draft, for the denoising heatmap."""
        for ev in reversed(self.events):
            if ev.steps:
                return ev
        return None
