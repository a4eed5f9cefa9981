"""The benchmark's numbers: method names, per-method statistics, the terminal table and the README table.

Pure functions over `RunResult`s: no model, no torch, so every formula here is tested on
hand-made results. How each number is computed (the reports repeat this):

- tau: mean tokens committed per draft block, accepted drafts + 1, over every block of the run.
- tokens/s: total tokens / total seconds (prefill included); also the median and the mean of
  the per-prompt rates, so one long reply cannot hide a slow majority.
- speed-up: the baseline's (first method's) seconds per token / the method's, over the whole run.
- t1: our plain decoding's mean engine time per step (one target forward + argmax), same run.
- tB + tdraft: the method's mean verify + draft time per draft block, by the same engine timers.
- bound: tau · t1 / (tB + tdraft), the speed-up if nothing but the draft and verify passes cost
  time; achieved = measured speed-up against our plain decoding / bound. The gap is host
  overhead (event building, text decoding, Python) and the prefill, which the bound leaves out.
- exact: prompts whose token ids equal the baseline's (at T=0 every method should match).
"""

from __future__ import annotations

import os
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .config import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE, TREE_MODES
from .errors import DFlashError
from .events import tau
from .prompt_sets import Turns

PROMPT_PREVIEW_CHARS = 200
README_START = "<!-- bench:start -->"
README_END = "<!-- bench:end -->"


@dataclass
class RunResult:
    """One method's answer to one (possibly multi-turn) prompt."""

    ids: list[int]  # the replies' token ids, all turns concatenated
    seconds: float
    replies: list[str] = field(default_factory=list)
    tau: float | None = None  # committed tokens per target forward; None for methods without drafts
    blocks: int = 0  # target forwards after the prefill (plain: one per token)
    accepted: list[int] = field(default_factory=list)  # accepted drafts, one entry per draft block
    draft_s: float = 0.0  # engine-timed drafting, summed over the blocks after the prefill
    verify_s: float = 0.0  # engine-timed target forwards + acceptance, same blocks


# ----- method names -----

@dataclass(frozen=True)
class MethodSpec:
    """A parsed method name. `block_size`/`steps` None: the run's --block-size / --steps."""

    name: str
    kind: str  # plain, dflash, or one of PEER_KINDS
    block_size: int | None = None
    steps: int | None = None
    verify: str | None = None  # full / adaptive / tree / tree-full; None: the run's --verify
    lookup: bool | None = None  # trees: with prompt-lookup candidates or not; None: the run's


FIXED_METHODS = {
    "plain": MethodSpec("plain", "plain"),
    "dflash": MethodSpec("dflash", "dflash"),
    "hf-generate": MethodSpec("hf-generate", "hf-generate"),
    "prompt-lookup": MethodSpec("prompt-lookup", "prompt-lookup"),
    "hf-dflash": MethodSpec("hf-dflash", "hf-dflash"),
}
# transformers' own decoding on the same target: its forward may round differently from ours (in
# bf16 it is not batch-invariant), so their exact counts are information, not our promise.
PEER_KINDS = ("hf-generate", "prompt-lookup", "hf-dflash", "server")
ALL_METHODS = ("plain", "hf-generate", "prompt-lookup", "hf-dflash", "dflash-b4", "dflash-b8", "dflash-b16",
               "dflash-b4-full", "dflash-b16-full", "dflash-b4-s2", "dflash-b8-s2", "dflash-b16-s2")
_FAMILY = re.compile(r"dflash-b([1-9]\d*)(?:-s([1-9]\d*))?(?:-(full|adaptive|tree|tree-full))?(-lookup)?")
METHOD_HELP = ("plain, dflash (the run's --block-size/--steps/--verify), dflash-bN, dflash-bN-sK (block size N, "
               "K denoising steps), either with -full, -adaptive, -tree or -tree-full (see --verify; a tree with "
               "-lookup adds prompt-lookup candidates), hf-generate, prompt-lookup, hf-dflash (transformers' own "
               "DFlash with the same drafter, the run's --block-size), or all")


