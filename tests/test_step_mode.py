"""Step mode on the real embedded target: N clicks commit exactly what one full generation commits."""

from __future__ import annotations

import copy
import pickle

import pytest

from app import step
from app.session import Session
from dflash_core.config import GenerationConfig
from dflash_core.engine import Engine
from dflash_core.events import BlockEvent, Finished

pytestmark = pytest.mark.slow

PROMPT = "Write a Python function that adds two numbers."
BLOCK = 4  # small blocks keep each verify forward cheap on CPU
MAX_NEW = 8


def full_run(engine: Engine, cfg: GenerationConfig, plain: bool = False) -> tuple[list[BlockEvent], Finished]:
    *events, fin = engine.generate(PROMPT, cfg, plain=plain)
    assert isinstance(fin, Finished)
    return events, fin


def step_through(engine: Engine, cfg: GenerationConfig) -> tuple[Session, list[step.StepResult]]:
    session = Session()
    step.start(session, engine, PROMPT, cfg)
    results = []
    while session.stepper is not None:
        results.append(step.advance(session))
        assert len(results) <= MAX_NEW + 2, "step mode does not terminate"
    return session, results


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_clicks_commit_exactly_the_tokens_of_one_full_generation(engine: Engine, temperature: float) -> None:
    cfg = GenerationConfig(max_new_tokens=MAX_NEW, block_size=BLOCK, temperature=temperature, seed=3)
    events, fin = full_run(engine, cfg)
    session, results = step_through(engine, cfg)

    stepped = [t for r in results for ev in r.events for t in ev.committed]
    assert stepped == [t for ev in events for t in ev.committed]
    assert results[-1].finished is not None and results[-1].finished.token_ids == fin.token_ids
    # One drafted block per click (the prefill rides along with the first), then the click that finds the end.
    assert [sum(ev.is_draft_block for ev in r.events) for r in results[:-1]] == [1] * (len(results) - 1)
    assert len(results) - 1 == sum(ev.is_draft_block for ev in events)
    assert results[0].events[0].index == 0  # the prefill token
    assert session.history[-1] == {"role": "assistant", "content": fin.text}
    assert session.reply is None and session.dflash.finished is results[-1].finished
    if temperature == 0.0:
        _, plain = full_run(engine, cfg, plain=True)
        assert fin.token_ids == plain.token_ids  # and that is plain greedy decoding, token for token
        assert len(fin.token_ids) == MAX_NEW


def test_new_prompt_clear_and_copies_discard_the_suspended_generator(engine: Engine) -> None:
    cfg = GenerationConfig(max_new_tokens=MAX_NEW, block_size=BLOCK)
    session = Session()
    step.start(session, engine, PROMPT, cfg)
    step.advance(session)
    step.advance(session)
    gen = session.stepper
    assert gen is not None and gen.gi_frame is not None  # suspended mid-reply
    partial = session.reply
    assert partial

    # The visitor's state is copied (gradio) or pickled (ZeroGPU): the copy has no live generator.
    assert copy.deepcopy(session).stepper is None
    clone = pickle.loads(pickle.dumps(session))
    assert clone.stepper is None and clone.events == session.events

    # A new prompt closes the generator and keeps the partial reply as the answer, like Stop.
    session.begin("Another question")
    assert session.stepper is None and gen.gi_frame is None  # closed, not just dropped
    assert [m["role"] for m in session.history] == ["user", "assistant", "user"]
    assert session.history[1]["content"] == partial

    step.start(session, engine, PROMPT, cfg)  # ends the unanswered turn's reply, starts a new one
    step.advance(session)
    gen = session.stepper
    session.reset()  # Clear: everything goes, the generator is closed
    assert session.stepper is None and gen.gi_frame is None and session.history == []
    assert step.advance(session).events == []  # nothing to step: a no-op, not an error
