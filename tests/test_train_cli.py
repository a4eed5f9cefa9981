"""`python -m dflash_core train` end to end on the embedded target, tiny: generate, train, eval, resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port

from dflash_core.__main__ import main
from dflash_core.batch_invariant import cpu_has_bf16_units
from dflash_core.drafter import DFlashDrafter, init_weights, load_drafter
from dflash_core.drafter_config import check_fit, config_for_target
from dflash_core.train.batch import (
    HeadSubset,
    PaddedBatch,
    batch_forward,
    collate,
    context_features,
    features_and_final,
)
from dflash_core.train.recipe import IGNORE, build_blocks
from dflash_core.train.shards import iter_samples
from dflash_core.train.state import STATE_NAME

QUESTIONS = ["Say hi in French.", "Name three colours.", "What is the capital of Italy?"]
TRAIN_FLAGS = ["--batch-seqs", "2", "--anchors-per-seq", "4", "--num-layers", "1", "--block-size", "8",
               "--lr", "2e-3", "--warmup", "2", "--log-every", "4", "--holdout-percent", "0", "--threads", "2",
               "--no-progress"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, target) -> Path:
    """One CLI run: generate 3 replies, 16 steps of 2 padded sequences, eval 1 prompt per set."""
    root = tmp_path_factory.mktemp("train_cli")
    src = root / "prompts.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "prompt": q}) + "\n" for i, q in enumerate(QUESTIONS)))
    rc = main(["train", "--data", str(root / "data"), "--generate", "3", "--source", str(src),
               "--max-new-tokens", "14", "--out", str(root / "run"), "--steps", "16",
               "--init", "target-last", *TRAIN_FLAGS,
               "--eval-prompts", "humaneval,gsm8k", "--eval-limit", "1", "--eval-max-new-tokens", "6"])
    assert rc == 0
    return root


def test_train_generates_trains_and_reports(trained: Path, target) -> None:
    samples = list(iter_samples(trained / "data"))
    assert sorted(s["id"] for s in samples) == ["q0", "q1", "q2"]
    assert all(1 <= len(s["response_ids"]) <= 14 for s in samples)
    run = trained / "run"
    report = json.loads((run / "train_report.json").read_text())
    assert report["data"]["samples"] == 3 and report["data"]["generated"]["made"] == 3
    assert report["data"]["reply_tokens"] == sum(len(s["response_ids"]) for s in samples)
    assert report["train"]["steps"] == 16 and report["train"]["stop"] == "steps"
    assert report["train"]["init"] == "target-last"
    assert report["train"]["blocks_seen"] > 16  # several blocks per step: the batch holds 2 sequences
    assert len(report["train"]["acc"]) == 7 and all(0 <= a <= 1 for a in report["train"]["acc"])
    assert set(report["tau"]) == {"humaneval", "gsm8k"}
    for r in report["tau"].values():
        assert r["prompts"] == 1 and r["blocks"] >= 1 and 1.0 <= r["tau"] <= 8.0
    assert report["hardware"]["device"] == "cpu" and report["features"] == "cache"
    assert report["autocast"] == ("bfloat16" if cpu_has_bf16_units() else None)
    # On CPU the training head defaults to the frequent reply tokens: here all of them (3 tiny replies).
    assert report["train_vocab"]["coverage"] == 1.0
    assert report["train_vocab"]["size"] == len({t for s in samples for t in s["response_ids"]})
    log = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [4, 8, 12, 16]
    assert log[-1]["loss"] < 0.7 * log[0]["loss"]  # it learns its (tiny) training set
    drafter = load_drafter(run)
    assert drafter.config.block_size == 8 and drafter.config.num_hidden_layers == 1
    check_fit(drafter.config, hidden_size=target.hidden_size, vocab_size=target.vocab_size,
              num_layers=target.num_layers)
    assert drafter.fc.weight.dtype == torch.float32  # loaded as asked, saved as bf16
    state = torch.load(run / STATE_NAME, map_location="cpu", weights_only=False)
    assert state["step"] == 16
    for k, v in state["model"].items():  # the z-lab file is the bf16 copy of the fp32 state
        torch.testing.assert_close(drafter.state_dict()[k], v.to(torch.bfloat16).float())


@pytest.mark.parametrize("argv", [["--init", "target:29"], ["--init", "nonsense"], ["--partial-mask", "0.5"],
                                  ["--context-window", "8"], ["--fc-init", "mean"]])
def test_removed_or_unknown_training_options_exit_2(argv: list[str], capsys) -> None:
    assert main(["train", *argv]) == 2  # refused while parsing, before any model loads
    assert "error:" in capsys.readouterr().err


def test_resume_continues_step_and_optimizer(trained: Path) -> None:
    run = trained / "run"
    before = torch.load(run / STATE_NAME, map_location="cpu", weights_only=False)
    adam_steps = {int(s["step"]) for s in before["optimizer"]["state"].values()}
    assert adam_steps == {16}
    # Without --resume a used --out is refused (exit 2), not overwritten.
    assert main(["train", "--data", str(trained / "data"), "--out", str(run), "--steps", "20", *TRAIN_FLAGS,
                 "--eval-prompts", "none"]) == 2
    assert main(["train", "--data", str(trained / "data"), "--out", str(run), "--steps", "20", "--resume",
                 *TRAIN_FLAGS, "--eval-prompts", "none"]) == 0
    after = torch.load(run / STATE_NAME, map_location="cpu", weights_only=False)
    assert after["step"] == 20
    # Adam's per-parameter step counts continued from 16 (a fresh optimizer would say 4).
    assert {int(s["step"]) for s in after["optimizer"]["state"].values()} == {20}
    assert after["scheduler"]["last_epoch"] == 20
    report = json.loads((run / "train_report.json").read_text())
    assert report["resumed_from"] == 16 and report["train"]["steps_this_run"] == 4
    log = [json.loads(x)["step"] for x in (run / "log.jsonl").read_text().splitlines()]
    assert log[-1] == 20 and log.count(16) == 1


def test_max_minutes_stops_early(trained: Path) -> None:
    out = trained / "timed"
    assert main(["train", "--data", str(trained / "data"), "--out", str(out), "--steps", "100000",
                 "--max-minutes", "0.02", *TRAIN_FLAGS, "--eval-prompts", "none"]) == 0
    report = json.loads((out / "train_report.json").read_text())
    assert report["train"]["stop"] == "time" and 1 <= report["train"]["steps"] < 100000
    assert (out / "model.safetensors").is_file()
    assert load_drafter(out).config.block_size == 8


def test_repeated_folder_is_reported_and_carded(trained: Path) -> None:
    from dflash_core.train.card import main as card_main

    out = trained / "repeated"
    assert main(["train", "--data", f"{trained / 'data'}*3", "--out", str(out), "--steps", "2", *TRAIN_FLAGS,
                 "--eval-prompts", "none"]) == 0
    data = json.loads((out / "train_report.json").read_text())["data"]
    assert data["repeats"] == {str(trained / "data"): 3}
    assert data["train_samples"] == 3 and data["train_draws_per_epoch"] == 9
    assert card_main([str(out), "--to", str(trained / "shipped")]) == 0
    card = (trained / "shipped" / "MODEL_CARD.md").read_text()
    assert "- data folders: `data` ×3 per epoch" in card


def test_card_keeps_a_hand_written_lineage(trained: Path) -> None:
    """Rewriting a card keeps the old card's `## Lineage` section (heading to end), and only that."""
    from dflash_core.train.card import main as card_main

    dest = trained / "lineage"
    assert card_main([str(trained / "run"), "--to", str(dest)]) == 0
    fresh = (dest / "MODEL_CARD.md").read_text()
    assert "## Lineage" not in fresh and "see `docs/training.md`" in fresh
    lineage = "## Lineage\n\nWarm-started from an earlier run.\n\n- step one;\n- step two.\n"
    (dest / "MODEL_CARD.md").write_text("# An old card\n\n## Limits\n- stale\n\n" + lineage)
    assert card_main([str(trained / "run"), "--to", str(dest)]) == 0
    assert (dest / "MODEL_CARD.md").read_text() == fresh + "\n" + lineage
    assert card_main([str(trained / "run"), "--to", str(dest)]) == 0  # and again: kept once, not doubled
    assert (dest / "MODEL_CARD.md").read_text() == fresh + "\n" + lineage


