"""Fuzz DFlash's exactness: random prompts and settings, each reply compared with plain greedy.

    .venv/bin/python scripts/fuzz_exact.py --cases 1000 --out bench/fuzz-exact.json

Prompts mix prose, code, unicode, emoji, right-to-left text, control characters, very short and
long inputs, multi-turn chats and raw token ids; settings draw a block size (2..32), denoising
steps (1..3), every verify mode the step count allows, lookup on or off and a reply length. Block
sizing follows a pass-cost table drawn per case (from free verification, as on a GPU, to a steep
CPU) with a drawn drafting time, so trees and adaptive chains of every size occur and a failing
case reproduces from its seed alone. Exit status 1 when any case differs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_core.config import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE, TREE_MODES, VERIFY_MODES, GenerationConfig  # noqa: E402
from dflash_core.engine import Engine  # noqa: E402
from dflash_core.verify_length import PassCosts, VerifyCost  # noqa: E402

WORDS = ["the", "sea", "river", "stone", "light", "code", "list", "tree", "function", "value", "seven", "prime",
         "apple", "night", "winter", "train", "story", "number", "answer", "reason", "table", "colour", "music"]
PIECES = [
    "Write a Python function that reverses a linked list.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n# explain this",
    "Explain recursion to a child.",
    "What is 12 * 34? Show your working.",
    "Écris une phrase sur l'hiver. Ñandú, straße, İstanbul.",
    "🙂🚀 emoji test 👩‍💻 🇫🇷 — what do these mean?",
    "مرحبا بالعالم، كيف حالك؟ שלום עולם",  # right-to-left scripts
    "中文测试：请用一句话介绍长城。日本語もどうぞ。",
    "<script>alert('x')</script> <b>bold</b> &amp; what does this HTML do?",
    "tab\there, bell\x07, escape \x1b[31mred\x1b[0m, null \x00 end",
    "\u202eoverride\u202c and zero\u200bwidth",
    "List the first ten prime numbers.",
    "SELECT * FROM users WHERE name = 'a'; -- explain",
    "Continue: 1, 1, 2, 3, 5, 8,",
]
SHORT = ["a", "?", "Hi", "1", "🙂", "ok."]
COSTS = {  # pass-cost shapes (ms at 1, 2, 4, 16 tokens)
    "gpu_flat": (10.0, 10.0, 10.2, 10.5),
    "cpu_bf16": (30.0, 33.0, 38.0, 60.0),
    "cpu_fp32": (60.0, 69.0, 90.0, 138.0),
    "steep": (20.0, 40.0, 80.0, 320.0),
}


@dataclass
class Case:
    seed: int
    kind: str
    prompt: Any
    block_size: int
    steps: int
    verify: str
    lookup: bool
    max_new_tokens: int
    costs: str
    draft_ms: float


def make_case(seed: int, vocab_size: int) -> Case:
    """The case `seed` stands for: the same seed always gives the same case."""
    rng = random.Random(seed)
    kind = rng.choice(["piece", "piece", "words", "short", "long", "chat", "ids"])
    if kind == "piece":
        prompt: Any = rng.choice(PIECES)
    elif kind == "words":
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))
    elif kind == "short":
        prompt = rng.choice(SHORT)
    elif kind == "long":
        prompt = " ".join(rng.choice(PIECES) for _ in range(rng.randint(8, 20)))
    elif kind == "chat":
        prompt = []
        for _ in range(rng.randint(1, 3)):
            prompt += [{"role": "user", "content": rng.choice(PIECES)},
                       {"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(6))}]
        prompt.append({"role": "user", "content": rng.choice(PIECES + SHORT)})
    else:
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 40))]
    steps = rng.choice([1, 1, 2, 3])
    modes = [m for m in VERIFY_MODES if steps == 1 or m not in TREE_MODES]
    return Case(seed=seed, kind=kind, prompt=prompt, block_size=rng.randint(MIN_BLOCK_SIZE, MAX_BLOCK_SIZE),
                steps=steps, verify=rng.choice(modes), lookup=rng.random() < 0.7,
                max_new_tokens=rng.choice([1, 2, 8, 16, 24, 40]), costs=rng.choice(list(COSTS)),
                draft_ms=rng.choice([0.5, 4.0, 15.0]))


def run_case(engine: Engine, case: Case) -> dict[str, Any]:
    """Plain greedy and DFlash greedy for one case; the verdict and what the DFlash run did."""
    cfg = GenerationConfig(max_new_tokens=case.max_new_tokens, block_size=case.block_size, steps=case.steps,
                           verify=case.verify, lookup=case.lookup)
    table = VerifyCost((1, 2, 4, 16), COSTS[case.costs])
    engine.pinned_costs = PassCosts(chain=table, tree=table, draft_ms=case.draft_ms)  # this engine's only
    *_, plain = engine.generate(case.prompt, cfg, plain=True)
    *blocks, fast = engine.generate(case.prompt, cfg)
    return {"seed": case.seed, "exact": fast.token_ids == plain.token_ids and fast.text == plain.text,
            "mode": engine.verify_mode(cfg), "tokens": len(plain.token_ids),
            "accepted": sorted({b.accepted for b in blocks[1:]})}


def fuzz(engine: Engine, cases: int, first_seed: int = 0, progress: bool = True) -> dict[str, Any]:
    """Run `cases` cases from `first_seed` on; a summary with every mismatching case in full."""
    results, mismatches = [], []
    t0 = time.perf_counter()
    try:
        for seed in tqdm(range(first_seed, first_seed + cases), disable=not progress, desc="cases"):
            case = make_case(seed, engine.target.vocab_size)
            result = run_case(engine, case)
            results.append(result)
            if not result["exact"]:
                mismatches.append(asdict(case))
    finally:
        vars(engine).pop("pinned_costs", None)  # back to the class's (the tests' pinned) costs
    count: dict[str, int] = {}
    for r in results:
        count[r["mode"]] = count.get(r["mode"], 0) + 1
    return {"cases": len(results), "mismatches": len(mismatches), "first_seed": first_seed,
            "by_mode": count, "tokens": sum(r["tokens"] for r in results),
            "accepted_lengths_seen": sorted({a for r in results for a in r["accepted"]}),
            "minutes": round((time.perf_counter() - t0) / 60, 1), "mismatching_cases": mismatches}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--cases", type=int, default=1000, help="how many cases to run")
    parser.add_argument("--seed", type=int, default=0, help="the first case's seed (cases use seed, seed+1, ...)")
    parser.add_argument("--target", default="embedded", help="the target (hub id, folder or 'embedded')")
    parser.add_argument("--draft", default=None, help="the drafter (default: the shipped one for the embedded target)")
    parser.add_argument("--out", default=None, help="write the JSON summary here")
    args = parser.parse_args(argv)
    import dflash_core

    engine = dflash_core.load(args.target, args.draft)
    summary = fuzz(engine, args.cases, args.seed)
    summary["target"] = engine.target.name
    text = json.dumps(summary, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 1 if summary["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
