"""The app's race as a visitor meets it: `launch.py` on the embedded default, headless Chromium on
the same cores, the race switch ticked, a prompt sent; prints each run's finish line.

    .venv/bin/python scripts/race_in_browser.py [--prompt TEXT | --set SET] [--limit N] [--max-new-tokens N]
                                                [--runs K] [--json OUT]

`--set` races every prompt of a prompt set (a bench set name or a JSONL file, `bench --set`'s
format) once each in the same app and prints their median; `--prompt` races one prompt K times.

A measurement, not a test: the finish line's speed-up is what the app reports (each side's tokens
over its own engine time), so it moves with whatever else the machine runs, the browser included.
Needs /usr/bin/chromium and the playwright package (scripts/setup.sh --test installs both).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import ROOT, serve  # launch.py on a free loopback port, stopped afterwards

CHROMIUM = "/usr/bin/chromium"
PROMPT = "What are three tips for staying productive when working from home?"
START_TIMEOUT_S = 600  # loading, the first pass-cost calibration and Gradio, on a busy 2-core machine


def race_once(page: object, url: str, prompt: str, max_new: int) -> str:
    page.goto(url)  # a fresh visitor: empty history
    page.get_by_role("tab", name="Studio").click()
    box = page.locator('input[aria-label="number input for max new tokens"]')
    box.fill(str(max_new))
    box.press("Enter")
    page.locator("#race-switch input[type=checkbox]").check()
    page.locator("#prompt textarea").fill(prompt)
    page.get_by_role("button", name="Send", exact=True).click()
    page.wait_for_function("/identical|differ|stopped/i.test(document.querySelector('#race-view .race-finish')"
                           "?.innerText || '')", timeout=START_TIMEOUT_S * 1000)
    return page.locator("#race-view .race-finish").inner_text().strip()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", default=None, help=f"one prompt, raced --runs times (default: {PROMPT!r})")
    p.add_argument("--set", default=None,
                   help="a prompt set (bench names or a JSONL file), each first turn raced once")
    p.add_argument("--limit", type=int, default=None, help="the set's first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3, help="races in one app, each from a fresh page")
    p.add_argument("--json", default=None, help="also write the finish lines and the machine here")
    args = p.parse_args()
    if args.set and args.prompt:
        p.error("give --prompt or --set, not both")
    prompts = prompt_list(args.set, args.limit) if args.set else [args.prompt or PROMPT] * args.runs
    from playwright.sync_api import sync_playwright

    lines: list[str] = []
    with serve(ROOT / "artifacts" / "race_in_browser.log", timeout=START_TIMEOUT_S) as server:
        print(f"app up after {server.startup_s:.0f} s", flush=True)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox",
                                                                        "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1500, "height": 1300})
            for k, prompt in enumerate(prompts):
                lines.append(race_once(page, server.url, prompt, args.max_new_tokens))
                print(f"race {k + 1}: {lines[-1]}", flush=True)
            browser.close()
    found = [re.search(r"DFlash ([0-9.]+)×", s) for s in lines]
    ratios = [float(m.group(1)) for m in found if m]
    if ratios:
        print(f"{len(ratios)} races: median {statistics.median(ratios):.2f}×, "
              f"lowest {min(ratios):.2f}×, highest {max(ratios):.2f}×")
    if args.json:
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), "unknown")
        what = {"set": args.set, "prompts": prompts} if args.set else {"prompt": prompts[0]}
        Path(args.json).write_text(json.dumps({**what, "max_new_tokens": args.max_new_tokens,
                                               "cpu": cpu, "cores": os.cpu_count(), "finish_lines": lines,
                                               "speedups": ratios, "date": time.strftime("%Y-%m-%d")}, indent=1)
                                   + "\n")
    return 0 if len(ratios) == len(lines) else 1


def prompt_list(spec: str, limit: int | None) -> list[str]:
    """Each prompt's first turn (the race is one reply), from bench's prompt sets."""
    sys.path.insert(0, str(ROOT))
    from dflash_core.prompt_sets import load_prompt_set

    return [turns[0] for turns in load_prompt_set(spec, limit=limit)]


if __name__ == "__main__":
    sys.exit(main())