def test_two_processes_stay_in_step(trained: Path) -> None:
    """`torchrun` / `accelerate launch` path on CPU (gloo): each process draws its own batches and
    gradients are averaged, so both replicas end with the same weights; only rank 0 writes."""
    out = trained / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "dflash_core", "train", "--data", str(trained / "data"), "--out", str(out),
           "--steps", "6", *TRAIN_FLAGS, "--threads", "1", "--eval-prompts", "none"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=Path(__file__).parent.parent)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((out / "train_report.json").read_text())
    t = report["train"]
    assert t["world_size"] == 2 and t["steps"] == 6
    digests = t["replica_weight_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]
    assert [json.loads(x)["step"] for x in (out / "log.jsonl").read_text().splitlines()] == [4, 6]  # rank 0 only
    assert load_drafter(out).config.block_size == 8
    assert res.stdout.count("[train] data:") == 1


def tiny_batch(target, drafter_seed: int, data_seed: int, vocab_hi: int, anchors: list[list[int]],
               lengths: tuple[int, ...]) -> tuple[DFlashDrafter, list[torch.Tensor], PaddedBatch, torch.Tensor]:
    """A 1-layer, B=8 drafter on target layers [2, 20], random sequences, their padded batch and its features."""
    cfg = config_for_target(target.config, num_layers=1, block_size=8, mask_token_id=0)
    cfg.target_layer_ids = [2, 20]
    drafter = init_weights(DFlashDrafter(cfg), seed=drafter_seed)
    g = torch.Generator().manual_seed(data_seed)
    seqs = [torch.randint(100, vocab_hi, (n,), generator=g) for n in lengths]
    batch = collate(list(zip(seqs, anchors, strict=True)), 8, 0)
    return drafter, seqs, batch, context_features(target, batch.ids, cfg.target_layer_ids)


def test_padded_batch_equals_one_sequence_forwards(target_fp32) -> None:
    """Right padding, dummy blocks and per-row positions change nothing: each row's loss in one
    padded forward equals that sequence's loss alone (the old one-sequence path)."""
    anchors = [[5, 12, 20], [3, 9, 30, 40, 44], [10]]  # different counts: the rows get dummy blocks
    drafter, seqs, batch, feats = tiny_batch(target_fp32, 3, 0, 5000, anchors, (30, 47, 19))
    cfg = drafter.config
    assert batch.ids.shape == (3, 44) and batch.mask.shape == (3, 1, 40, 44 + 40)
    out = batch_forward(drafter, target_fp32, batch, feats)
    num, den = out.row_loss(3)
    for r, (seq, a) in enumerate(zip(seqs, anchors, strict=True)):
        bb = build_blocks(seq, a, 8, 0)
        ctx = context_features(target_fp32, seq[None, : bb.context_len], cfg.target_layer_ids)
        with torch.no_grad():
            hidden = drafter.forward_train(ctx, target_fp32.embed(bb.input_ids[None]), bb.positions, bb.mask)
            ce = torch.nn.functional.cross_entropy(target_fp32.lm_head(hidden)[0].float(), bb.labels.clamp_min(0),
                                                   reduction="none")
            w = bb.weights * (bb.labels != IGNORE)
            ref = (ce * w).sum() / w.sum()
        torch.testing.assert_close(num[r] / den[r], ref, rtol=1e-4, atol=1e-4)
        assert float(den[r]) == pytest.approx(float(bb.weights.sum()))
    whole = float(out.loss().detach())
    assert whole == pytest.approx(float(num.sum() / den.sum()), rel=1e-5)


def test_head_subset_is_the_full_head_restricted(target_fp32) -> None:
    """The training-only head gives the full head's logits at the kept tokens, relabels targets
    into the subset, and drops (never mislabels) positions whose token is outside it."""
    drafter, seqs, batch, feats = tiny_batch(target_fp32, 5, 1, 400, [[4, 11, 25], [6, 20]], (40, 33))
    counts = torch.zeros(target_fp32.vocab_size)
    counts.index_add_(0, torch.cat(seqs), torch.ones(73))
    head = HeadSubset(counts, 30)  # fewer than the ~60 distinct tokens: some labels fall outside
    assert torch.equal(HeadSubset.from_replies(seqs, target_fp32.vocab_size, 30).keep, head.keep)
    given = HeadSubset.from_tokens(head.keep[:10], seqs, target_fp32.vocab_size)
    assert torch.equal(given.keep, head.keep[:10]) and 0 < given.coverage < head.coverage
    assert head.keep.shape[0] == 30 and 0 < head.coverage < 1
    assert counts[head.keep].min() >= counts[counts > 0].sort(descending=True).values[29]
    full = batch_forward(drafter, target_fp32, batch, feats)
    sub = batch_forward(drafter, target_fp32, batch, feats, head=head)
    inside = head.index[full.labels] >= 0
    assert 0 < int(inside.sum()) < full.labels.shape[0]
    torch.testing.assert_close(sub.logits, full.logits[inside][:, head.keep], rtol=1e-5, atol=1e-5)
    assert torch.equal(head.keep[sub.labels], full.labels[inside])
    assert torch.equal(sub.slots, full.slots[inside]) and torch.equal(sub.weights, full.weights[inside])


def test_distillation_learns_the_targets_own_next_token_distribution(target_fp32) -> None:
    """The teacher at each labelled position is the target's logits after the tokens before it
    (so on the target's own greedy reply its argmax is the label), the features read beside it
    are the context's, and the loss mixes the label's and the distribution's cross entropy."""
    prompt = torch.tensor(target_fp32.tokenizer("The three primary colours are")["input_ids"])
    with torch.no_grad():
        seq = target_fp32.model.generate(prompt[None], max_new_tokens=30, do_sample=False)[0]
    n = prompt.shape[0]
    anchors = [[n, n + 9, n + 20], [n + 3]]
    drafter, _, _, _ = tiny_batch(target_fp32, 4, 0, 400, [[5]], (10,))
    layers = drafter.config.target_layer_ids
    batch = collate([(seq, anchors[0]), (seq[: n + 14], anchors[1])], 8, 0)
    assert batch.ahead is not None and batch.ahead.shape == (2, batch.context_len + 7)
    feats, final = features_and_final(target_fp32, batch, layers)
    torch.testing.assert_close(feats, context_features(target_fp32, batch.ids, layers), rtol=1e-4, atol=1e-4)
    counts = torch.zeros(target_fp32.vocab_size).index_add_(0, seq, torch.ones(seq.shape[0]))
    counts[100:600] += 1  # a head of the reply's tokens and others
    outs = []
    for head in (None, HeadSubset(counts, 400)):
        out = batch_forward(drafter, target_fp32, batch, feats, head=head, final=final, distill=0.25)
        outs.append(out)
        assert out.teacher is not None and out.teacher.shape == out.logits.shape
        with torch.no_grad():
            ref = target_fp32.model(input_ids=seq[None]).logits[0]
        prev = batch.positions[batch.labels != IGNORE] - 1
        if head is None:
            torch.testing.assert_close(out.teacher, ref[prev], rtol=1e-3, atol=1e-3)
        assert torch.equal(out.teacher.argmax(-1), out.labels)  # the reply is the target's own greedy one
        hard = torch.nn.functional.cross_entropy(out.logits.float(), out.labels, reduction="none")
        soft = torch.nn.functional.cross_entropy(out.logits.float(), out.teacher.float().softmax(-1),
                                                 reduction="none")
        mix = ((0.75 * hard + 0.25 * soft) * out.weights).sum() / out.weights.sum()
        assert float(out.loss().detach()) == pytest.approx(float(mix.detach()), rel=1e-5)
        assert not torch.allclose(hard, soft)
    plain = batch_forward(drafter, target_fp32, batch, feats)
    assert plain.teacher is None
    torch.testing.assert_close(plain.logits, outs[0].logits)


def test_distillation_needs_online_features_and_a_share(tmp_path: Path, capsys) -> None:
    for flags, said in ((["--distill", "0.5", "--features", "cache"], "error: --distill needs --features online"),
                        (["--distill", "1.5", "--features", "online"], "error: --distill is a share of the loss")):
        assert main(["train", "--data", str(tmp_path / "none"), "--out", str(tmp_path / "run"), *flags]) != 0
        assert said in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_bf16_autocast_step_follows_fp32(target_fp32, monkeypatch) -> None:
    """A bf16-autocast training step (the CPU default where the CPU has bf16 units) computes the
    fp32 step's loss and gradient to bf16 precision, and the no-grad evaluation path runs under it
    (the drafter's MKL-packed fp32 matmuls step aside for autocast)."""
    from dflash_core.train import loop as train_loop

    drafter, _, batch, feats = tiny_batch(target_fp32, 7, 2, 5000, [[4, 12, 20], [6, 18]], (36, 29))
    grads = []
    for autocast in (None, torch.bfloat16):
        drafter.zero_grad(set_to_none=True)
        loss = batch_forward(drafter, target_fp32, batch, feats, autocast).loss()
        loss.backward()
        grads.append((float(loss.detach()), torch.cat([p.grad.flatten() for p in drafter.parameters()])))
    (loss32, g32), (loss16, g16) = grads
    assert loss16 == pytest.approx(loss32, rel=2e-2)
    assert float(torch.nn.functional.cosine_similarity(g32, g16, dim=0)) > 0.99
    with torch.no_grad():
        logits = batch_forward(drafter, target_fp32, batch, feats, torch.bfloat16).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    # --autocast: off is off, bf16 is bf16, auto follows the device and the CPU's bf16 units.
    assert train_loop.train_autocast("off", "cuda") is None
    assert train_loop.train_autocast("bf16", "cpu") == torch.bfloat16
    assert train_loop.train_autocast("auto", "cuda") == torch.bfloat16
    for fast in (False, True):
        monkeypatch.setattr(train_loop, "cpu_has_bf16_units", lambda fast=fast: fast)
        assert train_loop.train_autocast("auto", "cpu") == (torch.bfloat16 if fast else None)


def test_keep_draft_vocab_trains_against_the_warm_start_vocabulary(trained: Path, capsys) -> None:
    """A warm start keeps its draft vocabulary with --keep-draft-vocab (fine-tuning on a narrow
    slice of data would otherwise recount it), including tokens this run's data never uses."""
    import shutil

    from dflash_core.train.card import main as card_main
    from dflash_core.train.corpus import main as corpus_main

    warm = trained / "warm"
    shutil.copytree(trained / "run", warm)
    had = json.loads((warm / "draft_vocab.json").read_text())
    vocab = sorted(set(had[: len(had) // 2]) | {5, 6, 7})  # half the replies' tokens, plus unused ones
    (warm / "draft_vocab.json").write_text(json.dumps(vocab))
    assert corpus_main(["--data", str(trained / "data"), "--out", str(warm), "--no-progress"]) == 0
    table = (warm / "ngrams.npz").read_bytes()
    out = trained / "kept"
    assert main(["train", "--data", str(trained / "data"), "--out", str(out), "--steps", "2",
                 "--init", f"from:{warm}", "--keep-draft-vocab", *TRAIN_FLAGS, "--eval-prompts", "none"]) == 0
    assert json.loads((out / "draft_vocab.json").read_text()) == vocab
    assert torch.equal(load_drafter(out).draft_vocab, torch.tensor(vocab))
    tv = json.loads((out / "train_report.json").read_text())["train_vocab"]
    assert tv["size"] == len(vocab) and tv["source"] == str(warm) and 0 < tv["coverage"] < 1
    # The warm start's n-gram table (the target's statistics) travels with the run and is shipped.
    assert (out / "ngrams.npz").read_bytes() == table
    assert json.loads((out / "train_report.json").read_text())["ngrams"] == f"copied from {warm / 'ngrams.npz'}"
    # A resumed run finds the table already there, and its report still says where it came from.
    assert main(["train", "--data", str(trained / "data"), "--out", str(out), "--steps", "3", "--resume",
                 "--init", f"from:{warm}", "--keep-draft-vocab", *TRAIN_FLAGS, "--eval-prompts", "none"]) == 0
    resumed = json.loads((out / "train_report.json").read_text())
    assert resumed["resumed_from"] == 2 and resumed["ngrams"] == f"copied from {warm / 'ngrams.npz'}"
    assert (out / "ngrams.npz").read_bytes() == table
    shipped = trained / "kept-shipped"
    assert card_main([str(out), "--to", str(shipped)]) == 0
    assert f"`{warm}`'s draft vocabulary" in (shipped / "MODEL_CARD.md").read_text()
    assert (shipped / "ngrams.npz").read_bytes() == table and load_drafter(shipped).corpus is not None
    # Shipping a run without a table over that folder removes the stale one, and says so.
    (out / "ngrams.npz").unlink()
    assert card_main([str(out), "--to", str(shipped)]) == 0
    assert not (shipped / "ngrams.npz").exists()
    assert "has no ngrams.npz" in capsys.readouterr().err
    # Without a warm start there is no vocabulary to keep: refused, naming the flag.
    with pytest.raises(SystemExit, match="--keep-draft-vocab needs --init from:DIR"):
        main(["train", "--data", str(trained / "data"), "--out", str(trained / "kept2"), "--steps", "2",
              "--keep-draft-vocab", *TRAIN_FLAGS, "--eval-prompts", "none"])


def test_a_dflash1_run_trains_on_as_dflash2(trained: Path) -> None:
    """--arch dflash2 from a DFlash 1 run: the same layers, then convolutions and a selector that
    start neutral (the upgrade drafts as its origin) and learn; the run resumes as DFlash 2."""
    out = trained / "v2"
    assert main(["train", "--data", str(trained / "data"), "--out", str(out), "--steps", "4", "--arch", "dflash2",
                 "--init", f"from:{trained / 'run'}", *TRAIN_FLAGS, "--eval-prompts", "none"]) == 0
    d = load_drafter(out)
    assert d.config.version == 2 and json.loads((out / "config.json").read_text())["architectures"] == [
        "DFlash2DraftModel"]
    assert d.candidate_selector is not None and d.candidate_selector.hidden_projection.weight.abs().sum() > 0
    assert main(["train", "--data", str(trained / "data"), "--out", str(out), "--steps", "6", "--resume",
                 "--arch", "dflash2", "--init", f"from:{trained / 'run'}", *TRAIN_FLAGS, "--eval-prompts", "none"]) == 0
    assert json.loads((out / "train_report.json").read_text())["resumed_from"] == 4
    assert load_drafter(out).config.version == 2


def test_card_refresh_rewrites_only_the_benchmark_rows(tmp_path: Path) -> None:
    """`card --refresh` (what scripts/bench_readme.sh runs last): the shipped card's benchmark rows
    become the reports' rows and every other line stays as it was."""
    from dflash_core.train.card import _bench_rows
    from dflash_core.train.card import main as card_main

    root = Path(__file__).resolve().parent.parent
    card = (root / "assets" / "drafter" / "MODEL_CARD.md").read_text()
    stale = card.replace("| humaneval | 5 | 256 |", "| humaneval | 5 | 128 |")
    (tmp_path / "MODEL_CARD.md").write_text(stale + "| a row that is not the table's |\n")
    bench = [root / "bench" / "gsm8k.json"]
    assert card_main(["--refresh", str(tmp_path), "--bench", str(bench[0])]) == 0
    got = (tmp_path / "MODEL_CARD.md").read_text().splitlines()
    rows = _bench_rows(bench)
    lines = stale.splitlines()
    table = [i for i, line in enumerate(lines) if line.startswith(("| humaneval |", "| gsm8k |", "| mtbench-1 |"))]
    assert rows and table
    assert got == [*lines[: table[0]], *rows, *lines[table[-1] + 1 :], "| a row that is not the table's |"]
