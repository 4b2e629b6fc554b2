#!/usr/bin/env bash
# The scale suite on the GPU machine: random-init models of real shapes (built there from a
# config), 2,000 GSM8K records and 64 target pairs, `prism-select score` with default flags
# (plus --max-length 512), one step or several per call; a step stopped by the time budget
# resumes when the same step runs again (the run directory keeps its finished work).
#   bash benchmarks/scale_suite.sh STEP...   with STEP one of
#     setup-llama8b | setup-qwen14b           model + adapters (8B) + data into $S
#     full | lora-qkvo128 | lora-all32         score with every decoder linear layer / an adapter
#     report                                   table + JSON of the finished runs into $OUT
#   environment: S (work folder, default /tmp/s), OUT, BUDGET (seconds per score step),
#   DATA (folder with GSM8K train.jsonl and test.jsonl, default .device/data)
set -uo pipefail
cd "$(dirname "$0")/.."
S="${S:-/tmp/s}"; OUT="${OUT:-/tmp/scale-out}"; DATA="${DATA:-.device/data}"
mkdir -p "$S" "$OUT"
if ls .device/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .device/wheels/*.whl >/dev/null 2>&1 || exit 3
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
score() {  # score NAME [extra args]
  local name="$1"; shift
  timeout "${BUDGET:-540}" python3 -m prism_select.cli -v score --model "$S/model" --pool "$S/pool.jsonl" \
    --targets "$S/targets.jsonl" --out "$S/run-$name" --max-length 512 --cache-dir "$S/cache" ${CAP:+--max-gpu-memory $CAP} --no-progress "$@" \
    2>&1 | grep -v "^INFO httpx" | tee -a "$OUT/log-$name.txt"
  echo "step $name: exit ${PIPESTATUS[0]}" | tee -a "$OUT/log-$name.txt"
}
for step in "$@"; do
  case "$step" in
    setup-llama8b) python3 benchmarks/scale_setup.py --shape llama8b --gsm8k "$DATA" --out "$S" \
                     --adapter lora-qkvo128 lora-all32 ;;
    setup-qwen14b) python3 benchmarks/scale_setup.py --shape qwen14b --gsm8k "$DATA" --out "$S" ;;
    full) score full ;;
    lora-qkvo128|lora-all32) score "$step" --adapter "$S/$step" ;;
    report) python3 benchmarks/scale_report.py "$S"/run-* --json "$OUT/scale.json" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
df -h "$S" | tail -1
