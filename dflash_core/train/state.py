"""A training run's state: the drafter and optimizer it starts from, and what it saves for `--resume`."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..corpus import FILE_NAME as CORPUS_FILE
from ..dflash2 import SELECTOR_LR_SCALE
from ..drafter import DFlashDrafter
from ..drafter_config import DFlashConfig, default_target_layer_ids
from ..drafter_io import CONFIG_NAME
from .drafter_init import build_drafter
from .recipe import lr_factor

STATE_NAME = "train_state.pt"


@dataclass
class Position:
    """How far training has gone: saved next to the weights, restored by `--resume`."""

    total_steps: int  # the schedule's length; `--steps 0` fits it to the time once the step time is known
    step: int = 0
    blocks_seen: int = 0
    train_seconds: float = 0.0

    def info(self, extra_seconds: float = 0.0) -> dict[str, Any]:
        return {"step": self.step, "blocks_seen": self.blocks_seen, "total_steps": self.total_steps,
                "train_seconds": self.train_seconds + extra_seconds}


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


def warm_start_vocab(init: str, vocab_size: int) -> torch.Tensor:
    """The draft vocabulary of the `--init from:DIR` drafter (for `--keep-draft-vocab`)."""
    from ..drafter_io import DRAFT_VOCAB_NAME, load_draft_vocab

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
                 say: Callable[..., None]) -> tuple[DFlashDrafter, list[int], dict[str, Any] | None]:
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
                            mask_token_id=args.mask_token_id, init=args.init, seed=args.seed,
                            version=2 if getattr(args, "arch", "dflash") == "dflash2" else 1)
    return drafter, layer_ids, None


def make_optimizer(args: argparse.Namespace, drafter: DFlashDrafter, position: Position,
                   fused: bool) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (no weight decay on norms) with warm-up + cosine over `position.total_steps`, read
    at every step so that `--steps 0` can refit it."""
    selector = drafter.candidate_selector
    new = set() if selector is None else {id(p) for p in selector.parameters()}
    rest = [p for p in drafter.parameters() if id(p) not in new]
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    if selector is not None:  # DFlash 2's selector: new where the rest is warm-started
        groups.append({"params": list(selector.parameters()), "weight_decay": args.weight_decay,
                       "lr": args.lr * SELECTOR_LR_SCALE})
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, args.warmup, position.total_steps, args.min_lr_ratio))
    return opt, sched


def resume_into(resumed: dict[str, Any], opt: torch.optim.Optimizer, sched: Any, position: Position,
                fitted_length: bool) -> None:
    """Continue a saved run: the optimizer's moments, the schedule, and the step counts. With
    `fitted_length` (`--steps 0`) the saved schedule length carries over too."""
    opt.load_state_dict(resumed["optimizer"])
    sched.load_state_dict(resumed["scheduler"])
    position.step, position.blocks_seen = int(resumed["step"]), int(resumed["blocks_seen"])
    position.train_seconds = float(resumed.get("train_seconds", 0.0))
    if fitted_length:
        position.total_steps = int(resumed.get("total_steps", position.total_steps))
