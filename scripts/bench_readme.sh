#!/usr/bin/env bash
# Every benchmark result the README shows, measured again by one command:
#   - the 5-prompt tables (HumanEval, GSM8K, MT-Bench first turns in README.md; GSM8K at temperature 1
#     in docs/benchmarks.md): each command is read from its table's own "Regenerate:" line and
#     rewrites that table (--readme), its JSON in bench/ and an HTML report in runs/;
#   - the 40-prompt runs of the default against plain decoding (bench/humaneval-40.json,
#     bench/gsm8k-40.json), which the README quotes in prose.
# About 25 minutes on a 2-core CPU; the commands run one after another, never side by side, so
# that no run shares the cores. The prose around the tables is not rewritten: read the new
# numbers from the tables and the JSON files, and update it by hand.
#
#   bash scripts/bench_readme.sh          # run them all (after bash scripts/setup.sh)
#   bash scripts/bench_readme.sh --list   # print the commands, run nothing
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}

# README.md's tables, then docs/benchmarks.md's (the sampled run)
mapfile -t commands < <(sed -n 's/^Regenerate: `\(python -m dflash_core bench [^`]*\)`$/\1/p' README.md \
    $([ -f docs/benchmarks.md ] && echo docs/benchmarks.md))
if [ "${#commands[@]}" -eq 0 ]; then
    echo "bench_readme.sh: no 'Regenerate:' lines in README.md" >&2
    exit 2
fi
for set in humaneval gsm8k; do
    commands+=("python -m dflash_core bench --set $set --limit 40 --max-new-tokens 256 --methods plain,dflash-b16-tree-lookup --json bench/$set-40.json --html runs/$set-40.html --no-progress")
done

if [ "${1:-}" = "--list" ]; then
    printf '%s\n' "${commands[@]}"
    exit 0
fi
mkdir -p runs
for cmd in "${commands[@]}"; do
    echo "== $cmd"
    # Each line names its own arguments (no quotes inside), so word splitting rebuilds them.
    # shellcheck disable=SC2086
    "$PY" ${cmd#python }
done
# The shipped drafter's card quotes the same tables (tests/test_shipped_drafter.py checks it).
"$PY" -m dflash_core.train.card --refresh assets/drafter --bench bench/humaneval.json --bench bench/gsm8k.json \
    --bench bench/mtbench-1.json
