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
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import platform
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..corpus import FILE_NAME as CORPUS_FILE
from ..drafter import CONFIG_NAME, DFlashConfig, DFlashDrafter, default_target_layer_ids
from ..errors import DFlashError
from .batch import HeadSubset, PaddedBatch, batch_forward, cached_features, collate, context_features
from .data import generate_into, iter_samples, shard_paths
from .dist import init_dist
from .drafter_init import build_drafter
from .features import build_features, cache_dir, load_feature_file
from .recipe import bigram_accuracy, expected_accepted, lr_factor, sample_anchors

STATE_NAME = "train_state.pt"
REPORT_NAME = "train_report.json"
LOG_NAME = "log.jsonl"


@dataclass
class Sample:
    id: str
    ids: torch.Tensor  # [L] prompt + response
    prompt_len: int
    feats: torch.Tensor | None = None  # cached target features [L, F] (cache mode only)
    greedy: torch.Tensor | None = None  # [L] target's choices, for dataset answers (see answers.py)
    folder: Path | None = None  # the data folder it was read from (`--data DIR*K` repeats by folder)

    @property
    def label_tokens(self) -> torch.Tensor:
        """The reply tokens training learns to predict: the target's choices where the text is
        not the target's own."""
        return (self.ids if self.greedy is None else self.greedy)[self.prompt_len:]


def is_heldout(sample_id: str, percent: float) -> bool:
    """A stable split by id: the same samples stay held out as the data folder grows or moves."""
    # By prompt: a regenerated reply and the dataset's answer to the same prompt share a side.
    # By conversation, too: a chat's later turns (`<id>~<k>`, see `data.iter_sharegpt`) have its first
    # turn in their history, so they fall on the first turn's side.
    h = int.from_bytes(hashlib.sha256(re.split(r"[#~]", sample_id)[0].encode()).digest()[:4], "big") / 2**32
    return h * 100 < percent


def load_samples(folders: list[Path]) -> list[Sample]:
    """Every sample of every folder, first occurrence of an id wins (folders may overlap)."""
    seen: set[str] = set()
    out: list[Sample] = []
    for folder in folders:
        for s in iter_samples(folder):
            if s["id"] in seen or len(s["response_ids"]) < 2:
                continue
            seen.add(s["id"])
            ids = torch.tensor(s["prompt_ids"] + s["response_ids"], dtype=torch.long)
            greedy = None
            if "greedy_ids" in s:
                greedy = ids.clone()  # entries before the response are never read (anchors are in it)
                greedy[len(s["prompt_ids"]):] = torch.tensor(s["greedy_ids"], dtype=torch.long)
            out.append(Sample(s["id"], ids, len(s["prompt_ids"]), greedy=greedy, folder=folder))
    return out


def attach_cached_features(target: Any, samples: list[Sample], folders: list[Path], cache_root: Path,
                           layer_ids: list[int], progress: bool) -> None:
    """Cache mode: build (or reuse) the per-shard feature files, then hang features on samples."""
    by_id = {s.id: s for s in samples}
    for folder in folders:
        for f in build_features(target, folder, cache_dir(cache_root, folder), layer_ids, progress=progress):
            for seq in load_feature_file(f, layer_ids):
                s = by_id.get(seq.id)
                if s is not None and s.feats is None and torch.equal(seq.ids, s.ids):
                    s.feats = seq.feats
    missing = [s.id for s in samples if s.feats is None]
    if missing:
        raise DFlashError(f"no cached features for {len(missing)} samples (e.g. {missing[0]})")


class Stream:
    """Endless shuffled epochs over the training samples (seeded, so a run is repeatable)."""

    def __init__(self, samples: list[Sample], seed: int) -> None:
        if not samples:
            raise DFlashError("no training samples (all held out, or the data folders are empty)")
        self.samples = samples
        self.g = torch.Generator().manual_seed(seed)
        self.order: list[int] = []
        self.epoch = 0

    def take(self, n: int) -> list[Sample]:
        out = []
        while len(out) < n:
            if not self.order:
                self.order = torch.randperm(len(self.samples), generator=self.g).tolist()
                self.epoch += 1
            out.append(self.samples[self.order.pop()])
        return out


