"""The drafter training loop: AdamW, warm-up + cosine schedule, grad clip, checkpoints.

Reads the feature cache written by `features.py` (target features + token ids), samples
anchors in each reply, and trains the drafter to predict each block from the target's frozen
embedding and LM head (see `recipe.py`). Checkpoints are z-lab folders (`DFlashDrafter.save`),
loadable by `load_drafter`, vLLM and SGLang.

    python -m dflash_core.train.loop --features runs/features/smollm2 --out runs/drafter-a --steps 2000
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..drafter import DFlashDrafter, config_for_target, init_weights
from .features import Sequence, _meta, feature_files, iter_sequences, load_feature_file
from .recipe import (
    BlockBatch,
    build_blocks,
    expected_accepted,
    position_accuracy,
    sample_anchors,
    weighted_block_loss,
)


@dataclass
class TrainConfig:
    features: str
    out: str
    num_layers: int = 2
    block_size: int = 16
    mask_token_id: int = 0  # <|endoftext|> for SmolLM2: never inside a chat reply
    init: str = "random"  # "random", "target-last" (the target's last num_layers layers) or "target:i,j"
    fc_init: str = "random"  # "random" or "mean" (fc starts as the mean of the concatenated layers)
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup: int = 100
    steps: int = 2000
    seqs_per_step: int = 4
    anchors_per_seq: int = 8
    gamma: float | None = None  # None: recipe.default_gamma(block_size)
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 1.0
    seed: int = 0
    save_every: int = 500
    log_every: int = 20
    eval_every: int = 200
    eval_seqs: int = 32
    holdout_files: int = 1  # the last N feature files are held out for evaluation (when >= 2 files)
    threads: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine down to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / max(1, warmup)
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def init_from_target(drafter: DFlashDrafter, target_model: Any, layer_ids: list[int]) -> None:
    """Copy attention/MLP/norm weights of the target's layers `layer_ids` into the drafter's
    layers (Llama/Qwen names). q_norm/k_norm stay at 1 when the target has none (Llama)."""
    layers = target_model.model.layers
    if len(layer_ids) != len(drafter.layers):
        raise ValueError(f"{len(layer_ids)} target layers for {len(drafter.layers)} drafter layers")
    for dst, i in zip(drafter.layers, layer_ids, strict=True):
        src = dict(layers[i].named_parameters())
        with torch.no_grad():
            for name, p in dst.named_parameters():
                if name in src:
                    if src[name].shape != p.shape:
                        raise ValueError(f"target layer {i} {name}: shape {tuple(src[name].shape)} != {tuple(p.shape)}")
                    p.copy_(src[name].to(p.dtype))
                elif not name.endswith(("q_norm.weight", "k_norm.weight")):
                    raise ValueError(f"target layer {i} has no {name}")


def build_drafter(cfg: TrainConfig, target: Any, layer_ids: list[int]) -> DFlashDrafter:
    dcfg = config_for_target(target.config, num_layers=cfg.num_layers, block_size=cfg.block_size,
                             mask_token_id=cfg.mask_token_id)
    dcfg.target_layer_ids = list(layer_ids)
    drafter = init_weights(DFlashDrafter(dcfg), seed=cfg.seed)
    if cfg.init == "target-last":
        init_from_target(drafter, target.model, list(range(target.num_layers - cfg.num_layers, target.num_layers)))
    elif cfg.init.startswith("target:"):
        init_from_target(drafter, target.model, [int(x) for x in cfg.init.split(":", 1)[1].split(",")])
    elif cfg.init != "random":
        raise ValueError(f"unknown init {cfg.init!r}")
    if cfg.fc_init == "mean":
        n, h = len(layer_ids), dcfg.hidden_size
        with torch.no_grad():
            drafter.fc.weight.copy_(torch.eye(h).repeat(1, n) / n)
    return drafter


def seq_blocks(seq: Sequence, cfg: TrainConfig, mask_token_id: int, g: torch.Generator) -> BlockBatch | None:
    anchors = sample_anchors(seq.prompt_len, len(seq.ids), cfg.anchors_per_seq, g)
    if not anchors:
        return None
    return build_blocks(seq.ids, anchors, cfg.block_size, mask_token_id, cfg.gamma)


def blocks_logits(drafter: DFlashDrafter, target: Any, seq: Sequence, bb: BlockBatch) -> torch.Tensor:
    """Drafter logits [N*B, V] for the blocks of one sequence (frozen target embedding/head)."""
    dtype, dev = drafter.fc.weight.dtype, drafter.fc.weight.device
    ctx = seq.feats[: bb.context_len].to(dev, dtype)[None]
    with torch.no_grad():
        emb = target.embed(bb.input_ids[None].to(target.device)).to(dev, dtype)
    hidden = drafter.forward_train(ctx, emb, bb.positions.to(dev), bb.mask.to(dev))
    return target.lm_head(hidden)[0]


@torch.no_grad()
def evaluate(drafter: DFlashDrafter, target: Any, seqs: list[Sequence], cfg: TrainConfig) -> dict[str, Any]:
    """Loss, per-position accuracy and a rough tau on held-out sequences (fixed anchors)."""
    drafter.eval()
    g = torch.Generator().manual_seed(12345)
    hits = torch.zeros(cfg.block_size, dtype=torch.long)
    counts = torch.zeros(cfg.block_size, dtype=torch.long)
    num, den = 0.0, 0.0
    for seq in seqs:
        bb = seq_blocks(seq, cfg, drafter.mask_token_id, g)
        if bb is None:
            continue
        logits = blocks_logits(drafter, target, seq, bb).cpu()
        w = float(bb.weights.sum())
        num += float(weighted_block_loss(logits, bb.labels, bb.weights)) * w
        den += w
        h, c = position_accuracy(logits, bb.labels, cfg.block_size)
        hits += h
        counts += c
    drafter.train()
    acc = (hits.float() / counts.clamp_min(1).float()).tolist()
    return {"loss": num / max(den, 1e-12), "acc": [round(a, 4) for a in acc[1:]],
            "tau_est": round(expected_accepted(hits, counts), 4)}


def bigram_accuracy(train_seqs: list[Sequence], eval_seqs: list[Sequence]) -> float:
    """Block-position-1 accuracy of "the most frequent successor of the anchor token" learnt from
    the training replies: the floor a drafter that uses its anchor must clearly beat (sanity ladder)."""
    from collections import Counter, defaultdict
    from itertools import pairwise

    succ: dict[int, Counter[int]] = defaultdict(Counter)
    for seq in train_seqs:
        r = seq.ids[seq.prompt_len:].tolist()
        for a, b in pairwise(r):
            succ[a][b] += 1
    best = {a: c.most_common(1)[0][0] for a, c in succ.items()}
    hits = total = 0
    for seq in eval_seqs:
        r = seq.ids[seq.prompt_len:].tolist()
        for a, b in pairwise(r):
            hits += best.get(a) == b
            total += 1
    return hits / max(total, 1)


def train(cfg: TrainConfig, target: Any, progress: bool = True) -> DFlashDrafter:
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    for p in target.model.parameters():
        p.requires_grad_(False)
    files = feature_files(cfg.features)
    if not files:
        raise ValueError(f"no feature files in {cfg.features}")
    layer_ids = json.loads(_meta(files[0])["layer_ids"])
    held = files[-cfg.holdout_files:] if len(files) >= 2 and cfg.holdout_files > 0 else []
    train_files = files[: len(files) - len(held)]
    eval_seqs = [s for f in held for s in load_feature_file(f)][: cfg.eval_seqs]

    drafter = build_drafter(cfg, target, layer_ids).train()
    decay = [p for n, p in drafter.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in drafter.named_parameters() if p.dim() < 2]  # norms: no weight decay
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg.warmup, cfg.steps, cfg.min_lr_ratio))
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=1) + "\n")
    log = (out / "log.jsonl").open("a")
    if eval_seqs:
        train_seqs = [q for f in train_files for q in load_feature_file(f)]
        log.write(json.dumps({"step": 0, "bigram_acc1": round(bigram_accuracy(train_seqs, eval_seqs), 4),
                              "train_seqs": len(train_seqs), "eval_seqs": len(eval_seqs)}) + "\n")
        del train_seqs
    g = torch.Generator().manual_seed(cfg.seed)
    stream: Iterator[Sequence] = iter_sequences(train_files, g)
    hits = torch.zeros(cfg.block_size, dtype=torch.long)
    counts = torch.zeros(cfg.block_size, dtype=torch.long)
    run_loss, run_n, t0 = 0.0, 0, time.time()
    bar = tqdm(range(cfg.steps), unit="step", disable=not progress, dynamic_ncols=True,
               mininterval=1 if sys.stderr.isatty() else 30)  # a log file gets a line every 30 s
    for step in bar:
        # Blocks first, so the step's loss can be normalised by its total weight (sequences with
        # more valid positions count more, as if all blocks were in one batch).
        batch = []
        while len(batch) < cfg.seqs_per_step:
            seq = next(stream)
            bb = seq_blocks(seq, cfg, drafter.mask_token_id, g)
            if bb is not None:
                batch.append((seq, bb))
        total_w = sum(float(bb.weights.sum()) for _, bb in batch)
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for seq, bb in batch:
            logits = blocks_logits(drafter, target, seq, bb)
            bb.labels, bb.weights = bb.labels.to(logits.device), bb.weights.to(logits.device)
            share = float(bb.weights.sum()) / total_w
            loss = weighted_block_loss(logits, bb.labels, bb.weights) * share
            loss.backward()
            step_loss += float(loss.detach())
            h, c = position_accuracy(logits.detach(), bb.labels, cfg.block_size)
            hits += h.cpu()
            counts += c.cpu()
        gnorm = float(torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.clip))
        opt.step()
        sched.step()
        run_loss += step_loss
        run_n += 1
        acc = hits.float() / counts.clamp_min(1).float()
        bar.set_postfix(loss=f"{run_loss / run_n:.3f}", acc1=f"{acc[1]:.3f}", acc_last=f"{acc[-1]:.3f}")
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            rec: dict[str, Any] = {"step": done, "loss": round(run_loss / run_n, 5), "lr": sched.get_last_lr()[0],
                                   "grad_norm": round(gnorm, 4), "acc": [round(a, 4) for a in acc[1:].tolist()],
                                   "tau_est": round(expected_accepted(hits, counts), 4),
                                   "elapsed_s": round(time.time() - t0, 1)}
            if eval_seqs and (done % cfg.eval_every == 0 or done == cfg.steps):
                rec["eval"] = evaluate(drafter, target, eval_seqs, cfg)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            hits.zero_()
            counts.zero_()
            run_loss, run_n = 0.0, 0
        if done % cfg.save_every == 0 and done != cfg.steps:
            drafter.save(out / f"step-{done:06d}")
    bar.close()
    log.close()
    drafter.save(out / "final")
    return drafter.eval()


def main() -> None:
    from ..targets import load_target

    ap = argparse.ArgumentParser(prog="python -m dflash_core.train.loop")
    defaults = TrainConfig(features="", out="")
    for name, value in asdict(defaults).items():
        if name in ("extra", "betas"):
            continue
        flag = "--" + name.replace("_", "-")
        if name in ("features", "out"):
            ap.add_argument(flag, required=True)
        elif name == "gamma":
            ap.add_argument(flag, type=float, default=None)
        else:
            ap.add_argument(flag, type=type(value), default=value)
    ap.add_argument("--target", default="embedded")
    args = vars(ap.parse_args())
    spec = args.pop("target")
    cfg = TrainConfig(**args)
    torch.set_num_threads(cfg.threads)
    target = load_target(spec, device="cpu", dtype="float32")
    train(cfg, target)
    print(f"[train] checkpoint: {Path(cfg.out) / 'final'}")


if __name__ == "__main__":
    main()