def parse_method(name: str) -> MethodSpec:
    if name in FIXED_METHODS:
        return FIXED_METHODS[name]
    m = _FAMILY.fullmatch(name)
    if m is None:
        raise DFlashError(f"unknown bench method {name!r}; choose from {METHOD_HELP}")
    block = int(m[1])
    if not MIN_BLOCK_SIZE <= block <= MAX_BLOCK_SIZE:
        raise DFlashError(f"bench method {name!r}: block size must be {MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE}")
    if m[4] and m[3] not in TREE_MODES:
        raise DFlashError(f"bench method {name!r}: -lookup adds candidates to a tree; use -tree-lookup or "
                          "-tree-full-lookup")
    # A tree method names its lookup choice: -tree is the drafter alone, -tree-lookup adds guesses.
    lookup = None if m[3] not in TREE_MODES else bool(m[4])
    return MethodSpec(name, "dflash", block_size=block, steps=int(m[2] or 1), verify=m[3], lookup=lookup)


def parse_methods(text: str | Sequence[str]) -> list[MethodSpec]:
    """A comma list (or a list) of method names; `all` expands to ALL_METHODS in place."""
    raw = text.split(",") if isinstance(text, str) else list(text)
    names: list[str] = []
    for n in (s.strip() for s in raw):
        names.extend(ALL_METHODS if n == "all" else [n] if n else [])
    if not names:
        raise DFlashError(f"no bench methods given; choose from {METHOD_HELP}")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise DFlashError(f"bench method(s) {dupes} given twice")
    unknown = [n for n in names if n not in FIXED_METHODS and not _FAMILY.fullmatch(n)]
    if unknown:  # all of them in one message, not one per run of the command
        raise DFlashError(f"unknown bench method(s) {unknown}; choose from {METHOD_HELP}")
    return [parse_method(n) for n in names]


# ----- statistics -----

class MethodLike(Protocol):
    name: str
    kind: str
    block_size: int | None
    steps: int | None
    verify: str | None


def accept_histogram(accepted: Sequence[int], block_size: int) -> list[int]:
    """Counts of accepted drafts 0..B-1 per block (a block then commits accepted + 1 tokens)."""
    hist = [0] * block_size
    for a in accepted:
        if not 0 <= a < block_size:
            raise ValueError(f"accepted length {a} outside 0..{block_size - 1}")
        hist[a] += 1
    return hist


def pooled_tau(results: Sequence[RunResult]) -> float | None:
    """tau over every draft block of a method's runs, pooled (a long reply weighs more than a
    short one, unlike a mean of the per-prompt taus); None for a method that does not draft.
    Results without per-block counts are weighted by their blocks."""
    if all(r.tau is None for r in results):
        return None
    accepted = [a for r in results for a in r.accepted]
    if accepted:
        return tau(accepted)
    blocks = sum(r.blocks for r in results if r.tau is not None)
    return sum(r.tau * r.blocks for r in results if r.tau is not None) / blocks if blocks else 1.0


def speedup_bound(tau: float, t1_ms: float, verify_ms: float, draft_ms: float) -> float | None:
    """tau · t(1 token) / (t(B tokens) + t(draft)); None when a time is missing."""
    cost = verify_ms + draft_ms
    return tau * t1_ms / cost if t1_ms > 0 and cost > 0 else None


def _per_token_s(results: Sequence[RunResult]) -> float:
    tokens = sum(len(r.ids) for r in results)
    return sum(r.seconds for r in results) / tokens if tokens else float("inf")


def _ms_per_block(results: Sequence[RunResult], attr: str) -> float | None:
    blocks = sum(r.blocks for r in results)
    total = sum(getattr(r, attr) for r in results)
    return total / blocks * 1e3 if blocks and total > 0 else None


