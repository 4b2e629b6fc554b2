#!/usr/bin/env bash
# Run the GSM8K mistake-math experiment on the GPU machine (see experiments/README.md).
# Needs .cache/device-eval/part1 (carried by an earlier call), .cache/device-eval/part2,
# .cache/device-eval/wheels and .cache/device-eval/data from experiments/device_prepare.sh. Extra arguments go to
# experiments/run_gsm8k_mistake_math.py (e.g. --only ranking, --smoke).
#
# Outputs stay in .cache/gsm8k-mm/ (so a second call on the same warm machine resumes
# where a timed-out one stopped); the log and a .tar.gz of the results (LoRA adapters
# left out) go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${OUT:-/tmp/prism-out}"
mkdir -p "$OUTDIR"
source experiments/device_env.sh
python3 -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__, "cuda", torch.cuda.is_available())'
timeout "${BUDGET:-530}" python3 experiments/run_gsm8k_mistake_math.py --out .cache/gsm8k-mm "$@" 2>&1 | tee "$OUTDIR/log.txt"
status=${PIPESTATUS[0]}
[ "$status" = 124 ] && echo "stopped at the time budget: run the same command again to resume" | tee -a "$OUTDIR/log.txt"
tar --exclude=adapter --exclude=.partial --exclude=checkpoints --exclude='*.safetensors' \
    -czf "$OUTDIR/gsm8k-mm.tar.gz" -C .cache gsm8k-mm 2>/dev/null
ls -la "$OUTDIR"
exit "$status"
