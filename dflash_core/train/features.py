"""Target features for training, computed once and cached on disk as fp16.

For every sample of a data folder (see `shards.py`), the target reads prompt + response once
and we keep its hidden states at the drafter's `target_layer_ids`, concatenated: exactly the
context the drafter gets at inference. One `feats-NNNNN.safetensors` per data shard holds all
its sequences end to end ([sum of lengths, len(layer_ids) * H], fp16) plus the token ids and
offsets; files are written atomically and a rerun skips shards already done with the same
layers, so a killed run loses at most one shard.

    python -m dflash_core.train.features --data data/smollm2-sharegpt --out runs/features/smollm2-l1-25
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .shards import read_shard, shard_paths

FEATURE_VERSION = 1


@dataclass
class Sequence:
    """One training sequence: token ids, where the response starts, and target features."""

    id: str
    ids: torch.Tensor  # [L] long
    prompt_len: int
    feats: torch.Tensor  # [L, len(layer_ids) * H] fp16


def feature_name(shard: Path) -> str:
    return "feats-" + shard.name.split("-")[1].split(".")[0] + ".safetensors"


@torch.inference_mode()
def sequence_features(target: Any, seqs: list[list[int]], layer_ids: list[int], batch_tokens: int = 4096,
                      greedy: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Concatenated hidden states [L, n*H] (fp16, CPU) for each sequence.

    Sequences are batched by length with RIGHT padding and no attention mask: the target is
    causal, so padding after a sequence cannot change its features. With a `greedy` list, it
    also receives each sequence's target argmax [L] (entry p: the target's choice for
    position p + 1 after reading tokens 0..p), from the same forward pass.
    """
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list[torch.Tensor | None] = [None] * len(seqs)
    best: list[torch.Tensor | None] = [None] * len(seqs)
    i = 0
    while i < len(order):
        width = len(seqs[order[i]])
        j = i
        while j < len(order) and (j - i + 1) * len(seqs[order[j]]) <= max(batch_tokens, len(seqs[order[j]])):
            width = len(seqs[order[j]])
            j += 1
        idx = order[i:j]
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        for r, k in enumerate(idx):
            ids[r, : len(seqs[k])] = torch.tensor(seqs[k])
        res = target.model(input_ids=ids.to(target.device), output_hidden_states=True, use_cache=False,
                           logits_to_keep=0 if greedy is not None else 1)
        # hidden_states[0] is the embedding output, so layer i's output is at i + 1.
        cat = torch.cat([res.hidden_states[li + 1] for li in layer_ids], dim=-1).to("cpu", torch.float16)
        top = res.logits.argmax(-1).cpu() if greedy is not None else None
        for r, k in enumerate(idx):
            out[k] = cat[r, : len(seqs[k])].clone()
            if top is not None:
                best[k] = top[r, : len(seqs[k])].clone()
        i = j
    if greedy is not None:
        greedy.extend(b for b in best if b is not None)
    return [o for o in out if o is not None]


def cache_dir(cache_root: str | os.PathLike[str], data_folder: str | os.PathLike[str]) -> Path:
    """Where the features of one data folder live under a cache root (keyed by its full path,
    so two folders with the same name never share a cache)."""
    folder = Path(data_folder)
    key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:10]
    return Path(cache_root) / f"{folder.name}-{key}"


def write_feature_file(dest: Path, shard: Path, samples: list[dict[str, Any]], feats: list[torch.Tensor],
                       layer_ids: list[int]) -> None:
    """One shard's features, atomically (see the module doc for the layout)."""
    from safetensors.torch import save_file

    seqs = [s["prompt_ids"] + s["response_ids"] for s in samples]
    lengths = [len(q) for q in seqs]
    tensors = {
        "features": torch.cat(feats).contiguous(),
        "input_ids": torch.tensor([t for q in seqs for t in q], dtype=torch.int32),
        "offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64),
        "prompt_lens": torch.tensor([len(s["prompt_ids"]) for s in samples], dtype=torch.int32),
    }
    meta = {**_meta_for(layer_ids), "ids": json.dumps([s["id"] for s in samples]), "data_shard": shard.name}
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, dest)


def _meta_for(layer_ids: list[int]) -> dict[str, str]:
    return {"layer_ids": json.dumps(list(layer_ids)), "version": str(FEATURE_VERSION)}