def method_stats(m: MethodLike, runs: Sequence[RunResult], base: Sequence[RunResult],
                 plain: Sequence[RunResult] | None) -> dict[str, Any]:
    """Everything the reports show for one method, against the baseline's and plain's runs."""
    rates = [len(r.ids) / r.seconds for r in runs if r.seconds > 0]
    tokens, seconds = sum(len(r.ids) for r in runs), sum(r.seconds for r in runs)
    cost = _per_token_s(runs)
    s: dict[str, Any] = {
        "kind": m.kind, "block_size": m.block_size, "steps": m.steps, "verify": m.verify,
        "tokens": tokens, "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "tokens_per_s_median": statistics.median(rates) if rates else 0.0,
        "tokens_per_s_mean": statistics.fmean(rates) if rates else 0.0,
        "speedup": _per_token_s(base) / cost,
        "exact_matches": sum(r.ids == b.ids for r, b in zip(runs, base, strict=True)),
        "tau": pooled_tau(runs), "tau_hist": None, "draft_ms_per_block": None, "verify_ms_per_block": None,
        "step_ms": None, "bound": None, "achieved": None,
    }
    if s["tau"] is None:
        if m.kind == "plain":
            s["step_ms"] = _ms_per_block(runs, "verify_s")
        return s
    accepted = [a for r in runs for a in r.accepted]
    if accepted and m.block_size:
        s["tau_hist"] = accept_histogram(accepted, m.block_size)
    s["draft_ms_per_block"] = _ms_per_block(runs, "draft_s")
    s["verify_ms_per_block"] = _ms_per_block(runs, "verify_s")
    t1 = _ms_per_block(plain, "verify_s") if plain else None
    if t1 is not None and s["verify_ms_per_block"] is not None:
        s["bound"] = speedup_bound(s["tau"], t1, s["verify_ms_per_block"], s["draft_ms_per_block"] or 0.0)
        if s["bound"]:
            s["achieved"] = _per_token_s(plain) / cost / s["bound"]
    return s


