"""Training data from a dataset's OWN answers, labelled by the target in one forward pass.

Regenerating replies (`data.py generate`) gives exact labels but costs a decode step per token
(~50-70 tok/s on 2 CPU cores). Here the target reads prompt + the dataset's answer once
(~500 tok/s) and records its argmax at every position: `greedy_ids[j]` is the token the target
would put at response position j after reading everything before it.

That is enough for exact labels (`recipe.build_blocks` with `greedy`): a block anchored at a
wants the target's greedy continuation after a. Its first token is greedy[a + 1] whatever the
text; its k-th is greedy[a + k] as long as the text agrees with the target at a + 1 .. a + k - 1
(the target then read exactly what it would have written). After the first disagreement the
answer's text is no longer the target's context, so those positions carry no label. Samples
are ordinary data shards with one more field, so `features.py` and training read them as is;
`--features-cache` writes the features from the same pass, saving a second read.

    python -m dflash_core.train.answers --out data/smollm2-sharegpt-answers --features-cache runs/features-shared
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from .data import chat_ids
from .features import cache_dir, feature_name, sequence_features, write_feature_file
from .prompt import Prompt
from .prompt_sources import EvalFilter, load_prompts
from .shards import done_ids, encode_shard, shard_paths, write_atomic, write_manifest

ID_SUFFIX = "#answer"  # a prompt may also have a regenerated reply; ids must stay unique
_MARKUP = re.compile(r"<(div|p|span|pre|code|br|ol|ul|li)\b", re.I)  # early ShareGPT scraped HTML


def answer_ids(target: Any, p: Prompt, max_prompt_tokens: int, max_answer_tokens: int
               ) -> tuple[list[int], list[int]] | None:
    """(prompt ids at the chat template, answer ids ended by EOS unless cut), or None to skip."""
    if not p.answer.strip() or _MARKUP.search(p.answer):
        return None
    prompt = chat_ids(target, p, max_prompt_tokens)
    if prompt is None:
        return None
    ans = list(target.tokenizer(p.answer.strip(), add_special_tokens=False)["input_ids"])
    ans = ans[:max_answer_tokens] if len(ans) >= max_answer_tokens else [*ans, min(target.eos_ids)]
    return (prompt, ans) if len(ans) >= 2 else None


def label_samples(target: Any, pairs: list[tuple[str, list[int], list[int]]], layer_ids: list[int] | None,
                  batch_tokens: int = 4096) -> tuple[list[dict[str, Any]], list[torch.Tensor]]:
    """Samples with `greedy_ids` for (id, prompt ids, answer ids), plus their features when
    `layer_ids` is given (the features come from the same forward; [] otherwise)."""
    seqs = [p + a for _, p, a in pairs]
    best: list[torch.Tensor] = []
    feats = sequence_features(target, seqs, layer_ids or [0], batch_tokens, greedy=best)
    samples = []
    for (sid, prompt, ans), top in zip(pairs, best, strict=True):
        # top[p] is the choice for position p + 1, so response position j comes from p = len(prompt) - 1 + j.
        greedy = top[len(prompt) - 1: len(prompt) - 1 + len(ans)].tolist()
        samples.append({"id": sid, "prompt_ids": prompt, "response_ids": ans, "greedy_ids": greedy,
                        "label_dtype": str(target.dtype).removeprefix("torch.")})
    return samples, (feats if layer_ids else [])


def agreement(samples: list[dict[str, Any]]) -> float:
    """Share of answer tokens equal to the target's own choice there (teacher-forced)."""
    hit = sum(sum(a == g for a, g in zip(s["response_ids"], s["greedy_ids"], strict=True)) for s in samples)
    return hit / max(1, sum(len(s["response_ids"]) for s in samples))


FIELDS = ("id", "prompt_ids", "response_ids", "greedy_ids")


def _summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    # Samples from before the field existed were labelled in float32.
    dtypes = Counter(smp.get("label_dtype", "float32") for smp in samples)
    return {"agreement": round(agreement(samples), 4), "label_dtypes": dict(dtypes)}


