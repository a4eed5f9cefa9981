"""Benchmark decoding methods on a prompt set: speed, acceptance length τ, and exactness.

A `Method` is a name plus `run(turns, config) -> RunResult`. The runner rotates the order of the
methods per prompt, so slow drift in the machine (thermal throttling, a neighbour's job) lands
on every method alike. The first method is the baseline that speed-ups and exactness are
measured against; adding a method (transformers' generate, prompt lookup, another block size)
means writing one more `Method` and putting it in the list.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from .config import GenerationConfig
from .engine import Engine
from .errors import DFlashError
from .events import Finished
from .prompt_sets import Turns

PROMPT_PREVIEW_CHARS = 200
WARMUP_TOKENS = 8


@dataclass
class RunResult:
    """One method's answer to one (possibly multi-turn) prompt."""

    ids: list[int]  # the replies' token ids, all turns concatenated
    seconds: float
    replies: list[str] = field(default_factory=list)
    tau: float | None = None  # committed tokens per target forward; None for methods without drafts
    blocks: int = 0  # target forwards after the prefill


@dataclass
class Method:
    name: str
    run: Callable[[Turns, GenerationConfig], RunResult]


def _drain(events: Any) -> Finished:
    for ev in events:
        if isinstance(ev, Finished):
            return ev
    raise RuntimeError("generate() ended without a Finished event")


def engine_method(engine: Engine, name: str, *, plain: bool, **overrides: Any) -> Method:
    """Plain or DFlash decoding with `engine`; `overrides` pin settings such as block_size."""

    def run(turns: Turns, config: GenerationConfig) -> RunResult:
        cfg = config.with_(**overrides) if overrides else config
        messages: list[dict[str, str]] = []
        ids: list[int] = []
        replies: list[str] = []
        seconds = 0.0
        committed = 0.0
        blocks = 0
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            fin = _drain(engine.generate(messages, cfg, plain=plain))
            # Each method continues from its OWN replies, as a real chat would.
            messages.append({"role": "assistant", "content": fin.text})
            ids.extend(fin.token_ids)
            replies.append(fin.text)
            seconds += fin.elapsed_s  # the engine's clock: prefill included, our bookkeeping not
            committed += fin.tau * fin.blocks
            blocks += fin.blocks
        tau = None if plain else (committed / blocks if blocks else 1.0)
        return RunResult(ids=ids, seconds=seconds, replies=replies, tau=tau, blocks=blocks)

    return Method(name=name, run=run)


def hf_generate_method(engine: Engine, name: str, *, prompt_lookup: int = 0) -> Method:
    """transformers' own `generate` on the same target: plain, or prompt-lookup decoding
    (`prompt_lookup_num_tokens`), the peers DFlash has to beat. Stop strings are not applied."""
    import time

    target = engine.target

    def run(turns: Turns, config: GenerationConfig) -> RunResult:
        messages: list[dict[str, str]] = []
        ids: list[int] = []
        replies: list[str] = []
        seconds = 0.0
        eos = sorted(target.eos_ids)
        sampling = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        if not config.greedy:
            sampling = {"do_sample": True, "temperature": config.temperature, "top_p": config.top_p,
                        "top_k": config.top_k or None}
            torch.manual_seed(config.seed)
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            prompt = torch.tensor([engine.prompt_ids(messages)], device=target.device)
            extra = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = target.model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                            max_new_tokens=config.max_new_tokens, eos_token_id=eos,
                                            pad_token_id=eos[0] if eos else None, **sampling, **extra)
            seconds += time.perf_counter() - t0
            new = out[0, prompt.shape[1]:].tolist()
            ids.extend(new)
            reply = target.decode(new)
            replies.append(reply)
            messages.append({"role": "assistant", "content": reply})
        return RunResult(ids=ids, seconds=seconds, replies=replies)

    return Method(name=name, run=run)


METHOD_NAMES = ("plain", "dflash", "hf-generate", "prompt-lookup")


def make_methods(engine: Engine, names: Sequence[str] = ("plain", "dflash")) -> list[Method]:
    """Methods by name; the first is the baseline that speed-ups and exactness are measured against."""
    unknown = [n for n in names if n not in METHOD_NAMES]
    if unknown or not names:
        raise DFlashError(f"unknown bench method(s) {unknown}; choose from {', '.join(METHOD_NAMES)}")
    build = {
        "plain": lambda: engine_method(engine, "plain", plain=True),
        "dflash": lambda: engine_method(engine, "dflash", plain=False),
        "hf-generate": lambda: hf_generate_method(engine, "hf-generate"),
        "prompt-lookup": lambda: hf_generate_method(engine, "prompt-lookup", prompt_lookup=10),
    }
    return [build[n]() for n in names]


def default_methods(engine: Engine) -> list[Method]:
    return make_methods(engine, ("plain", "dflash"))


def run_methods(prompts: Sequence[Turns], methods: Sequence[Method], config: GenerationConfig, *,
                warmup: int = 1, progress: bool = True) -> list[dict[str, RunResult]]:
    """Every method on every prompt, the order rotated per prompt."""
    if not prompts:
        raise DFlashError("the prompt set is empty")
    # Untimed warm-up: first calls pay one-off costs (allocator growth, CUDA kernels and handles)
    # that would otherwise be charged to whichever method ran first.
    warm_cfg = config.with_(max_new_tokens=min(WARMUP_TOKENS, config.max_new_tokens))
    for _ in range(warmup):
        for m in methods:
            m.run(prompts[0][:1], warm_cfg)
    results = []
    for i, turns in enumerate(tqdm(prompts, desc="bench", unit="prompt", disable=not progress)):
        k = i % len(methods)
        results.append({m.name: m.run(turns, config) for m in [*methods[k:], *methods[:k]]})
    return results


