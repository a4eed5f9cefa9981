"""Regenerate the TARGET's own replies to training prompts, into a folder of shards.

The drafter learns to imitate the target, so its data are the target's replies, regenerated
here from the prompts of `prompt_sources.py` (ShareGPT's first human turns by default) and
written as the shards of `shards.py` (~64 samples each: {"id", "prompt_ids", "response_ids",
"temperature"}). A rerun skips prompts already in a shard.

    python -m dflash_core.train.data generate --out data/smollm2-sharegpt --limit 2000
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from .prompt import Prompt
from .prompt_sources import load_prompts
from .shards import done_ids, encode_shard, shard_paths, write_atomic, write_manifest


def sampling_temperature(pid: str, seed: int, sample_share: float, t_min: float, t_max: float) -> float:
    """0.0 (greedy) or a temperature, fixed per prompt id so reruns make the same choice."""
    h = int.from_bytes(hashlib.sha256(f"{seed}:{pid}".encode()).digest()[:8], "big") / 2**64
    if h >= sample_share:
        return 0.0
    u = (h / sample_share) if sample_share > 0 else 0.0
    return round(t_min + u * (t_max - t_min), 3)


def per_row_temperature_processor(temps: list[float]) -> Any:
    """A logits processor that makes each row greedy (temperature 0) or scales it by its own
    temperature, so greedy and sampled prompts share one batch (better length sorting)."""
    import torch
    from transformers import LogitsProcessor

    class _PerRow(LogitsProcessor):
        def __init__(self) -> None:
            self.t = torch.tensor(temps, dtype=torch.float32)

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            t = self.t.to(scores.device)[:, None]
            greedy = t == 0
            onehot = torch.full_like(scores, float("-inf"))
            onehot.scatter_(1, scores.argmax(-1, keepdim=True), 0.0)
            return torch.where(greedy, onehot, scores / t.clamp_min(1e-6).to(scores.dtype))

    return _PerRow()


def generate_batch(target: Any, prompts: list[list[int]], temps: list[float], max_new_tokens: int,
                   eos: set[int], pad_id: int) -> list[list[int]]:
    """Replies (up to and including the first EOS) for a batch of token-id prompts."""
    import torch
    from transformers import GenerationConfig, LogitsProcessorList

    dev = target.device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):  # left padding: every row's next token is at the end
        ids[r, width - len(p):] = torch.tensor(p)
        attn[r, width - len(p):] = 1
    gcfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                            eos_token_id=sorted(eos), pad_token_id=pad_id)
    with torch.inference_mode():
        out = target.model.generate(input_ids=ids.to(dev), attention_mask=attn.to(dev), generation_config=gcfg,
                                    logits_processor=LogitsProcessorList([per_row_temperature_processor(temps)]))
    replies = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        replies.append(row[:cut])
    return replies


def generate_into(
    target: Any,
    out: str | os.PathLike[str],
    *,
    source: str = "sharegpt",
    limit: int = 0,
    batch_size: int = 16,
    shard_size: int = 64,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 384,
    max_prompt_chars: int = 4000,
    sample_share: float = 0.25,
    t_min: float = 0.7,
    t_max: float = 1.0,
    seed: int = 0,
    decontaminate: bool = True,
    from_end: bool = False,
    skip_ids_in: Iterable[str | os.PathLike[str]] = (),
    deadline: float | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Regenerate replies with an already loaded `target` until `out` holds `limit` samples
    (0: every prompt), or until the wall clock passes `deadline` (time.time()). Returns stats.

    `from_end` walks the shuffled prompts from the end: a second machine topping up a copy of a
    folder that another process fills from the start then makes no duplicate prompts.
    `skip_ids_in` names sibling folders whose prompts are not made again here (a folder topping
    up earlier ones from the same source); they do not count towards `limit`.
    The deadline is checked before each batch, using the last batch's time as the estimate, so
    a time-boxed run (a GPU lease) stops in time and keeps what it made.
    """
    import torch
    from tqdm import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stats: dict[str, int] = {}
    t0 = time.time()
    prompts = load_prompts(source, seed=seed, max_chars=max_prompt_chars, decontaminate=decontaminate, stats=stats)
    if from_end:
        prompts.reverse()
    print(f"[data] prompts: {json.dumps(stats)} ({time.time() - t0:.0f}s)", flush=True)
    done = done_ids(out)
    skip_ids_in = [Path(d) for d in skip_ids_in]
    for d in skip_ids_in:  # a mistyped folder would silently make duplicates
        if not shard_paths(d):
            raise FileNotFoundError(f"--skip-ids-in {d}: no data shards there")
    ours = {p.id for p in prompts}
    elsewhere = (set().union(*(done_ids(d) for d in skip_ids_in)) & ours) - done
    shards = shard_paths(out)
    next_shard = int(shards[-1].name.split("-")[1].split(".")[0]) + 1 if shards else 0
    tok = target.tokenizer
    eos = target.eos_ids
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    settings = {"target": target.name, "source": source, "seed": seed, "max_new_tokens": max_new_tokens,
                "max_prompt_tokens": max_prompt_tokens, "sample_share": sample_share,
                "temperature_range": [t_min, t_max], "from_end": from_end,
                "skip_ids_in": [str(d) for d in skip_ids_in],
                "dtype": str(target.dtype).removeprefix("torch."), "device": str(target.device)}
    stats["too_many_tokens"] = 0

    pending = [p for p in prompts if p.id not in done and p.id not in elsewhere]
    want = limit - len(done) if limit else len(pending)
    print(f"[data] {len(done)} samples already in {out}"
          f"{f' ({len(elsewhere)} more in sibling folders, skipped)' if skip_ids_in else ''}; "
          f"generating up to {max(want, 0)} more", flush=True)
    todo = iter(pending)
    bar = tqdm(total=max(want, 0), unit="sample", dynamic_ncols=True, disable=not progress,
               mininterval=1 if sys.stderr.isatty() else 30)
    made, gen_tokens, t_start, last_batch_s = 0, 0, time.time(), 0.0
    timed_out = False
    while made < want and not timed_out:
        chunk = _next_chunk(todo, min(shard_size, want - made), target, max_prompt_tokens, stats)
        if not chunk:
            break
        # Sorting by length before batching cuts left padding (the prompts' cost per step).
        chunk.sort(key=lambda c: len(c[1]))
        samples = []
        for b in range(0, len(chunk), batch_size):
            if deadline is not None and time.time() + last_batch_s > deadline:
                timed_out = True
                break
            tb = time.time()
            batch = chunk[b: b + batch_size]
            temps = [sampling_temperature(p.id, seed, sample_share, t_min, t_max) for p, _ in batch]
            torch.manual_seed(hash((seed, next_shard, b)) & 0x7FFFFFFF)
            replies = generate_batch(target, [ids for _, ids in batch], temps, max_new_tokens, eos, pad_id)
            for (p, ids), reply, t in zip(batch, replies, temps, strict=True):
                samples.append({"id": p.id, "prompt_ids": ids, "response_ids": reply, "temperature": t})
                gen_tokens += len(reply)
            last_batch_s = time.time() - tb
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{gen_tokens / (time.time() - t_start):.1f}", shard=next_shard)
        if samples:  # a time-boxed stop keeps the finished batches of this shard
            write_atomic(out / f"shard-{next_shard:05d}.jsonl.gz", encode_shard(samples))
            next_shard += 1
            made += len(samples)
            write_manifest(out, settings, stats)
    bar.close()
    write_manifest(out, settings, stats)
    dt = time.time() - t_start
    print(f"[data] made {made} samples, {gen_tokens} reply tokens in {dt:.0f}s "
          f"({gen_tokens / max(dt, 1e-9):.1f} tok/s); skipped {stats['too_many_tokens']} over "
          f"{max_prompt_tokens} prompt tokens{' (stopped by the time budget)' if timed_out else ''}", flush=True)
    return {"made": made, "reply_tokens": gen_tokens, "seconds": round(dt, 1),
            "tok_s": round(gen_tokens / max(dt, 1e-9), 1), "timed_out": timed_out, "prompt_filter": stats}


