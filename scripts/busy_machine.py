"""Decoding speed with and without a busy neighbour on the cores, per thread setting.

Each run is one `python -m dflash_core generate` in a fresh process (thread settings only take
effect before torch starts its thread pool), timed from the CLI's own summary line; the
neighbour runs beside it for the whole run. Usage:

    .venv/bin/python scripts/busy_machine.py --out bench/busy-machine.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Write a Python function that checks whether a number is prime, with a docstring."

NEIGHBOURS = {
    "none": None,
    # One core kept busy by a pure-Python loop (a compile, a browser tab, another service).
    "spin": [sys.executable, "-c", "while True: pass"],
    # Another torch job using every core (a second app, a training run): threads against threads.
    "torch": [sys.executable, "-c",
              "import torch\na = torch.randn(384, 384)\nwhile True: a = torch.tanh(a @ a)"],
}

SETTINGS = {
    # What the engine does by default: before each reply, as many threads as cores other programs
    # leave free (dflash_core/threads.py).
    "fitted": {},
    # Fixed thread counts (an explicit OMP_NUM_THREADS turns the fitting off).
    "threads=2": {"OMP_NUM_THREADS": "2"},
    "threads=1": {"OMP_NUM_THREADS": "1"},
    # Waiting threads sleep instead of spinning (must be set before torch starts).
    "threads=2,passive": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
}

SUMMARY = re.compile(r"(\d+) tokens .*? ([\d.]+) s \(prefill ([\d.]+)")


def one_run(method: str, env_extra: dict[str, str], tokens: int) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env.update(env_extra)
    cmd = [sys.executable, "-m", "dflash_core", "generate", "--prompt", PROMPT,
           "--max-new-tokens", str(tokens)] + (["--plain"] if method == "plain" else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    m = SUMMARY.search(out.stdout + out.stderr)
    if out.returncode or m is None:
        raise RuntimeError(f"{cmd} failed:\n{out.stderr[-2000:]}")
    n, total, prefill = int(m[1]), float(m[2]), float(m[3])
    return {"tokens": n, "decode_s": round(total - prefill, 3), "tok_s": round(n / (total - prefill), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--neighbours", nargs="+", default=list(NEIGHBOURS), choices=list(NEIGHBOURS))
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--out", type=Path, default=Path("bench/busy-machine.json"))
    args = ap.parse_args()
    rows = []
    for neighbour in args.neighbours:
        proc = None
        if NEIGHBOURS[neighbour] is not None:
            proc = subprocess.Popen(NEIGHBOURS[neighbour], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(2)
        try:
            for setting in args.settings:
                for method in ("plain", "dflash"):
                    r = one_run(method, SETTINGS[setting], args.tokens)
                    row = {"neighbour": neighbour, "setting": setting, "method": method, **r}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            if proc is not None:
                proc.kill()
                proc.wait()
    report = {"machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
              "prompt": PROMPT, "tokens": args.tokens, "rows": rows,
              "command": "python scripts/busy_machine.py " + " ".join(sys.argv[1:])}
    with contextlib.suppress(OSError, StopIteration):
        report["cpu"] = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                             if line.startswith("model name"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
