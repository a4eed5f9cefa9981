"""`python -m dflash_core train`: data top-up, drafter training, real speculative evaluation.

One command, so a short GPU lease is one call:

1. optionally regenerate N more replies with the target (`--generate`, batched; time-boxed);
2. train with several sequences per step (`batch.py`): ONLINE target features (the frozen
   target reads the padded batch each step) or the disk feature cache (`features.py`);
   AdamW, warm-up + cosine, grad clip, bf16 autocast where the hardware has bf16 units; stops at
   `--steps` or when `--max-minutes` of training have passed (`--steps 0`: as many as the time
   allows, with the cosine schedule fitted to the measured step time);
3. measures tau with REAL speculative decoding (`Engine.generate`, temperature 0) on held-out
   prompt sets (HumanEval/GSM8K were removed from the training prompts);
4. writes the z-lab checkpoint (config.json + model.safetensors) into `--out`, plus
   `train_report.json`, `log.jsonl` and `train_state.pt` (fp32 weights + optimizer, for `--resume`).

The options are in `args.py`, the samples in `samples.py`, the saved state in `state.py`, the
loop in `loop.py` and the measurements in `evaluate.py`; this module runs them in order.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..drafter import DFlashDrafter
from ..errors import DFlashError
from .batch import HeadSubset
from .dist import Dist, init_dist
from .evaluate import evaluate_into, summary_table
from .loop import LoopResult, Trainer, train_autocast, train_loop
from .recipe import bigram_accuracy, expected_accepted
from .samples import Sample, TrainData, attach_cached_features, parse_data_folders, prepare_data
from .state import STATE_NAME, Position, carry_corpus, make_drafter, make_optimizer, resume_into, warm_start_vocab

REPORT_NAME = "train_report.json"


@dataclass
class Run:
    """This process's part in the run: where it writes, what it computes on, whether it speaks."""

    dd: Dist
    device: str
    out: Path
    on_cuda: bool
    features: str  # "online" or "cache"
    autocast: torch.dtype | None
    progress: bool

    def say(self, *args: Any, **kwargs: Any) -> None:
        if self.dd.main:
            print(*args, **kwargs)


def start_run(args: argparse.Namespace) -> Run:
    """Join the processes (if launched as several), check the flags, and make the output folder."""
    from ..targets import default_device

    # Under `accelerate launch` / `torchrun`: one process per device, gradients averaged each step;
    # only rank 0 logs, saves and evaluates.
    dd, device = init_dist(args.device or default_device())
    if dd.world > 1 and args.generate:
        raise DFlashError("--generate runs in a single process: top up the data first, then launch the training")
    if args.threads:
        torch.set_num_threads(args.threads)
    on_cuda = str(device).startswith("cuda")
    if on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 target: TF32 tensor cores, ~fp32 features
        torch.backends.cudnn.allow_tf32 = True
    out = Path(args.out)
    if (out / STATE_NAME).exists() and not args.resume:
        raise DFlashError(f"{out} holds a training run; pass --resume to continue it, or choose another --out")
    if args.steps < 0 or (args.steps == 0 and not args.max_minutes):
        raise DFlashError("--steps 0 (as many as the time allows) needs --max-minutes")
    if args.batch_seqs < 1 or args.anchors_per_seq < 1:
        raise DFlashError("--batch-seqs and --anchors-per-seq must be >= 1")
    if not 0.0 <= args.distill <= 1.0:
        raise DFlashError(f"--distill is a share of the loss, between 0 and 1; got {args.distill}")
    features = args.features if args.features != "auto" else ("online" if on_cuda else "cache")
    if args.distill > 0 and features != "online":
        raise DFlashError("--distill needs --features online: the target's distribution after each labelled "
                          "position is computed with the features, and the disk cache keeps features only")
    run = Run(dd, device, out, on_cuda, features, train_autocast(args.autocast, device),
              progress=not args.no_progress and dd.main)
    out.mkdir(parents=True, exist_ok=True)
    return run