def run_generate(args: argparse.Namespace) -> None:
    import torch

    from ..targets import load_target

    torch.set_num_threads(args.threads)
    target = load_target(args.target, device=args.device, dtype=args.dtype)
    deadline = time.time() + args.minutes * 60 if args.minutes else None  # from here: loading is not counted
    generate_into(target, args.out, source=args.source, limit=args.limit, batch_size=args.batch_size,
                  shard_size=args.shard_size, max_new_tokens=args.max_new_tokens,
                  max_prompt_tokens=args.max_prompt_tokens, max_prompt_chars=args.max_prompt_chars,
                  sample_share=args.sample_share, t_min=args.t_min, t_max=args.t_max, seed=args.seed,
                  decontaminate=not args.no_decontaminate, from_end=args.from_end, skip_ids_in=args.skip_ids_in,
                  deadline=deadline)


def chat_ids(target: Any, p: Prompt, max_tokens: int) -> list[int] | None:
    """`p`'s chat at the target's template in at most `max_tokens` tokens: whole older exchanges
    are dropped until it fits (the prompt itself is never cut); None when even the prompt alone
    is too long."""
    history = list(p.history)
    # A cheap first cut by characters spares tokenising long chats many times over: a chat over 6
    # characters per allowed token cannot fit (English text runs at about 4).
    while history and sum(len(t) for _, t in history) + len(p.text) > 6 * max_tokens:
        history = history[2:]
    while True:
        ids = target.encode_chat(replace(p, history=tuple(history)).messages())
        if len(ids) <= max_tokens:
            return ids
        if not history:
            return None
        history = history[2:]  # the oldest user turn and its reply