def context_window(args: argparse.Namespace, step: int) -> int | None:
    """The curriculum's context window at `step`: `--context-window` keys before each anchor,
    doubling every `--window-steps` steps until it stops mattering; None = the full context."""
    if not args.context_window:
        return None
    window = args.context_window * 2 ** (step // max(args.window_steps, 1))
    return None if window >= 4096 else window


def make_batch(samples: list[Sample], anchors_per_seq: int, block_size: int, mask_token_id: int,
               gamma: float | None, g: torch.Generator, window: int | None = None,
               reveal: float = 0.0) -> tuple[PaddedBatch, list[Sample]] | None:
    rows, used = [], []
    for s in samples:
        anchors = sample_anchors(s.prompt_len, len(s.ids), anchors_per_seq, g)
        if anchors:
            rows.append((s.ids, anchors, s.greedy))
            used.append(s)
    if not rows:
        return None
    return collate(rows, block_size, mask_token_id, gamma, window, reveal, g), used


def batch_context(target: Any, batch: PaddedBatch, used: list[Sample], layer_ids: list[int]) -> torch.Tensor:
    if used[0].feats is not None:
        return cached_features([s.feats for s in used], batch.context_len)  # type: ignore[misc]
    return context_features(target, batch.ids, layer_ids)


@torch.no_grad()
def heldout_eval(drafter: DFlashDrafter, target: Any, samples: list[Sample], args: argparse.Namespace,
                 layer_ids: list[int]) -> dict[str, Any]:
    """Teacher-forced loss and per-position accuracy on held-out replies (fixed anchors), in fp32
    whatever the training step's autocast: the numbers then compare across runs and machines."""
    drafter.eval()
    g = torch.Generator().manual_seed(12345)
    bsz = args.block_size
    hits = torch.zeros(bsz, dtype=torch.long)
    counts = torch.zeros(bsz, dtype=torch.long)
    num = den = 0.0
    for i in range(0, len(samples), args.batch_seqs):
        made = make_batch(samples[i: i + args.batch_seqs], args.anchors_per_seq, bsz, drafter.mask_token_id,
                          args.gamma, g)
        if made is None:
            continue
        batch, used = made
        out = batch_forward(drafter, target, batch, batch_context(target, batch, used, layer_ids))
        n, d = out.row_loss(len(used))
        num += float(n.sum())
        den += float(d.sum())
        h, c = out.position_hits(bsz)
        hits += h
        counts += c
    drafter.train()
    acc = (hits.float() / counts.clamp_min(1).float()).tolist()
    return {"samples": len(samples), "loss": round(num / max(den, 1e-12), 5), "acc": [round(a, 4) for a in acc[1:]],
            "tau_est": round(expected_accepted(hits, counts), 4)}


def speculative_eval(drafter: DFlashDrafter, target: Any, sets: list[str], limit: int, max_new_tokens: int,
                     progress: bool) -> dict[str, Any]:
    """tau with REAL speculative decoding: the engine drafts, the target verifies (greedy)."""
    from ..config import GenerationConfig
    from ..engine import Engine
    from ..events import Finished
    from ..prompt_sets import load_prompt_set

    # A copy: the engine casts its drafter to the target's dtype and device in place.
    engine = Engine(target, copy.deepcopy(drafter))
    config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, verify="full")  # tau as published
    results: dict[str, Any] = {}
    for name in sets:
        prompts = load_prompt_set(name, limit)
        blocks = committed = tokens = 0
        seconds = 0.0
        taus = []
        for turns in prompts:
            fin = None
            for ev in engine.generate(turns[0], config):
                fin = ev
            assert isinstance(fin, Finished)
            blocks += fin.blocks
            committed += round(fin.tau * fin.blocks)
            tokens += len(fin.token_ids)
            seconds += fin.elapsed_s
            taus.append(round(fin.tau, 3))
        results[name] = {"prompts": len(prompts), "tau": round(committed / max(blocks, 1), 4), "blocks": blocks,
                         "tokens": tokens, "tok_s": round(tokens / max(seconds, 1e-9), 1), "per_prompt_tau": taus}
        if progress:
            print(f"[eval] {name}: tau {results[name]['tau']:.3f} over {blocks} blocks, {len(prompts)} prompts",
                  flush=True)
    return results


def cpu_has_fast_bf16() -> bool:
    """A CPU whose bf16 matrix products beat fp32 ones (AMX tiles or AVX512-BF16 dot products)."""
    cpu = getattr(torch, "cpu", None)
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in probes)


def train_autocast(choice: str, device: torch.device | str) -> torch.dtype | None:
    """The drafter step's autocast dtype (None: plain fp32) for --autocast `choice` on `device`."""
    if choice == "off":
        return None
    if choice == "bf16" or torch.device(device).type == "cuda" or cpu_has_fast_bf16():
        return torch.bfloat16
    return None


