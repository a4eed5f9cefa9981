"""The training loop: batches, optimizer steps, the log, periodic saves, and the time budget."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..batch_invariant import cpu_has_bf16_units
from ..drafter import DFlashDrafter
from .batch import BatchOutput, HeadSubset, PaddedBatch, batch_forward, features_and_final
from .dist import Dist
from .evaluate import heldout_eval
from .recipe import expected_accepted
from .samples import Sample, Stream, batch_context, make_batch
from .state import Position, save_checkpoint

LOG_NAME = "log.jsonl"
# Steps after the calibration start at which `--steps 0` (re)fits the schedule to the time left.
REFIT_AFTER = (20, 200)


def train_autocast(choice: str, device: torch.device | str) -> torch.dtype | None:
    """The drafter step's autocast dtype (None: plain fp32) for --autocast `choice` on `device`."""
    if choice == "off":
        return None
    if choice == "bf16" or torch.device(device).type == "cuda" or cpu_has_bf16_units():
        return torch.bfloat16
    return None


@dataclass
class Trainer:
    """Everything an optimizer step touches."""

    args: argparse.Namespace
    dd: Dist
    target: Any
    drafter: DFlashDrafter
    layer_ids: list[int]
    head: HeadSubset | None
    autocast: torch.dtype | None
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    position: Position
    info_base: dict[str, Any]  # what every save records besides the position

    def step(self, batch: PaddedBatch, used: list[Sample]) -> tuple[BatchOutput, float, float]:
        """One optimizer step on `batch`: its forward output, loss and gradient norm (before clipping)."""
        final = None
        if self.args.distill > 0:
            context, final = features_and_final(self.target, batch, self.layer_ids)
        else:
            context = batch_context(self.target, batch, used, self.layer_ids)
        res = batch_forward(self.drafter, self.target, batch, context, self.autocast, self.head, final,
                            self.args.distill)
        loss = res.loss()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.dd.average_grads(self.drafter.parameters())
        gnorm = float(torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.args.clip))
        self.opt.step()
        self.sched.step()
        self.position.step += 1
        return res, float(loss.detach()), gnorm

    def save(self, out: Path, extra_seconds: float = 0.0) -> None:
        info = {**self.info_base, **self.position.info(extra_seconds)}
        save_checkpoint(out, self.drafter, self.opt, self.sched, info, torch.bfloat16)