def _per_token_s(seconds: float, tokens: int) -> float:
    return seconds / tokens if tokens else float("inf")


def summarize(prompts: Sequence[Turns], results: Sequence[dict[str, RunResult]],
              methods: Sequence[Method], primary: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Totals per method (sum of seconds / sum of tokens, so long replies weigh what they cost)."""
    names = [m.name for m in methods]
    base = names[0]
    per_prompt = []
    for turns, res in zip(prompts, results, strict=True):
        row: dict[str, Any] = {"prompt": turns[0][:PROMPT_PREVIEW_CHARS], "turns": len(turns)}
        for n in names:
            row[f"{n}_ids"] = res[n].ids
        if res[primary].tau is not None:
            row["tau"] = res[primary].tau
        for n in names:
            row[f"{n}_s"] = res[n].seconds
            row[f"{n}_tokens"] = len(res[n].ids)
            if n != primary and res[n].tau is not None:
                row[f"{n}_tau"] = res[n].tau
        row["match"] = all(res[n].ids == res[base].ids for n in names)
        per_prompt.append(row)

    summary: dict[str, Any] = {"prompts": len(per_prompt), "methods": names, "baseline": base, "primary": primary}
    totals = {n: (sum(r[n].seconds for r in results), sum(len(r[n].ids) for r in results)) for n in names}
    base_cost = _per_token_s(*totals[base])
    for n in names:
        seconds, tokens = totals[n]
        summary[f"{n}_tokens"] = tokens
        summary[f"{n}_s"] = seconds
        summary[f"{n}_tokens_per_s"] = tokens / seconds if seconds > 0 else 0.0
        blocks = sum(r[n].blocks for r in results)
        if results[0][n].tau is not None:
            # Block-weighted over the whole run: the mean number of tokens per target forward.
            tau = sum(r[n].tau * r[n].blocks for r in results) / blocks if blocks else 1.0
            summary["mean_tau" if n == primary else f"{n}_mean_tau"] = tau
        if n != base:
            speedup = base_cost / _per_token_s(seconds, tokens)
            summary["speedup" if n == primary else f"{n}_speedup"] = speedup
    summary["mismatches"] = sum(not r["match"] for r in per_prompt)
    return summary, per_prompt


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(engine: Engine) -> dict[str, Any]:
    """What the numbers depend on, minus anything that identifies the machine (no hostname)."""
    import transformers

    env: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda_device": None,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if torch.cuda.is_available():
        dev = engine.target.device
        env["cuda_device"] = torch.cuda.get_device_name(dev if dev.type == "cuda" else 0)
    return env


def format_table(summary: dict[str, Any]) -> str:
    names, primary, base = summary["methods"], summary["primary"], summary["baseline"]
    rows = [f"{'method':<12}{'tokens':>8}{'time s':>10}{'tok/s':>9}{'tau':>7}{'speedup':>9}"]
    for n in names:
        tau = summary.get("mean_tau") if n == primary else summary.get(f"{n}_mean_tau")
        speedup = 1.0 if n == base else summary.get("speedup" if n == primary else f"{n}_speedup")
        rows.append(f"{n:<12}{summary[f'{n}_tokens']:>8}{summary[f'{n}_s']:>10.2f}"
                    f"{summary[f'{n}_tokens_per_s']:>9.2f}{'-' if tau is None else f'{tau:.2f}':>7}"
                    f"{speedup:>8.2f}x")
    rule = "-" * len(rows[0])
    exact = "exact expected at T=0" if summary["temperature"] == 0 else "sampling: outputs may differ"
    return "\n".join([
        f"{summary['target']} · draft: {summary['draft']}",
        f"{summary['device']} {summary['dtype']} · block {summary['block_size']} · steps {summary['steps']} · "
        f"T={summary['temperature']:g} · max {summary['max_new_tokens']} new tokens · {summary['prompts']} prompts",
        rule, *rows, rule,
        f"mismatches {summary['mismatches']} ({exact})",
    ])


def _report_json(summary: dict[str, Any], per_prompt: list[dict[str, Any]]) -> str:
    # One line per prompt: an indented token-id list would put every id on its own line.
    rows = ",\n  ".join(json.dumps(r, ensure_ascii=False) for r in per_prompt)
    head = json.dumps(summary, indent=2, ensure_ascii=False).replace("\n", "\n ")
    return f'{{\n "summary": {head},\n "per_prompt": [\n  {rows}\n ]\n}}\n'


def write_report(path: str | Path, summary: dict[str, Any], per_prompt: list[dict[str, Any]]) -> Path:
    path = Path(path).expanduser()
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(_report_json(summary, per_prompt), encoding="utf-8")
        tmp.replace(path)  # a reader never sees half a report
    except OSError as e:
        raise DFlashError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def check_writable(path: str | Path) -> None:
    """Fail before an hour of benchmarking, not after it."""
    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise DFlashError(f"cannot write {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise DFlashError(f"cannot write {path}: folder {parent} is not writable")