def build_features(target: Any, data: str | os.PathLike[str], out: str | os.PathLike[str], layer_ids: list[int],
                   batch_tokens: int = 4096, progress: bool = True) -> list[Path]:
    """Features for every data shard not yet done; returns all feature files."""
    from tqdm import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards = shard_paths(data)
    files = []
    bar = tqdm(shards, unit="shard", disable=not progress, mininterval=1 if sys.stderr.isatty() else 30)
    n_tok, t0 = 0, time.time()
    for shard in bar:
        dest = out / feature_name(shard)
        files.append(dest)
        samples = read_shard(shard)
        if dest.is_file():
            meta = _meta(dest)
            if meta.get("version") == str(FEATURE_VERSION) and covers(meta, layer_ids) and meta.get(
                    "ids") == json.dumps([s["id"] for s in samples]):
                continue
        seqs = [s["prompt_ids"] + s["response_ids"] for s in samples]
        write_feature_file(dest, shard, samples, sequence_features(target, seqs, layer_ids, batch_tokens), layer_ids)
        n_tok += sum(len(q) for q in seqs)
        bar.set_postfix(tok_s=f"{n_tok / (time.time() - t0):.0f}")
    return files


def _meta(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32,
           "I64": torch.int64}


def map_safetensors(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A safetensors file's tensors as views of a private memory map, and its metadata.

    All the feature files of a run can exceed RAM (~4 KB per token for two layers), but a
    training step reads a few thousand tokens of them: mapped, the OS pages in what batches
    touch and can evict it again, where `load_file` would copy everything into the heap.
    """
    import mmap

    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # copy-on-write: writable, never saved
    n = int.from_bytes(mm[:8], "little")
    header = json.loads(mm[8:8 + n])
    meta = header.pop("__metadata__", None) or {}
    out = {}
    for name, h in header.items():
        dtype, (b, e) = _DTYPES[h["dtype"]], h["data_offsets"]
        numel = (e - b) // dtype.itemsize
        t = torch.frombuffer(mm, dtype=dtype, count=numel, offset=8 + n + b) if numel else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(h["shape"])
    return out, meta


def _run_start(have: list[int], layer_ids: list[int]) -> int | None:
    """Where `layer_ids` start as a run of adjacent entries of `have`; None if they are not one."""
    n = len(layer_ids)
    return next((i for i in range(len(have) - n + 1) if have[i:i + n] == list(layer_ids)), None) if n else None


def covers(meta: dict[str, str], layer_ids: list[int]) -> bool:
    """Whether a feature file holds `layer_ids` as a run of adjacent column blocks, so that they
    are a view of it (one cache of layers [1, 27, 29] serves drafters on [1, 27] or [27, 29])."""
    return _run_start(json.loads(meta.get("layer_ids", "[]")), layer_ids) is not None


def load_feature_file(path: str | os.PathLike[str], layer_ids: list[int] | None = None) -> list[Sequence]:
    """A feature file's sequences, their features as views of the memory map; with `layer_ids`,
    only those layers' columns (they must be adjacent in the file, see `covers`)."""
    t, meta = map_safetensors(path)
    ids = json.loads(meta["ids"])
    off = t["offsets"].tolist()
    feats = t["features"]
    if layer_ids is not None:
        have = json.loads(meta["layer_ids"])
        start = _run_start(have, layer_ids)
        if start is None:
            raise ValueError(f"{path} holds target layers {have}, not {list(layer_ids)} side by side")
        width = feats.shape[1] // len(have)
        feats = feats.narrow(1, start * width, len(layer_ids) * width)
    return [Sequence(id=ids[k], ids=t["input_ids"][off[k]:off[k + 1]].long(), prompt_len=int(t["prompt_lens"][k]),
                     feats=feats[off[k]:off[k + 1]]) for k in range(len(ids))]


def main() -> None:
    from ..drafter_config import default_target_layer_ids
    from ..targets import load_target

    ap = argparse.ArgumentParser(prog="python -m dflash_core.train.features")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--target", default="embedded")
    ap.add_argument("--layers", default="", help="comma-separated target layer ids (default: spread)")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the target's dtype for the pass (bfloat16: ~2.5x faster on CPUs with AMX)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target, device="cpu", dtype=args.dtype)
    layers = ([int(x) for x in args.layers.split(",")] if args.layers
              else default_target_layer_ids(target.num_layers, args.draft_layers))
    files = build_features(target, args.data, args.out, layers, args.batch_tokens)
    print(f"[features] {len(files)} files in {args.out} (layers {layers})")


if __name__ == "__main__":
    main()