class Window:
    """Training accuracy per block position and mean loss over the steps since the last log line."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.hits = torch.zeros(block_size, dtype=torch.long)
        self.counts = torch.zeros(block_size, dtype=torch.long)
        self.loss, self.steps = 0.0, 0

    def add(self, res: BatchOutput, loss: float) -> None:
        h, c = res.position_hits(self.block_size)
        self.hits += h
        self.counts += c
        self.loss += loss
        self.steps += 1

    def acc(self) -> torch.Tensor:
        return self.hits.float() / self.counts.clamp_min(1).float()


class ScheduleFit:
    """`--steps 0`: the step time, measured after the first steps (which pay for warm-up:
    allocator, kernels) and measured again over a longer stretch, to fit the schedule to."""

    def __init__(self, first_step: int) -> None:
        self.start = first_step + 3
        self.at: int | None = None
        self.t = 0.0

    def per_step(self, step: int) -> float | None:
        """Seconds per step when it is time to (re)fit, else None."""
        if self.at is None:
            if step >= self.start:
                self.at, self.t = step, time.time()
            return None
        # On a GPU the first dozens of steps still compile kernels for new shapes (seen on an
        # H200: 464 ms/step over steps 3-23 against 237 over the whole run, so a single early
        # fit left half of the run at the floor learning rate).
        if step - self.at in REFIT_AFTER:
            return (time.time() - self.t) / (step - self.at)
        return None


@dataclass
class LoopResult:
    stop: str  # "steps" or "time"
    hits: torch.Tensor  # the last full log window's accuracy counts, for the report
    counts: torch.Tensor
    seconds: float


def train_loop(t: Trainer, train_samples: list[Sample], held_eval: list[Sample], report: dict[str, Any],
               out: Path, progress: bool, say: Callable[..., None]) -> LoopResult:
    """Train until `--steps` or the `--max-minutes` deadline, logging to `log.jsonl` and saving
    every `--save-every` steps; `report` gets the fitted schedule length under `--steps 0`."""
    from tqdm import tqdm

    args, dd, pos = t.args, t.dd, t.position
    # Data order is re-drawn on resume (seeded by the step), not replayed.
    # Each process draws its own batches (seeded by rank too).
    stream = Stream(train_samples, args.seed + pos.step + 1_000_003 * dd.rank)
    g = torch.Generator().manual_seed(args.seed * 7919 + pos.step + 1_000_003 * dd.rank)
    log = (out / LOG_NAME if dd.main else Path(os.devnull)).open("a")
    win, last = Window(args.block_size), Window(args.block_size)
    loop_t0 = time.time()
    deadline = loop_t0 + args.max_minutes * 60 if args.max_minutes else math.inf
    fit = ScheduleFit(int(report.get("resumed_from", 0)))
    stop = "steps"
    bar = tqdm(total=args.steps or None, initial=pos.step, unit="step", disable=not progress, dynamic_ncols=True,
               mininterval=1 if sys.stderr.isatty() else 30)
    out_of_time = False
    while not args.steps or pos.step < args.steps:
        if out_of_time:
            stop = "time"
            break
        made = None
        while made is None:
            made = make_batch(stream.take(args.batch_seqs), args.anchors_per_seq, args.block_size,
                              t.drafter.mask_token_id, args.gamma, g)
        batch, used = made
        res, loss, gnorm = t.step(batch, used)
        # Real blocks only (dummy padding blocks carry no weight), over all processes; and the
        # deadline, decided together so that every process stops after the same step.
        blocks, late = dd.sum_ints([int((batch.weights.view(len(used), -1, args.block_size).sum(-1) > 0).sum()),
                                    int(time.time() >= deadline)], t.target.device)
        pos.blocks_seen += blocks
        out_of_time = late > 0
        win.add(res, loss)
        acc = win.acc()
        bar.update(1)
        bar.set_postfix(loss=f"{win.loss / win.steps:.3f}", acc1=f"{acc[1]:.3f}", acc_last=f"{acc[-1]:.3f}",
                        lr=f"{t.sched.get_last_lr()[0]:.1e}")
        per_step = None if args.steps else fit.per_step(pos.step)
        if per_step is not None:
            left = max(1, int((deadline - time.time()) / per_step * 0.97))
            pos.total_steps = dd.broadcast_int(pos.step + left, t.target.device)
            bar.total = report["fitted_steps"] = pos.total_steps
            say(f"\n[train] {per_step * 1e3:.0f} ms/step: fitting the schedule to {pos.total_steps} steps", flush=True)
        if pos.step % args.log_every == 0 or pos.step == args.steps:
            rec: dict[str, Any] = {"step": pos.step, "loss": round(win.loss / win.steps, 5),
                                   "lr": t.sched.get_last_lr()[0], "grad_norm": round(gnorm, 4),
                                   "acc": [round(a, 4) for a in acc[1:].tolist()],
                                   "tau_est": round(expected_accepted(win.hits, win.counts), 4),
                                   "blocks_seen": pos.blocks_seen, "elapsed_s": round(time.time() - loop_t0, 1)}
            if held_eval and args.eval_every and pos.step % args.eval_every == 0 and dd.main:
                rec["heldout"] = heldout_eval(t.drafter, t.target, held_eval, args, t.layer_ids)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            win, last = Window(args.block_size), win
        if args.save_every and pos.step % args.save_every == 0 and dd.main:
            t.save(out, time.time() - loop_t0)
    bar.close()
    log.close()
    if win.counts.sum() > 0 and (last.counts.sum() == 0 or win.steps >= args.log_every // 2):
        last = win
    return LoopResult(stop, last.hits, last.counts, time.time() - loop_t0)