def load_frozen_target(args: argparse.Namespace, run: Run) -> tuple[Any, dict[str, Any]]:
    """The target, its weights frozen, and the report it starts."""
    from ..targets import load_target

    target = load_target(args.target, device=run.device, dtype=args.dtype)
    for p in target.model.parameters():
        p.requires_grad_(False)
    report: dict[str, Any] = {"command": sys.argv, "target": target.name,
                              "target_dtype": str(target.dtype).removeprefix("torch."), "features": run.features,
                              "autocast": None if run.autocast is None else "bfloat16"}
    return target, report


def carry_ngrams(args: argparse.Namespace, run: Run, report: dict[str, Any]) -> None:
    carried = carry_corpus(args.init, run.out) if run.dd.main else None
    if carried is not None:
        report["ngrams"] = f"copied from {carried}"
        run.say(f"[train] n-gram table copied from {carried} (the target's statistics: they stay valid)", flush=True)


def cache_features(args: argparse.Namespace, run: Run, target: Any, samples: list[Sample], folders: list[Path],
                   layer_ids: list[int], report: dict[str, Any]) -> None:
    """Cache mode: rank 0 builds the feature files (the others then only read them)."""
    t0 = time.time()
    if not run.dd.main:
        run.dd.barrier()
    cache_root = Path(args.feature_cache) if args.feature_cache else run.out / "features"
    attach_cached_features(target, samples, [f for f in folders if f.exists()], cache_root, layer_ids, run.progress)
    if run.dd.main:
        run.dd.barrier()
    report["feature_cache_s"] = round(time.time() - t0, 1)


def training_head(args: argparse.Namespace, run: Run, drafter: DFlashDrafter, data: TrainData, vocab_size: int,
                  report: dict[str, Any]) -> HeadSubset | None:
    """The tokens the training step scores (None: all), which the checkpoint then drafts from."""
    head = None
    labels = [s.label_tokens for s in data.train]
    train_vocab = args.train_vocab if args.train_vocab >= 0 else (0 if run.on_cuda else 8192)
    if args.keep_draft_vocab:
        head = HeadSubset.from_tokens(warm_start_vocab(args.init, vocab_size), labels, vocab_size)
    elif train_vocab:
        head = HeadSubset.from_replies(labels, vocab_size, train_vocab)
    if head is not None:
        drafter.draft_vocab = head.keep.clone()  # saved with the checkpoint: inference drafts from it too
        source = args.init.removeprefix("from:") if args.keep_draft_vocab else "most frequent reply tokens"
        report["train_vocab"] = {"size": int(head.keep.shape[0]), "coverage": round(head.coverage, 5),
                                 "source": source}
        run.say(f"[train] training head: {head.keep.shape[0]} tokens ({source}; {head.coverage:.2%} of reply "
                "tokens)", flush=True)
    return head


def make_trainer(args: argparse.Namespace, run: Run, target: Any, drafter: DFlashDrafter, layer_ids: list[int],
                 head: HeadSubset | None, resumed: dict[str, Any] | None, report: dict[str, Any]) -> Trainer:
    """The optimizer and schedule, continued from the saved state under `--resume`."""
    position = Position(total_steps=args.steps or 10**9)
    opt, sched = make_optimizer(args, drafter, position, fused=run.on_cuda)
    if resumed:
        resume_into(resumed, opt, sched, position, fitted_length=not args.steps)
        report["resumed_from"] = position.step
        run.say(f"[train] resumed at step {position.step} from {run.out / STATE_NAME}", flush=True)
    if args.steps and position.step >= args.steps:
        run.say(f"[train] already at step {position.step} >= --steps {args.steps}; evaluating only", flush=True)
    # Every command that shaped these weights, so a resumed run's report still names the first one.
    commands = [*(resumed or {}).get("commands", []), sys.argv]
    report["commands"] = commands
    if resumed and resumed.get("ngrams") and "ngrams" not in report:
        report["ngrams"] = resumed["ngrams"]  # copied by the first run; the state remembers from where
    info_base = {"layer_ids": layer_ids, "args": {k: v for k, v in vars(args).items() if k != "func"},
                 "commands": commands, "ngrams": report.get("ngrams")}
    return Trainer(args, run.dd, target, drafter, layer_ids, head, run.autocast, opt, sched, position, info_base)


