"""scripts/bench_readme.sh, the one command behind every benchmark result in the README: that it
runs exactly the README's own commands, and that the bench CLI accepts each of them. The runs
themselves take ~25 minutes, so no test starts one."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

from dflash_core.__main__ import build_parser

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_readme.sh"


def listed() -> list[str]:
    done = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_lists_every_readme_table_command_then_the_forty_prompt_runs() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    readme = (ROOT / "README.md").read_text()
    pages = readme + (ROOT / "docs" / "benchmarks.md").read_text()  # the README's tables, then the sampled one
    tables = re.findall(r"^Regenerate: `(python -m dflash_core bench [^`]*)`$", pages, flags=re.M)
    regions = re.findall(r"^<!-- bench:start:([\w-]+) -->$", pages, flags=re.M)
    assert len(tables) == len(regions) >= 4  # one command per table region
    in_readme = re.findall(r"^<!-- bench:start:([\w-]+) -->$", readme, flags=re.M)
    assert {"humaneval", "gsm8k", "mtbench-1"} <= set(in_readme)  # a chat set beside code and maths
    commands = listed()
    assert commands[: len(tables)] == tables
    forty = commands[len(tables):]
    assert [c.split("--json ")[1].split()[0] for c in forty] == ["bench/humaneval-40.json", "bench/gsm8k-40.json"]
    assert all("--readme" not in c for c in forty)  # prose quotes them; no table region to rewrite
    for c in forty:  # the README names the files these runs write
        assert c.split("--json ")[1].split()[0] in readme


def test_every_command_parses_and_writes_a_committed_json() -> None:
    parser = build_parser()
    for command in listed():
        argv = shlex.split(command)
        assert argv[:3] == ["python", "-m", "dflash_core"]
        args = parser.parse_args(argv[3:])
        assert args.command == "bench"
        assert args.out.startswith("bench/")
        summary = json.loads((ROOT / args.out).read_text())["summary"]  # the run the README shows
        if args.temperature == 0:  # sampled replies differ from plain decoding's by design
            assert summary["mismatches"] == 0
        assert summary["prompts"] == args.limit and summary["max_new_tokens"] == args.max_new_tokens


def test_refuses_a_readme_without_commands(tmp_path: Path) -> None:
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "bench_readme.sh").write_text(SCRIPT.read_text())
    (tmp_path / "README.md").write_text("# no tables here\n")
    done = subprocess.run(["bash", str(tmp_path / "scripts" / "bench_readme.sh"), "--list"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "no 'Regenerate:' lines" in done.stderr


def test_runs_each_command_with_the_chosen_python(tmp_path: Path) -> None:
    # A stand-in interpreter records its arguments: the run path splits each listed command into
    # exactly the words the bench CLI parses above, in order, one run after another, then
    # refreshes the drafter card's table.
    record = tmp_path / "calls.txt"
    stub = tmp_path / "python"
    stub.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$*" >> {shlex.quote(str(record))}\n')
    stub.chmod(0o755)
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, cwd=ROOT, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": str(stub)})
    assert done.returncode == 0, done.stderr
    calls = record.read_text().splitlines()
    assert calls[:-1] == [c.removeprefix("python ") for c in listed()]
    # Last, the shipped drafter's card takes the new tables' rows (tests/test_shipped_drafter.py).
    assert calls[-1] == ("-m dflash_core.train.card --refresh assets/drafter --bench bench/humaneval.json "
                         "--bench bench/gsm8k.json --bench bench/mtbench-1.json")
