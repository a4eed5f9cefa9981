"""What a hybrid target's rollback costs per block, two ways, against a plain one-token step.

- record (what ships, hybrid_cache.py): the verify pass computes its tokens' recurrent states one
  position at a time and keeps each; the rollback picks one.
- replay: the verify pass runs the fast chunked rule and keeps nothing; a block that is not
  fully accepted restores the states from before it and runs the accepted tokens again.

Random weights at a model's real shape; the accepted length per block is set, not drafted
(a forced drafter at that acceptance). Prints one table; `--json` writes it too.

    .venv/bin/python scripts/hybrid_rollback.py --shape small            # CPU
    python scripts/hybrid_rollback.py --shape qwen3.5-4b --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dflash_core.hybrid_cache import HybridTargetCache, recurrent_state_bytes
from dflash_core.targets import Target

LINEAR = ["linear_attention"] * 3 + ["full_attention"]
SHAPES = {
    # Qwen3.5-4B's text config (hub config.json), random weights.
    "qwen3.5-4b": dict(hidden_size=2560, intermediate_size=9216, num_hidden_layers=32, num_attention_heads=16,
                       num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                       linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320),
    # The same proportions, small enough for a 2-core CPU.
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                  linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=32000),
}


def build(shape: str, device: str, dtype: torch.dtype) -> Target:
    kw = SHAPES[shape]
    cfg = AutoConfig.for_model("qwen3_5_text", linear_conv_kernel_dim=4, max_position_embeddings=8192,
                               layer_types=LINEAR * (kw["num_hidden_layers"] // 4), **kw)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    return Target(model=model, tokenizer=None, name=shape, device=torch.device(device), dtype=dtype)


def sync(target: Target) -> None:
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)


@torch.inference_mode()
def snapshot(cache: HybridTargetCache) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    return [(layer.conv_states[0].clone(), layer.recurrent_states[0].clone(), layer.length)
            for layer in cache.recurrent]


@torch.inference_mode()
def restore(cache: HybridTargetCache, snap: list[tuple[torch.Tensor, torch.Tensor, int]], length: int) -> None:
    for layer, (conv, rec, n) in zip(cache.recurrent, snap, strict=True):
        layer.conv_states[0] = conv
        layer.recurrent_states[0].copy_(rec)
        layer.cumulative_length_linear.fill_(n)
    for layer in cache.attention:
        layer.length = length


def one_block(target: Target, cache: HybridTargetCache, way: str, ids: torch.Tensor, accepted: int,
              start: int) -> int:
    """One verify pass of `ids` at `start` keeping `accepted` drafts (+ the anchor); returns the
    bytes the recurrent layers held right after the pass."""
    block = ids.shape[1]
    if way == "record":
        target.forward(ids, cache)
        held = recurrent_state_bytes(cache)
        cache.truncate(start + accepted + 1)
        return held
    cache.max_rollback = 0  # passes record nothing
    snap = snapshot(cache)
    target.forward(ids, cache)
    held = recurrent_state_bytes(cache) + sum(c.numel() * c.element_size() + r.numel() * r.element_size()
                                              for c, r, _ in snap)
    if accepted + 1 < block:
        restore(cache, snap, start)
        target.forward(ids[:, : accepted + 1], cache)
    return held


def measure(target: Target, way: str, block: int, accepted: int, context: int, repeats: int) -> dict[str, float]:
    vocab = target.vocab_size
    prompt = (torch.arange(context, device=target.device)[None] * 7919) % vocab
    times, held = [], 0
    for rep in range(repeats + 1):
        cache = HybridTargetCache.for_config(target.config, context + block * 4, max_rollback=block)
        target.forward(prompt, cache)
        start = context
        ids = (torch.arange(block, device=target.device)[None] * 31 + rep) % vocab
        sync(target)
        t0 = time.perf_counter()
        held = one_block(target, cache, way, ids, accepted, start)
        sync(target)
        if rep:  # the first is a warm-up
            times.append((time.perf_counter() - t0) * 1e3)
    return {"ms": statistics.median(times), "held_mb": held / 2**20}


def plain_step(target: Target, context: int, repeats: int) -> float:
    vocab = target.vocab_size
    prompt = (torch.arange(context, device=target.device)[None] * 7919) % vocab
    cache = HybridTargetCache.for_config(target.config, context + repeats + 2, max_rollback=0)
    target.forward(prompt, cache)
    times = []
    for rep in range(repeats + 1):
        sync(target)
        t0 = time.perf_counter()
        target.forward(prompt[:, rep % context : rep % context + 1], cache)
        sync(target)
        if rep:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--accepted", type=int, nargs="+", default=[0, 3, 7, 15])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    target = build(args.shape, args.device, getattr(torch, args.dtype))
    step = plain_step(target, args.context, args.repeats * 4)
    rows = []
    print(f"hybrid rollback, {args.shape} ({target.num_layers} layers), {args.device} {args.dtype}, "
          f"block {args.block}, context {args.context}; plain step {step:.1f} ms")
    print(f"{'accepted':>8} | {'record ms':>9} {'x step':>6} {'MB':>6} | {'replay ms':>9} {'x step':>6} {'MB':>6}")
    for a in args.accepted:
        r = measure(target, "record", args.block, a, args.context, args.repeats)
        p = measure(target, "replay", args.block, a, args.context, args.repeats)
        rows.append({"accepted": a, "record": r, "replay": p})
        print(f"{a:>8} | {r['ms']:>9.1f} {r['ms'] / step:>6.2f} {r['held_mb']:>6.1f} | "
              f"{p['ms']:>9.1f} {p['ms'] / step:>6.2f} {p['held_mb']:>6.1f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "plain_step_ms": step,
                                         "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