def train_entry(args: argparse.Namespace, run: Run, t: Trainer, result: LoopResult, init: str,
                digests: list[str], resumed_from: int) -> dict[str, Any]:
    """The report's `train` entry."""
    pos = t.position
    steps_this_run = pos.step - resumed_from
    return {
        "steps": pos.step, "steps_this_run": steps_this_run, "stop": result.stop, "blocks_seen": pos.blocks_seen,
        "loop_seconds": round(result.seconds, 1), "train_seconds_total": round(pos.train_seconds, 1),
        "ms_per_step": round(result.seconds / max(steps_this_run, 1) * 1e3, 1), "batch_seqs": args.batch_seqs,
        "anchors_per_seq": args.anchors_per_seq, "block_size": args.block_size, "num_layers": args.num_layers,
        "layer_ids": t.layer_ids, "lr": args.lr, "init": init,
        "acc": [round(a, 4) for a in (result.hits.float() / result.counts.clamp_min(1).float())[1:].tolist()],
        "tau_est": round(expected_accepted(result.hits, result.counts), 4), "world_size": run.dd.world,
        "replica_weight_digests": digests,
    }


def run_train(args: argparse.Namespace) -> int:
    t_start = time.time()
    run = start_run(args)
    folders, repeats = parse_data_folders(args.data)
    target, report = load_frozen_target(args, run)
    carry_ngrams(args, run, report)

    data = prepare_data(args, target, folders, repeats, run.on_cuda, run.progress)
    report["data"] = data.report
    run.say(f"[train] data: {len(data.samples)} samples ({data.report['reply_tokens']} reply tokens), "
            f"{len(data.held)} held out", flush=True)

    drafter, layer_ids, resumed = make_drafter(args, target, run.out, run.say)
    drafter = drafter.to(target.device, torch.float32).train()  # fp32 master weights; autocast for speed
    init = args.init if not resumed else resumed.get("args", {}).get("init", "?")
    # Held-out accuracy on the target's own replies where there are some: what inference sees.
    held_eval = ([s for s in data.held if s.greedy is None] or data.held)[: args.eval_seqs]
    if run.features == "cache":
        cache_features(args, run, target, data.train + held_eval, folders, layer_ids, report)
    head = training_head(args, run, drafter, data, target.vocab_size, report)
    if held_eval:
        report["bigram_acc1"] = round(bigram_accuracy(data.train, held_eval), 4)

    trainer = make_trainer(args, run, target, drafter, layer_ids, head, resumed, report)
    result = train_loop(trainer, data.train, held_eval, report, run.out, run.progress, run.say)
    trainer.position.train_seconds += result.seconds
    digests = run.dd.weight_digests(drafter)
    if not run.dd.main:
        run.dd.close()
        return 0
    trainer.save(run.out)
    report["train"] = train_entry(args, run, trainer, result, init, digests, int(report.get("resumed_from", 0)))
    print(f"[train] {report['train']['steps_this_run']} steps in {result.seconds:.0f}s (stop: {result.stop}); "
          f"checkpoint in {run.out}", flush=True)

    evaluate_into(report, drafter, target, held_eval, args, layer_ids, run.progress)
    report["wall_seconds"] = round(time.time() - t_start, 1)
    report["args"] = trainer.info_base["args"]
    (run.out / REPORT_NAME).write_text(json.dumps(report, indent=1) + "\n")
    print(summary_table(report))
    run.dd.close()
    return 0
