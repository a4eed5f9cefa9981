"""A training prompt: what every prompt source (ShareGPT, code, maths, JSONL) yields."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    answer: str = ""  # the dataset's own reply to `text`, when it has one (see `answers.py`)
    # Earlier turns of the conversation, oldest first, as (role, text) with role "user" or
    # "assistant": empty for a first turn.
    history: tuple[tuple[str, str], ...] = ()

    def messages(self) -> list[dict[str, str]]:
        """The chat the target answers: the history, then this prompt."""
        return [*({"role": r, "content": t} for r, t in self.history), {"role": "user", "content": self.text}]
