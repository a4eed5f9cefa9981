"""The training run's samples: read from the data folders, split by id, drawn into padded batches."""

from __future__ import annotations

import argparse
import hashlib
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import DFlashError
from .batch import PaddedBatch, cached_features, collate, context_features
from .data import generate_into
from .features import build_features, cache_dir, load_feature_file
from .recipe import sample_anchors
from .shards import iter_samples, shard_paths


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


@dataclass
class TrainData:
    """The samples of a run: all of them, the held-out ones, and the ones training draws from."""

    samples: list[Sample]
    held: list[Sample]
    train: list[Sample]
    report: dict[str, Any]  # the report's `data` entry


def is_heldout(sample_id: str, percent: float) -> bool:
    """A stable split by id: the same samples stay held out as the data folder grows or moves."""
    # By prompt: a regenerated reply and the dataset's answer to the same prompt share a side.
    # By conversation, too: a chat's later turns (`<id>~<k>`, see `prompt_sources.iter_sharegpt`) have its first
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


def make_batch(samples: list[Sample], anchors_per_seq: int, block_size: int, mask_token_id: int,
               gamma: float | None, g: torch.Generator) -> tuple[PaddedBatch, list[Sample]] | None:
    """One padded batch of blocks at random anchors, and the samples in it (None: no sample had room)."""
    rows, used = [], []
    for s in samples:
        anchors = sample_anchors(s.prompt_len, len(s.ids), anchors_per_seq, g)
        if anchors:
            rows.append((s.ids, anchors, s.greedy))
            used.append(s)
    if not rows:
        return None
    return collate(rows, block_size, mask_token_id, gamma), used


def batch_context(target: Any, batch: PaddedBatch, used: list[Sample], layer_ids: list[int]) -> torch.Tensor:
    """The batch's target features: from the disk cache when the samples carry them, else from the target."""
    if used[0].feats is not None:
        return cached_features([s.feats for s in used], batch.context_len)  # type: ignore[misc]
    return context_features(target, batch.ids, layer_ids)


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


def top_up(args: argparse.Namespace, target: Any, folders: list[Path], on_cuda: bool,
           progress: bool) -> dict[str, Any]:
    """`--generate N`: N more replies by the target, into the first folder or `--gen-out` (which
    then joins `folders`); returns the generation's statistics."""
    gen_out = Path(args.gen_out) if args.gen_out else folders[0]
    if gen_out not in folders:
        folders.insert(0, gen_out)
    have = len({s["id"] for s in iter_samples(gen_out)}) if gen_out.exists() else 0
    deadline = time.time() + args.gen_minutes * 60 if args.gen_minutes else None
    gen_batch = args.gen_batch or (256 if on_cuda else 16)
    stats = generate_into(
        target, gen_out, source=args.source, limit=have + args.generate, batch_size=gen_batch,
        shard_size=max(64, 2 * gen_batch), max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens, seed=args.seed, from_end=args.from_end, deadline=deadline,
        progress=progress)
    stats["batch"] = gen_batch
    return stats


def prepare_data(args: argparse.Namespace, target: Any, folders: list[Path], repeats: dict[Path, int],
                 on_cuda: bool, progress: bool) -> TrainData:
    """Optionally top up the data (`--generate`), then load and split every sample; training
    draws a folder marked `*K` K times per epoch."""
    gen_stats = top_up(args, target, folders, on_cuda, progress) if args.generate else None
    samples = [s for s in load_samples([f for f in folders if f.exists()]) if len(s.ids) > s.prompt_len + 1]
    held = [s for s in samples if is_heldout(s.id, args.holdout_percent)]
    train_samples = [s for s in samples if not is_heldout(s.id, args.holdout_percent)]
    report = {"folders": [str(f) for f in folders], "samples": len(samples),
              "reply_tokens": sum(len(s.ids) - s.prompt_len for s in samples),
              "tokens": sum(len(s.ids) for s in samples),
              "train_samples": len(train_samples), "heldout_samples": len(held),
              "answer_samples": sum(s.greedy is not None for s in samples),
              "answer_tokens": sum(len(s.ids) - s.prompt_len for s in samples if s.greedy is not None),
              "shards": sum(len(shard_paths(f)) for f in folders if f.exists()), "generated": gen_stats}
    if repeats:
        train_samples = repeat_samples(train_samples, repeats)
        report["repeats"] = {str(f): k for f, k in repeats.items()}
        report["train_draws_per_epoch"] = len(train_samples)
    return TrainData(samples, held, train_samples, report)