def _next_chunk(todo: Iterator[Prompt], n: int, target: Any, max_tokens: int,
                stats: dict[str, int]) -> list[tuple[Prompt, list[int]]]:
    chunk: list[tuple[Prompt, list[int]]] = []
    for p in todo:
        ids = chat_ids(target, p, max_tokens)
        if ids is None:
            stats["too_many_tokens"] += 1
            continue
        chunk.append((p, ids))
        if len(chunk) >= n:
            break
    return chunk


def main(argv: Iterable[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dflash_core.train.data")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="regenerate replies with the target (resumable)")
    g.add_argument("--out", required=True)
    g.add_argument("--source", default="sharegpt",
                   help="sharegpt, sharegpt-later, python-stdlib, pycode:DIR, synthetic-math[:N] (N word problems, "
                        "the same ones whatever --seed: it only orders them), pkg:NAME[,NAME] (chat prompt collections "
                        "inside packages: ifbench, chatterbot), a ShareGPT .json, or a JSONL of {prompt}")
    g.add_argument("--target", default="embedded")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="float32")
    g.add_argument("--limit", type=int, default=0, help="total samples wanted in --out (0: all prompts)")
    g.add_argument("--batch-size", type=int, default=16)
    g.add_argument("--minutes", type=float, default=0.0,
                   help="time box from when the target has loaded (prompt loading counts): no batch starts that "
                        "would end past it (0: none)")
    g.add_argument("--shard-size", type=int, default=64)
    g.add_argument("--threads", type=int, default=1)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--max-prompt-tokens", type=int, default=384)
    g.add_argument("--max-prompt-chars", type=int, default=4000)
    g.add_argument("--sample-share", type=float, default=0.25, help="share of prompts sampled, not greedy")
    g.add_argument("--t-min", type=float, default=0.7)
    g.add_argument("--t-max", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-decontaminate", action="store_true")
    g.add_argument("--from-end", action="store_true",
                   help="walk the shuffled prompts from the end: a second process filling another folder at the "
                        "same time makes no duplicate prompts until the two walks meet (stop both before; train "
                        "on both folders)")
    g.add_argument("--skip-ids-in", action="append", default=[], metavar="DIR",
                   help="skip prompts whose replies another folder already holds (repeatable): top up earlier "
                        "folders from the same source without duplicates")
    p = sub.add_parser("prompts", help="load and filter prompts, print the counts")
    p.add_argument("--source", default="sharegpt", help="as for generate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="also write them to this JSONL(.gz) of {id, prompt, answer}: a small, "
                   "already filtered source for a machine without the ShareGPT package (a GPU lease)")
    args = ap.parse_args(list(argv) if argv is not None else None)
    if args.cmd == "generate":
        run_generate(args)
    else:
        stats: dict[str, int] = {}
        prompts = load_prompts(args.source, seed=args.seed, stats=stats)
        print(json.dumps(stats))
        if args.out:
            lines = "".join(json.dumps({"id": q.id, "prompt": q.text, **({"answer": q.answer} if q.answer else {}),
                                        **({"history": [list(m) for m in q.history]} if q.history else {})})
                            + "\n" for q in prompts).encode()
            write_atomic(Path(args.out), gzip.compress(lines, 9, mtime=0) if args.out.endswith(".gz") else lines)
            print(f"wrote {len(prompts)} prompts to {args.out}")
        for q in prompts[:5]:
            print(q.id, repr(q.text[:100]))


if __name__ == "__main__":
    main()
