"""Dataset answers labelled by the target (train/answers.py) and their exact block labels."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_core.train.answers import ID_SUFFIX, agreement, label_samples, main
from dflash_core.train.batch import collate
from dflash_core.train.data import generate_batch
from dflash_core.train.features import build_features, cache_dir, load_feature_file, sequence_features
from dflash_core.train.recipe import IGNORE, build_blocks
from dflash_core.train.samples import is_heldout, load_samples
from dflash_core.train.shards import iter_samples

B, MASK = 4, 0


def test_greedy_labels_follow_the_target_until_the_text_leaves_it() -> None:
    ids = torch.arange(10, 30)
    greedy = ids.clone()
    greedy[8] = 99  # the text has 18 at position 8, the target would have written 99
    bb = build_blocks(ids, [6, 7, 17], B, MASK, greedy=greedy)
    # anchor 6: 17 (agreed), then the target's 99 at 8, then nothing: the target never read 18 at 8
    # anchor 7: the target's 99 right away, nothing after; anchor 17: as the text, up to its end
    assert bb.labels.tolist() == [IGNORE, 17, 99, IGNORE, IGNORE, 99, IGNORE, IGNORE, IGNORE, 28, 29, IGNORE]
    assert (bb.weights[bb.labels == IGNORE] == 0).all() and (bb.weights[bb.labels != IGNORE] > 0).all()
    # inputs do not change: the anchor is the text's token, the rest masks
    assert bb.input_ids.tolist() == build_blocks(ids, [6, 7, 17], B, MASK).input_ids.tolist()


def test_greedy_equal_to_the_text_changes_nothing() -> None:
    ids = torch.randint(1, 50, (40,))
    plain = build_blocks(ids, [3, 10, 37], B, MASK)
    same = build_blocks(ids, [3, 10, 37], B, MASK, greedy=ids.clone())
    assert torch.equal(plain.labels, same.labels) and torch.equal(plain.weights, same.weights)
    rows = collate([(ids, [3, 10]), (ids[:20], [5], ids[:20].clone())], B, MASK)
    assert rows.labels[1, :B].tolist() == [IGNORE, *ids[6:9].tolist()]


def test_labels_of_the_targets_own_reply_and_of_an_edited_one(target_fp32) -> None:
    # float32: labelling runs one whole pass, generation one token at a time; in bf16 those round
    # differently (only the verify path is batch-invariant), so a near-tie could split them.
    target = target_fp32
    prompt = target.encode_chat([{"role": "user", "content": "Name three colours."}])
    reply = generate_batch(target, [prompt], [0.0], 12, target.eos_ids, 2)[0]
    assert len(reply) >= 6
    edited = list(reply)
    edited[3] = (reply[3] + 1) % target.vocab_size  # leave the target's path at answer position 3
    samples, feats = label_samples(target, [("own", prompt, reply), ("edited", prompt, edited)], [1, 27])
    own, ed = samples
    assert own["greedy_ids"] == reply  # the target agrees with itself everywhere
    assert agreement([own]) == 1.0
    # Before the edit the context is the same, so are the choices; at 3 the target still wants its token.
    assert ed["greedy_ids"][:4] == reply[:4]
    assert agreement([ed]) < 1.0
    # The features come from the same forward as plain feature extraction.
    ref = sequence_features(target, [prompt + reply, prompt + edited], [1, 27])
    for got, want in zip(feats, ref, strict=True):
        assert got.shape == want.shape and torch.allclose(got.float(), want.float(), atol=1e-2)


def test_answers_cli_writes_resumable_shards_and_reusable_features(tmp_path: Path, target) -> None:
    src = tmp_path / "qa.jsonl"
    rows = [{"id": f"q{i}", "prompt": f"What is {i} plus {i}?", "answer": f"{i} plus {i} is {2 * i}."}
            for i in range(5)]
    rows.append({"id": "html", "prompt": "Say hi.", "answer": "<div><p>Hi</p></div>"})
    rows.append({"id": "none", "prompt": "Say bye."})
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, cache = tmp_path / "answers", tmp_path / "feats"
    common = ["--out", str(out), "--source", str(src), "--shard-size", "2", "--features-cache", str(cache),
              "--layers", "1,27"]
    main([*common, "--limit", "3"])
    first = list(iter_samples(out))
    assert len(first) == 3
    main([*common])  # every remaining usable answer
    got = list(iter_samples(out))
    assert [s["id"] for s in got[:3]] == [s["id"] for s in first]
    assert sorted(s["id"] for s in got) == [f"q{i}{ID_SUFFIX}" for i in range(5)]  # no HTML, no empty answer
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["samples"] == 5 and manifest["prompt_filter"]["skipped"] == 1
    assert manifest["prompt_filter"]["no_answer"] == 1 and 0 < manifest["agreement"] <= 1
    assert manifest["label_dtypes"] == {"float32": 5}  # which precision labelled them, for the card
    for s in got:
        assert len(s["greedy_ids"]) == len(s["response_ids"]) and s["response_ids"][-1] in target.eos_ids
    # Training's feature pass finds every shard done (same layers, same ids) and rewrites nothing.
    feats_dir = cache_dir(cache, out)
    stamps = {f: f.stat().st_mtime_ns for f in sorted(feats_dir.glob("feats-*.safetensors"))}
    assert len(stamps) == len(manifest["shards"])
    build_features(target, out, feats_dir, [1, 27], progress=False)
    assert {f: f.stat().st_mtime_ns for f in feats_dir.glob("feats-*.safetensors")} == stamps
    seq = load_feature_file(next(iter(stamps)))[0]
    assert seq.feats.shape == (len(seq.ids), 2 * 576)
    # Training reads the target's choices aligned with the positions they are for.
    samples = load_samples([out])
    by_id = {s["id"]: s for s in got}
    for s in samples:
        assert s.greedy is not None and s.greedy[s.prompt_len:].tolist() == by_id[s.id]["greedy_ids"]
    assert is_heldout("abc" + ID_SUFFIX, 50) == is_heldout("abc", 50)


def test_train_on_answers_learns_the_targets_choices(tmp_path: Path, target) -> None:
    from dflash_core.__main__ import main as cli

    src = tmp_path / "qa.jsonl"
    rows = [{"id": "a", "prompt": "Say hi in French.", "answer": "Salut ! Comment vas-tu aujourd'hui, mon ami ?"},
            {"id": "b", "prompt": "Name a colour.", "answer": "Turquoise, like a tropical lagoon at noon."}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(["--out", str(tmp_path / "answers"), "--source", str(src)])
    samples = list(iter_samples(tmp_path / "answers"))
    assert cli(["train", "--data", str(tmp_path / "answers"), "--out", str(tmp_path / "run"), "--steps", "4",
                "--batch-seqs", "2", "--anchors-per-seq", "4", "--num-layers", "1", "--block-size", "8",
                "--holdout-percent", "0", "--threads", "2", "--no-progress", "--eval-prompts", "none"]) == 0
    report = json.loads((tmp_path / "run" / "train_report.json").read_text())
    assert report["data"]["answer_samples"] == 2 and report["train"]["steps"] == 4
    # The training head is built from what training predicts: the target's choices, not the text.
    chosen = {t for s in samples for t in s["greedy_ids"]}
    assert chosen != {t for s in samples for t in s["response_ids"]}
    assert report["train_vocab"]["size"] == len(chosen)