def label_into(target: Any, out: str | Path, *, source: str = "sharegpt", limit: int = 0, shard_size: int = 64,
               max_prompt_tokens: int = 384, max_answer_tokens: int = 256, seed: int = 0,
               features_cache: str | Path | None = None, layer_ids: list[int] | None = None,
               batch_tokens: int = 4096, deadline: float | None = None, progress: bool = True) -> dict[str, Any]:
    """Label answers until `out` holds `limit` samples (0: all), or `deadline` (time.time())
    passes; one shard at a time, so an interrupted run keeps every finished shard."""
    from tqdm import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if features_cache is not None and not layer_ids:
        raise ValueError("--features-cache needs the target layer ids")
    stats: dict[str, int] = {}
    settings = {"target": target.name, "source": source, "kind": "dataset answers, teacher-forced", "seed": seed,
                "max_prompt_tokens": max_prompt_tokens, "max_answer_tokens": max_answer_tokens}
    prompts = load_prompts(source, seed=seed, stats=stats)
    filt = EvalFilter.default()
    done = done_ids(out)
    shards = shard_paths(out)
    next_shard = int(shards[-1].name.split("-")[1].split(".")[0]) + 1 if shards else 0
    want = (limit - len(done)) if limit else len(prompts)
    for k in ("no_answer", "answer_eval_overlap", "skipped"):
        stats[k] = 0
    todo = (p for p in prompts if p.id + ID_SUFFIX not in done)
    bar = tqdm(total=max(want, 0), unit="sample", disable=not progress, mininterval=1 if sys.stderr.isatty() else 30)
    made = tokens = 0
    t0 = time.time()
    last = 0.0
    while made < want and (deadline is None or time.time() + last < deadline):
        ts = time.time()
        pairs: list[tuple[str, list[int], list[int]]] = []
        for p in todo:
            if not p.answer.strip():
                stats["no_answer"] += 1
                continue
            if filt.hit(p.answer):
                stats["answer_eval_overlap"] += 1
                continue
            got = answer_ids(target, p, max_prompt_tokens, max_answer_tokens)
            if got is None:
                stats["skipped"] += 1
                continue
            pairs.append((p.id + ID_SUFFIX, *got))
            if len(pairs) >= min(shard_size, want - made):
                break
        if not pairs:
            break
        samples, feats = label_samples(target, pairs, layer_ids if features_cache is not None else None, batch_tokens)
        shard = out / f"shard-{next_shard:05d}.jsonl.gz"
        write_atomic(shard, encode_shard(samples))
        if features_cache is not None and layer_ids:
            write_feature_file(cache_dir(features_cache, out) / feature_name(shard), shard, samples, feats, layer_ids)
        next_shard += 1
        made += len(samples)
        tokens += sum(len(s["response_ids"]) for s in samples)
        last = time.time() - ts
        bar.update(len(samples))
        bar.set_postfix(tok_s=f"{tokens / (time.time() - t0):.0f}", agree=f"{agreement(samples):.2f}")
        write_manifest(out, settings, stats, FIELDS, _summary)
    bar.close()
    write_manifest(out, settings, stats, FIELDS, _summary)
    return {"made": made, "answer_tokens": tokens, "seconds": round(time.time() - t0, 1)}


def main(argv: list[str] | None = None) -> None:
    from ..drafter_config import default_target_layer_ids
    from ..targets import load_target

    ap = argparse.ArgumentParser(prog="python -m dflash_core.train.answers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--source", default="sharegpt",
                    help="sharegpt (first turns), sharegpt-later (later turns, with the chat before them), "
                         "python-stdlib / pycode:DIR (coding requests; the answer is the function's own source), "
                         "a ShareGPT .json, or a JSONL of {prompt, answer}")
    ap.add_argument("--target", default="embedded")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32",
                    help="bfloat16 labels ~2.5x faster on a CPU with AMX (measured here: 850-900 against 350 "
                         "tok/s); 2.3%% of its labels differ from float32's argmax, all at near-ties "
                         "(top-2 logit margin < 0.5), where a drafter cannot tell the two apart either")
    ap.add_argument("--limit", type=int, default=0, help="total samples wanted in --out (0: all)")
    ap.add_argument("--minutes", type=float, default=0, help="stop after this many minutes (0: no limit)")
    ap.add_argument("--shard-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--max-answer-tokens", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--features-cache", default=None, help="also write the features of these layers here "
                    "(the `train --feature-cache` root), from the same forward pass")
    ap.add_argument("--layers", default="", help="comma-separated target layer ids (default: spread)")
    ap.add_argument("--draft-layers", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(args.target, device=args.device, dtype=args.dtype)
    layers = ([int(x) for x in args.layers.split(",")] if args.layers
              else default_target_layer_ids(target.num_layers, args.draft_layers))
    deadline = time.time() + args.minutes * 60 if args.minutes else None
    res = label_into(target, args.out, source=args.source, limit=args.limit, shard_size=args.shard_size,
                     max_prompt_tokens=args.max_prompt_tokens, max_answer_tokens=args.max_answer_tokens,
                     features_cache=args.features_cache, layer_ids=layers if args.features_cache else None,
                     batch_tokens=args.batch_tokens, deadline=deadline)
    print(f"[answers] {json.dumps(res)}", flush=True)


if __name__ == "__main__":
    main()