def hardware(device: torch.device) -> dict[str, Any]:
    hw: dict[str, Any] = {"device": str(device), "torch": torch.__version__, "python": platform.python_version(),
                          "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        hw["gpu"] = torch.cuda.get_device_name(device)
        hw["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
        hw["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return hw


def save_state(path: Path, drafter: DFlashDrafter, opt: torch.optim.Optimizer, sched: Any, info: dict[str, Any]
               ) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save({"model": {k: v.detach().cpu() for k, v in drafter.state_dict().items()},
                "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), **info}, tmp)
    os.replace(tmp, path)


def save_checkpoint(out: Path, drafter: DFlashDrafter, opt: torch.optim.Optimizer, sched: Any,
                    info: dict[str, Any], dtype: torch.dtype) -> None:
    drafter.save(out, dtype=dtype)  # the z-lab folder: loadable by load_drafter, vLLM, SGLang
    save_state(out / STATE_NAME, drafter, opt, sched, info)


def parse_data_folders(spec: str) -> tuple[list[Path], dict[Path, int]]:
    """`--data A,B*3`: the folders, and how many times per epoch a folder marked `*K` is drawn
    (a small new folder, e.g. a new domain, would otherwise be a few percent of every batch)."""
    folders: list[Path] = []
    repeats: dict[Path, int] = {}
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        name, star, times = item.rpartition("*") if "*" in item else (item, "", "")
        if star:
            if not times.isdecimal() or int(times) < 1:
                raise DFlashError(f"--data {item!r}: the repeat after '*' must be a whole number >= 1")
            if int(times) > 1:
                repeats[Path(name)] = int(times)
        folders.append(Path(name))
    if not folders:
        raise DFlashError("--data needs at least one folder")
    return folders, repeats


def repeat_samples(samples: list[Sample], repeats: dict[Path, int]) -> list[Sample]:
    """`samples` with each sample read from a repeated folder K times (the same object: its
    features attach once). Held-out samples are not in `samples`, so they stay out."""
    return [s for s in samples for _ in range(repeats.get(s.folder, 1) if s.folder is not None else 1)]


def prepare_data(args: argparse.Namespace, target: Any, folders: list[Path], on_cuda: bool,
                 progress: bool) -> tuple[list[Sample], list[Sample], list[Sample], dict[str, Any]]:
    """Optionally regenerate more replies (`--generate`, into the first folder or `--gen-out`, which
    joins `folders`), then load every sample: (all, held out, training, the report's data entry)."""
    gen_stats = None
    if args.generate:
        gen_out = Path(args.gen_out) if args.gen_out else folders[0]
        if gen_out not in folders:
            folders.insert(0, gen_out)
        have = len({s["id"] for s in iter_samples(gen_out)}) if gen_out.exists() else 0
        deadline = time.time() + args.gen_minutes * 60 if args.gen_minutes else None
        gen_batch = args.gen_batch or (256 if on_cuda else 16)
        gen_stats = generate_into(
            target, gen_out, source=args.source, limit=have + args.generate, batch_size=gen_batch,
            shard_size=max(64, 2 * gen_batch), max_new_tokens=args.max_new_tokens,
            max_prompt_tokens=args.max_prompt_tokens, seed=args.seed, from_end=args.from_end, deadline=deadline,
            progress=progress)
        gen_stats["batch"] = gen_batch
    samples = [s for s in load_samples([f for f in folders if f.exists()]) if len(s.ids) > s.prompt_len + 1]
    held = [s for s in samples if is_heldout(s.id, args.holdout_percent)]
    train_samples = [s for s in samples if not is_heldout(s.id, args.holdout_percent)]
    data = {"folders": [str(f) for f in folders], "samples": len(samples),
            "reply_tokens": sum(len(s.ids) - s.prompt_len for s in samples),
            "tokens": sum(len(s.ids) for s in samples),
            "train_samples": len(train_samples), "heldout_samples": len(held),
            "answer_samples": sum(s.greedy is not None for s in samples),
            "answer_tokens": sum(len(s.ids) - s.prompt_len for s in samples if s.greedy is not None),
            "shards": sum(len(shard_paths(f)) for f in folders if f.exists()), "generated": gen_stats}
    return samples, held, train_samples, data


def warm_start_vocab(init: str, vocab_size: int) -> torch.Tensor:
    """The draft vocabulary of the `--init from:DIR` drafter (for `--keep-draft-vocab`)."""
    from ..drafter import DRAFT_VOCAB_NAME, load_draft_vocab

    path = Path(init.removeprefix("from:")) / DRAFT_VOCAB_NAME
    keep = load_draft_vocab(path, vocab_size) if init.startswith("from:") and path.is_file() else None
    if keep is None:
        raise SystemExit(f"--keep-draft-vocab needs --init from:DIR with a {DRAFT_VOCAB_NAME} in DIR (got {init!r})")
    return keep


def carry_corpus(init: str, out: Path) -> Path | None:
    """Copy the `--init from:DIR` drafter's n-gram table into the run (unless the run has one).

    The table holds the target's statistics, not the drafter's, so a fine-tune keeps serving it;
    without the copy `train.card` would ship the fine-tune without a table. Returns the source."""
    src = Path(init.removeprefix("from:")) / CORPUS_FILE
    if not init.startswith("from:") or not src.is_file() or (out / CORPUS_FILE).exists():
        return None
    shutil.copyfile(src, out / CORPUS_FILE)
    return src


def make_drafter(args: argparse.Namespace, target: Any, out: Path,
                 say: Any) -> tuple[DFlashDrafter, list[int], dict[str, Any] | None]:
    """The drafter to train: resumed from `out` (`--resume`; its shape wins over the flags) or
    built fresh (`--init`). Returns it, its target layers, and the resumed training state."""
    state_path = out / STATE_NAME
    if args.resume and state_path.exists():
        cfg = DFlashConfig.from_dict(json.loads((out / CONFIG_NAME).read_text()))
        drafter = DFlashDrafter(cfg)
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        drafter.load_state_dict(state["model"])
        for name in ("block_size", "num_layers"):
            have_v = cfg.block_size if name == "block_size" else cfg.num_hidden_layers
            if getattr(args, name) != have_v:
                say(f"[train] --resume: keeping the checkpoint's {name} {have_v} (not {getattr(args, name)})")
                setattr(args, name, have_v)
        return drafter, list(cfg.target_layer_ids), state
    layer_ids = ([int(x) for x in args.target_layers.split(",")] if args.target_layers
                 else default_target_layer_ids(target.num_layers, args.num_layers))
    drafter = build_drafter(target, layer_ids, num_layers=args.num_layers, block_size=args.block_size,
                            mask_token_id=args.mask_token_id, init=args.init, fc_init=args.fc_init, seed=args.seed)
    return drafter, layer_ids, None


def evaluate_into(report: dict[str, Any], drafter: DFlashDrafter, target: Any, held_eval: list[Sample],
                  args: argparse.Namespace, layer_ids: list[int], progress: bool) -> None:
    """The end-of-run numbers: held-out accuracy (teacher forced) and tau with real speculative
    decoding on the evaluation prompt sets, and the hardware they were measured on."""
    if held_eval:
        report["heldout"] = heldout_eval(drafter, target, held_eval, args, layer_ids)
    sets = [s for s in args.eval_prompts.split(",") if s and s != "none"]
    if sets and args.eval_limit > 0:
        report["tau"] = speculative_eval(drafter.eval(), target, sets, args.eval_limit, args.eval_max_new_tokens,
                                         progress)
    report["hardware"] = hardware(target.device)


# Steps after the calibration start at which `--steps 0` (re)fits the schedule to the time left.
REFIT_AFTER = (20, 200)


def run_train(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..targets import default_device, load_target

    t_start = time.time()
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
    state_path = out / STATE_NAME
    if state_path.exists() and not args.resume:
        raise DFlashError(f"{out} holds a training run; pass --resume to continue it, or choose another --out")
    if args.steps < 0 or (args.steps == 0 and not args.max_minutes):
        raise DFlashError("--steps 0 (as many as the time allows) needs --max-minutes")
    if args.batch_seqs < 1 or args.anchors_per_seq < 1:
        raise DFlashError("--batch-seqs and --anchors-per-seq must be >= 1")
    features_mode = args.features if args.features != "auto" else ("online" if on_cuda else "cache")
    autocast = train_autocast(args.autocast, device)
    progress = not args.no_progress and dd.main
    say = print if dd.main else (lambda *a, **k: None)
    out.mkdir(parents=True, exist_ok=True)
    folders, repeats = parse_data_folders(args.data)

    target = load_target(args.target, device=device, dtype=args.dtype)
    for p in target.model.parameters():
        p.requires_grad_(False)
    report: dict[str, Any] = {"command": sys.argv, "target": target.name,
                              "target_dtype": str(target.dtype).removeprefix("torch."), "features": features_mode,
                              "autocast": None if autocast is None else "bfloat16"}

    carried = carry_corpus(args.init, out) if dd.main else None
    if carried is not None:
        report["ngrams"] = f"copied from {carried}"
        say(f"[train] n-gram table copied from {carried} (the target's statistics: they stay valid)", flush=True)

    # ----- (a) data: top-up, then the samples -----
    samples, held, train_samples, report["data"] = prepare_data(args, target, folders, on_cuda, progress)
    if repeats:
        train_samples = repeat_samples(train_samples, repeats)
        report["data"]["repeats"] = {str(f): k for f, k in repeats.items()}
        report["data"]["train_draws_per_epoch"] = len(train_samples)
    say(f"[train] data: {len(samples)} samples ({report['data']['reply_tokens']} reply tokens), "
        f"{len(held)} held out", flush=True)

    # ----- (b) the drafter: fresh or resumed -----
    drafter, layer_ids, resumed = make_drafter(args, target, out, say)
    drafter = drafter.to(target.device, torch.float32).train()  # fp32 master weights; autocast for speed
    # Held-out accuracy on the target's own replies where there are some: what inference sees.
    held_eval = ([s for s in held if s.greedy is None] or held)[: args.eval_seqs]
    if features_mode == "cache":
        t0 = time.time()
        if not dd.main:
            dd.barrier()  # rank 0 builds the cache; the others then only read it
        attach_cached_features(target, train_samples + held_eval, [f for f in folders if f.exists()],
                               Path(args.feature_cache) if args.feature_cache else out / "features", layer_ids,
                               progress)
        if dd.main:
            dd.barrier()
        report["feature_cache_s"] = round(time.time() - t0, 1)
    head = None
    train_vocab = args.train_vocab if args.train_vocab >= 0 else (0 if on_cuda else 8192)
    if args.keep_draft_vocab:
        keep = warm_start_vocab(args.init, target.vocab_size)
        head = HeadSubset.from_tokens(keep, [s.label_tokens for s in train_samples], target.vocab_size)
    elif train_vocab:
        head = HeadSubset.from_replies([s.label_tokens for s in train_samples], target.vocab_size, train_vocab)
    if head is not None:
        drafter.draft_vocab = head.keep.clone()  # saved with the checkpoint: inference drafts from it too
        source = args.init.removeprefix("from:") if args.keep_draft_vocab else "most frequent reply tokens"
        report["train_vocab"] = {"size": int(head.keep.shape[0]), "coverage": round(head.coverage, 5),
                                 "source": source}
        say(f"[train] training head: {head.keep.shape[0]} tokens ({source}; {head.coverage:.2%} of reply tokens)",
            flush=True)
    if held_eval:
        report["bigram_acc1"] = round(bigram_accuracy(train_samples, held_eval), 4)

    decay = [p for p in drafter.parameters() if p.dim() >= 2]
    no_decay = [p for p in drafter.parameters() if p.dim() < 2]  # norms: no weight decay
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                            fused=on_cuda)
    # The schedule's length lives in a list so `--steps 0` can fit it once the step time is known.
    total = [args.steps if args.steps else 10**9]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.warmup, total[0], args.min_lr_ratio))
    step = 0
    blocks_seen = 0
    train_seconds = 0.0
    if resumed:
        opt.load_state_dict(resumed["optimizer"])
        sched.load_state_dict(resumed["scheduler"])
        step, blocks_seen = int(resumed["step"]), int(resumed["blocks_seen"])
        train_seconds = float(resumed.get("train_seconds", 0.0))
        if not args.steps:
            total[0] = int(resumed.get("total_steps", total[0]))
        report["resumed_from"] = step
        say(f"[train] resumed at step {step} from {state_path}", flush=True)
    if args.steps and step >= args.steps:
        say(f"[train] already at step {step} >= --steps {args.steps}; evaluating only", flush=True)
    # Data order is re-drawn on resume (seeded by the step), not replayed.
    # Each process draws its own batches (seeded by rank too).
    stream = Stream(train_samples, args.seed + step + 1_000_003 * dd.rank)
    g = torch.Generator().manual_seed(args.seed * 7919 + step + 1_000_003 * dd.rank)
    # Every command that shaped these weights, so a resumed run's report still names the first one.
    commands = [*(resumed or {}).get("commands", []), sys.argv]
    report["commands"] = commands
    if resumed and resumed.get("ngrams") and "ngrams" not in report:
        report["ngrams"] = resumed["ngrams"]  # copied by the first run; the state remembers from where
    info_base = {"layer_ids": layer_ids, "args": {k: v for k, v in vars(args).items() if k != "func"},
                 "commands": commands, "ngrams": report.get("ngrams")}

    # ----- (c) the loop -----
    log = (out / LOG_NAME if dd.main else Path(os.devnull)).open("a")
    hits = torch.zeros(args.block_size, dtype=torch.long)
    counts = torch.zeros(args.block_size, dtype=torch.long)
    win_hits, win_counts = hits.clone(), counts.clone()
    run_loss, run_n = 0.0, 0
    loop_t0 = time.time()
    deadline = loop_t0 + args.max_minutes * 60 if args.max_minutes else math.inf
    calib_at, calib_t = None, 0.0
    stop_reason = "steps"
    bar = tqdm(total=args.steps or None, initial=step, unit="step", disable=not progress, dynamic_ncols=True,
               mininterval=1 if sys.stderr.isatty() else 30)
    out_of_time = False
    while not args.steps or step < args.steps:
        if out_of_time:
            stop_reason = "time"
            break
        made = None
        while made is None:
            made = make_batch(stream.take(args.batch_seqs), args.anchors_per_seq, args.block_size,
                              drafter.mask_token_id, args.gamma, g, context_window(args, step), args.partial_mask)
        batch, used = made
        context = batch_context(target, batch, used, layer_ids)
        res = batch_forward(drafter, target, batch, context, autocast, head)
        loss = res.loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        dd.average_grads(drafter.parameters())
        gnorm = float(torch.nn.utils.clip_grad_norm_(drafter.parameters(), args.clip))
        opt.step()
        sched.step()
        step += 1
        # Real blocks only (dummy padding blocks carry no weight), over all processes; and the
        # deadline, decided together so that every process stops after the same step.
        blocks, late = dd.sum_ints([int((batch.weights.view(len(used), -1, args.block_size).sum(-1) > 0).sum()),
                                    int(time.time() >= deadline)], target.device)
        blocks_seen += blocks
        out_of_time = late > 0
        h, c = res.position_hits(args.block_size)
        win_hits += h
        win_counts += c
        run_loss += float(loss.detach())
        run_n += 1
        acc = win_hits.float() / win_counts.clamp_min(1).float()
        bar.update(1)
        bar.set_postfix(loss=f"{run_loss / run_n:.3f}", acc1=f"{acc[1]:.3f}", acc_last=f"{acc[-1]:.3f}",
                        lr=f"{sched.get_last_lr()[0]:.1e}")
        if not args.steps and calib_at is None and step >= (int(report.get("resumed_from", 0)) + 3):
            calib_at, calib_t = step, time.time()  # the first steps pay for warm-up (allocator, kernels)
        elif not args.steps and calib_at is not None and step - calib_at in REFIT_AFTER:
            # Fitted early so the cosine has a length at all, then again over a longer stretch: on
            # a GPU the first dozens of steps still compile kernels for new shapes (seen on an
            # H200: 464 ms/step over steps 3-23 against 237 over the whole run, so a single early
            # fit left half of the run at the floor learning rate).
            per_step = (time.time() - calib_t) / (step - calib_at)
            total[0] = dd.broadcast_int(step + max(1, int((deadline - time.time()) / per_step * 0.97)), target.device)
            bar.total = total[0]
            report["fitted_steps"] = total[0]
            say(f"\n[train] {per_step * 1e3:.0f} ms/step: fitting the schedule to {total[0]} steps", flush=True)
        if step % args.log_every == 0 or step == args.steps:
            rec: dict[str, Any] = {"step": step, "loss": round(run_loss / run_n, 5), "lr": sched.get_last_lr()[0],
                                   "grad_norm": round(gnorm, 4), "acc": [round(a, 4) for a in acc[1:].tolist()],
                                   "tau_est": round(expected_accepted(win_hits, win_counts), 4),
                                   "blocks_seen": blocks_seen, "elapsed_s": round(time.time() - loop_t0, 1)}
            if held_eval and args.eval_every and step % args.eval_every == 0 and dd.main:
                rec["heldout"] = heldout_eval(drafter, target, held_eval, args, layer_ids)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            hits, counts = win_hits.clone(), win_counts.clone()  # the last full window, for the report
            win_hits.zero_()
            win_counts.zero_()
            run_loss, run_n = 0.0, 0
        if args.save_every and step % args.save_every == 0 and dd.main:
            info = {**info_base, "step": step, "blocks_seen": blocks_seen, "total_steps": total[0],
                    "train_seconds": train_seconds + time.time() - loop_t0}
            save_checkpoint(out, drafter, opt, sched, info, torch.bfloat16)
    bar.close()
    if win_counts.sum() > 0 and (counts.sum() == 0 or run_n >= args.log_every // 2):
        hits, counts = win_hits, win_counts
    loop_s = time.time() - loop_t0
    train_seconds += loop_s
    info = {**info_base, "step": step, "blocks_seen": blocks_seen, "total_steps": total[0],
            "train_seconds": train_seconds}
    log.close()
    digests = dd.weight_digests(drafter)
    if not dd.main:
        dd.close()
        return 0
    save_checkpoint(out, drafter, opt, sched, info, torch.bfloat16)
    steps_this_run = step - int(report.get("resumed_from", 0))
    report["train"] = {
        "steps": step, "steps_this_run": steps_this_run, "stop": stop_reason, "blocks_seen": blocks_seen,
        "loop_seconds": round(loop_s, 1), "train_seconds_total": round(train_seconds, 1),
        "ms_per_step": round(loop_s / max(steps_this_run, 1) * 1e3, 1), "batch_seqs": args.batch_seqs,
        "anchors_per_seq": args.anchors_per_seq, "block_size": args.block_size, "num_layers": args.num_layers,
        "layer_ids": layer_ids, "lr": args.lr,
        "init": args.init if not resumed else resumed.get("args", {}).get("init", "?"),
        "acc": [round(a, 4) for a in (hits.float() / counts.clamp_min(1).float())[1:].tolist()],
        "tau_est": round(expected_accepted(hits, counts), 4), "world_size": dd.world,
        "replica_weight_digests": digests,
    }
    print(f"[train] {steps_this_run} steps in {loop_s:.0f}s (stop: {stop_reason}); checkpoint in {out}", flush=True)

    # ----- (d) evaluation -----
    evaluate_into(report, drafter, target, held_eval, args, layer_ids, progress)
    report["wall_seconds"] = round(time.time() - t_start, 1)
    report["args"] = info_base["args"]
    (out / REPORT_NAME).write_text(json.dumps(report, indent=1) + "\n")
    print(summary_table(report))
    dd.close()
    return 0


def summary_table(report: dict[str, Any]) -> str:
    tr = report.get("train", {})
    rows = [("data", f"{report['data']['samples']} samples, {report['data']['reply_tokens']} reply tokens"),
            ("steps", f"{tr.get('steps')} ({tr.get('stop')}), {tr.get('blocks_seen')} blocks, "
                      f"{tr.get('ms_per_step')} ms/step"),
            ("train acc 1/2/4/8", " / ".join(f"{a:.3f}" for a in _pick(tr.get("acc", [])))),
            ("train tau_est", f"{tr.get('tau_est')}")]
    if "heldout" in report:
        h = report["heldout"]
        rows.append(("heldout acc 1/2/4/8", " / ".join(f"{a:.3f}" for a in _pick(h["acc"]))))
        rows.append(("heldout loss / tau_est", f"{h['loss']} / {h['tau_est']}"))
    if "bigram_acc1" in report:
        rows.append(("bigram acc1", f"{report['bigram_acc1']}"))
    for name, r in (report.get("tau") or {}).items():
        rows.append((f"tau {name}", f"{r['tau']:.3f} ({r['prompts']} prompts, {r['blocks']} blocks)"))
    rows.append(("wall", f"{report['wall_seconds']} s on {report['hardware'].get('gpu') or 'cpu'}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _pick(acc: list[float]) -> list[float]:
    # Block positions 1, 2, 4, 8 (acc[0] is position 1): enough to see whether position 1 leads.
    return [acc[i] for i in (0, 1, 3, 7) if i < len(acc)]


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--target", default="embedded", metavar="ID|PATH", help="target LLM (default: embedded SmolLM2)")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    g.add_argument("--dtype", default="float32",
                   help="the TARGET's dtype (default float32: features as the fp32 app computes them; the "
                        "target is tiny, so this costs little even on a GPU, where matmuls use TF32)")
    g.add_argument("--autocast", choices=["auto", "bf16", "off"], default="auto",
                   help="bf16 autocast for the drafter's training step (fp32 master weights). auto: on CUDA, "
                        "and on CPUs with bf16 matrix units (AMX / AVX512-BF16), where a step is ~1.7x cheaper")
    g.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    d = p.add_argument_group("data")
    d.add_argument("--data", default="data/smollm2-sharegpt", metavar="DIR[,DIR...]",
                   help="data folders (gzip JSONL shards); samples are deduplicated by id. DIR*K draws a "
                        "folder's samples K times per epoch")
    d.add_argument("--generate", type=int, default=0, metavar="N", help="first regenerate N more replies")
    d.add_argument("--gen-out", default="", metavar="DIR", help="where --generate writes (default: first --data)")
    d.add_argument("--gen-minutes", type=float, default=0.0, metavar="M", help="time box for --generate (0: none)")
    d.add_argument("--gen-batch", type=int, default=0, help="generation batch (default: 256 on CUDA, 16 on CPU)")
    d.add_argument("--source", default="sharegpt", help="prompt source for --generate (see train.data)")
    d.add_argument("--from-end", action="store_true",
                   help="take prompts from the end of the shuffled list (no overlap with a run from the start)")
    d.add_argument("--max-new-tokens", type=int, default=256, help="reply length cap for --generate")
    d.add_argument("--max-prompt-tokens", type=int, default=384)
    d.add_argument("--holdout-percent", type=float, default=2.0, help="samples held out by id hash")
    d.add_argument("--features", choices=["auto", "online", "cache"], default="auto",
                   help="target features: online (each step) or a disk cache (default: online on CUDA, cache on CPU)")
    d.add_argument("--feature-cache", default="", metavar="DIR", help="cache folder (default: OUT/features)")
    t = p.add_argument_group("training")
    t.add_argument("--out", default="runs/drafter-x", help="checkpoint + report folder")
    t.add_argument("--resume", action="store_true", help="continue the run in --out (weights, optimizer, step)")
    t.add_argument("--steps", type=int, default=2000, help="total optimizer steps (0: as many as --max-minutes allow)")
    t.add_argument("--max-minutes", type=float, default=0.0, help="wall-clock budget of the training loop")
    t.add_argument("--batch-seqs", type=int, default=8, help="sequences per step (one padded forward)")
    t.add_argument("--anchors-per-seq", type=int, default=8, help="blocks sampled per sequence")
    t.add_argument("--context-window", type=int, default=0, metavar="K",
                   help="curriculum: blocks see only the last K context positions at first (0: off)")
    t.add_argument("--window-steps", type=int, default=200, metavar="S",
                   help="the window doubles every S steps until it covers the whole context")
    t.add_argument("--train-vocab", type=int, default=-1, metavar="K",
                   help="train against the K most frequent reply tokens only (a cheaper LM head; evaluation "
                        "and the checkpoint use the full vocabulary). -1: 8192 on CPU, full on CUDA; 0: full")
    t.add_argument("--keep-draft-vocab", action="store_true",
                   help="with --init from:DIR, train against (and ship) that drafter's draft vocabulary instead "
                        "of this run's most frequent tokens: fine-tuning on a narrow slice of data would narrow it")
    t.add_argument("--partial-mask", type=float, default=0.0, metavar="R",
                   help="partial masking for multi-step denoising: each block shows a random share (up to R) "
                        "of its positions as true tokens, without loss on them (0: off, the paper's 1-step setup)")
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--min-lr-ratio", type=float, default=0.1)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--gamma", type=float, default=None, help="loss decay over block positions (default: by B)")
    t.add_argument("--num-layers", type=int, default=2)
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--target-layers", default="", metavar="I,J", help="target layers for context (default: spread)")
    t.add_argument("--mask-token-id", type=int, default=0, help="0 = <|endoftext|> for SmolLM2")
    t.add_argument("--init", default="random", help="random, target-last, target:i,j, or from:DIR (warm start)")
    t.add_argument("--fc-init", default="random", choices=["random", "mean"])
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--log-every", type=int, default=20)
    t.add_argument("--eval-every", type=int, default=0, help="held-out eval every N steps (0: at the end only)")
    t.add_argument("--eval-seqs", type=int, default=64, help="held-out samples used for teacher-forced eval")
    t.add_argument("--save-every", type=int, default=500)
    t.add_argument("--no-progress", action="store_true")
    e = p.add_argument_group("evaluation (real speculative decoding, temperature 0)")
    e.add_argument("--eval-prompts", default="humaneval,gsm8k", help="prompt sets, comma-separated ('none': skip)")
    e.add_argument("--eval-limit", type=int, default=8, metavar="K", help="prompts per set")
    e.add_argument("--eval-max-new-tokens", type=int, default=128)