def summarize(prompts: Sequence[Turns], results: Sequence[dict[str, RunResult]],
              methods: Sequence[MethodLike], primary: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The report's summary and per-prompt rows. The first method is the baseline; `primary`
    (the first DFlash method) also gets the top-level `mean_tau` and `speedup`."""
    names = [m.name for m in methods]
    base = names[0]
    ours = [m.name for m in methods if m.kind not in PEER_KINDS]
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
        row["match"] = all(res[n].ids == res[base].ids for n in ours)
        per_prompt.append(row)

    runs = {n: [r[n] for r in results] for n in names}
    plain_name = next((m.name for m in methods if m.kind == "plain"), None)
    plain = runs[plain_name] if plain_name else None
    per_method = {m.name: method_stats(m, runs[m.name], runs[base], plain) for m in methods}
    summary: dict[str, Any] = {"prompts": len(per_prompt), "methods": names, "baseline": base, "primary": primary}
    for n, s in per_method.items():  # flat keys: the report format from before per_method existed
        summary[f"{n}_tokens"] = s["tokens"]
        summary[f"{n}_s"] = s["seconds"]
        summary[f"{n}_tokens_per_s"] = s["tokens_per_s"]
        if s["tau"] is not None:
            summary["mean_tau" if n == primary else f"{n}_mean_tau"] = s["tau"]
        if n != base:
            summary["speedup" if n == primary else f"{n}_speedup"] = s["speedup"]
    summary["mismatches"] = sum(not r["match"] for r in per_prompt)
    summary["plain_step_ms"] = per_method[plain_name]["step_ms"] if plain_name else None  # t1
    summary["per_method"] = per_method
    return summary, per_prompt


# ----- tables -----

def _num(x: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{fmt}}{suffix}"


def row_cells(s: dict[str, Any], prompts: int) -> list[str]:
    verify = s["verify_ms_per_block"] if s["step_ms"] is None else s["step_ms"]
    return [_num(s["tokens_per_s"], ".1f"), _num(s["tokens_per_s_median"], ".1f"), _num(s["tau"], ".2f"),
            _num(s["speedup"], ".2f", "x"), _num(s["draft_ms_per_block"], ".2f"), _num(verify, ".2f"),
            _num(s["bound"], ".2f", "x"), _num(None if s["achieved"] is None else 100 * s["achieved"], ".0f", "%"),
            f"{s['exact_matches']}/{prompts}"]


TABLE_HEAD = ["tok/s", "med tok/s", "tau", "speed-up", "draft ms", "verify ms", "bound", "achieved", "exact"]


HF_DFLASH_LEGEND = (
    "hf-dflash: transformers' own DFlash (generate(assistant_model=…, speculation_type=\"dflash\")) with the same "
    "drafter in its assistant layout: blocks of B, every draft verified, drafted over the whole vocabulary (a draft "
    "vocabulary is not part of that layout); tau from the tokens each of its target forwards committed")


DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"  # where the columns are explained


def docs_legend(link: str) -> str:
    return ("columns, method names (`-full`, `-adaptive`, `-tree`, `-lookup`, `hf-dflash`) and `bound`: "
            f"[docs/benchmarks.md]({link}#what-the-columns-mean)")


def legend(summary: dict[str, Any]) -> list[str]:
    base = summary["baseline"]
    return [
        "tok/s = all tokens / all seconds (prefill included); med = median of the per-prompt rates",
        "tau = mean tokens committed per draft block (accepted drafts + 1); "
        f"speed-up = {base}'s s/token / the method's, whole run",
        "draft/verify ms = engine-timed mean per draft block (plain: verify = t1, ms per token)",
        "-full: the target verifies all B−1 drafts of every block (tau as published); -adaptive: only the prefix "
        "worth its measured cost on this machine (fewer tokens per forward, cheaper forwards; the same output); "
        "-tree-full: a tree of B−1 candidates per block (the drafter's likeliest alternatives too); -tree: as many "
        "candidates as pay on this machine; -lookup: lookup guesses in the tree too (prompt lookup, and the "
        "drafter's n-gram table where it ships one)",
        *([HF_DFLASH_LEGEND] if any(s["kind"] == "hf-dflash" for s in summary.get("per_method", {}).values()) else []),
        "bound = tau·t1/(t_verify+t_draft); achieved = speed-up vs plain / bound (below 100%: host overhead "
        "and prefill; above: the same overhead weighs more on plain's shorter steps)",
        f"exact = prompts whose token ids equal {base}'s" + (
            " (mismatches counts our engine's methods; transformers' forward may round differently, as in "
            "bf16, so its rows' exact counts are information)" if not summary.get("temperature") else
            " (sampling: every method draws its own random tokens, so outputs differ by design; that the "
            "speculative ones follow the target's distribution is checked by tests/test_sampling_distribution.py)"),
    ]


def format_table(summary: dict[str, Any]) -> str:
    """The terminal table, one row per method."""
    names, n_prompts = summary["methods"], summary["prompts"]
    width = max(12, *(len(n) + 2 for n in names))
    widths = [8, 8, 10, 6, 9, 9, 10, 7, 9, 7]
    head = ["tokens", *TABLE_HEAD]
    rows = [f"{'method':<{width}}" + "".join(f"{h:>{w}}" for h, w in zip(head, widths, strict=True))]
    for n in names:
        s = summary["per_method"][n]
        cells = [str(s["tokens"]), *row_cells(s, n_prompts)]
        rows.append(f"{n:<{width}}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    rule = "-" * len(rows[0])
    exact = "exact expected at T=0" if summary["temperature"] == 0 else "sampling: outputs may differ"
    return "\n".join([
        f"{summary['target']} · draft: {summary['draft']}",
        f"{summary['device']} {summary['dtype']} · {summary.get('target_forward', 'transformers forward')} · "
        f"block {summary['block_size']} · steps {summary['steps']} · "
        f"T={summary['temperature']:g} · max {summary['max_new_tokens']} new tokens · {prompt_count(summary)}"
        + (" · pass costs pinned (tau independent of load)" if summary.get("pass_costs", "").startswith("pinned")
           else ""),
        rule, *rows, rule, *legend(summary),
        f"mismatches {summary['mismatches']} ({exact})",
    ])


def hardware(summary: dict[str, Any]) -> str:
    if str(summary.get("device", "")).startswith("cuda") and summary.get("cuda_device"):
        return f"{summary['cuda_device']} (CUDA)"
    return f"{summary.get('cpu', 'CPU')}, {summary.get('torch_threads', '?')} torch threads"


def prompt_count(summary: dict[str, Any]) -> str:
    """"5 prompts", or "15 prompts after the first 5" for a run that skipped some (`--skip`)."""
    skip = summary.get("skip", 0)
    return f"{summary['prompts']} prompts" + (f" after the first {skip}" if skip else "")


def markdown_table(summary: dict[str, Any], docs_link: str = "docs/benchmarks.md") -> str:
    """The README's results block: what ran where, the command, the table, how it is computed
    (`docs_link`: the columns' explanation, relative to the file the block goes in)."""
    names, n_prompts = summary["methods"], summary["prompts"]
    lines = [
        f"Measured {summary.get('date', '?')} on {hardware(summary)}, {summary.get('dtype', '?')}, "
        f"{summary.get('target_forward', 'transformers forward')}; "
        f"torch {summary.get('torch', '?')}, transformers {summary.get('transformers', '?')}. "
        f"Target `{summary.get('target', '?')}`, drafter `{summary.get('draft', '?')}`; "
        f"prompt set `{summary.get('prompt_set', '?')}`, {prompt_count(summary)}, "
        f"≤ {summary.get('max_new_tokens', '?')} new tokens, T={summary.get('temperature', 0):g}.",
        "",
        f"Regenerate: `{summary.get('command', 'python -m dflash_core bench ...')}`",
        "",
        "| method | " + " | ".join(TABLE_HEAD) + " |",
        "| --- |" + " ---: |" * len(TABLE_HEAD),
    ]
    for n in names:
        lines.append(f"| `{n}` | " + " | ".join(row_cells(summary["per_method"][n], n_prompts)) + " |")
    # The README keeps one line of legend per table; the columns are explained once, in the docs.
    lines += ["", f"- {docs_legend(docs_link)}", f"- {legend(summary)[-1]}"]
    return "\n".join(lines)


def replace_region(text: str, block: str, start: str = README_START, end: str = README_END) -> str:
    """`text` with everything between the markers replaced by `block`; the markers stay."""
    if text.count(start) != 1 or text.count(end) != 1:
        raise DFlashError(f"expected exactly one {start} and one {end} marker")
    i, j = text.index(start) + len(start), text.index(end)
    if j < i:
        raise DFlashError(f"{end} comes before {start}")
    return text[:i] + "\n" + block.strip("\n") + "\n" + text[j:]


def region_name(prompt_set: str | None, temperature: float = 0.0) -> str | None:
    """The README region of a run: the prompt set, plus `-tT` when sampling (`gsm8k-t1`), so a
    sampled run never overwrites the greedy table of the same set."""
    if not prompt_set:
        return None
    return prompt_set if not temperature else f"{prompt_set}-t{temperature:g}"


def readme_markers(text: str, region: str | None) -> tuple[str, str]:
    """A region of its own (`<!-- bench:start:gsm8k -->` ... `<!-- bench:end:gsm8k -->`) when the README
    has one, so each prompt set keeps its table; otherwise the generic markers."""
    start, end = f"<!-- bench:start:{region} -->", f"<!-- bench:end:{region} -->"
    return (start, end) if region and start in text else (README_START, README_END)


def check_readme(path: str | Path, region: str | None = None) -> None:
    """Fail before the benchmark runs, not after it."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
        replace_region(text, "", *readme_markers(text, region))
    except OSError as e:
        raise DFlashError(f"cannot read {path}: {e.strerror or e}") from None
    except DFlashError as e:
        raise DFlashError(f"{path}: {e}") from None


def write_readme(path: str | Path, summary: dict[str, Any]) -> Path:
    path = Path(path).expanduser()
    region = region_name(summary.get("prompt_set"), summary.get("temperature") or 0.0)
    check_readme(path, region)
    text = path.read_text(encoding="utf-8")
    link = os.path.relpath(DOCS, path.resolve().parent)
    return write_text_atomic(path, replace_region(text, markdown_table(summary, link), *readme_markers(text, region)))


def write_text_atomic(path: str | Path, text: str) -> Path:
    path = Path(path).expanduser()
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)  # a reader never sees half a file
    except OSError as e:
        raise DFlashError(f"cannot write {path}: {e.strerror or e}") from None
    return path
