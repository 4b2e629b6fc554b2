#!/usr/bin/env bash
# The 8B fit's eigendecompositions one after another and side by side, on a machine with two
# GPUs: a random-init Llama-3.1-8B shape (benchmarks/scale_setup.py) scores POOL GSM8K
# records with every decoder linear layer tracked (default flags, --max-length 512), once
# with CUDA_EIGH_STREAMS=1 on GPU 0 and once with STREAMS (default 4) on GPU 1, at the same
# time; then benchmarks/dist_report.py compares the fit phases and the scores. The fitted
# curvature is not cached (--cache-max-gb 1), so both runs fit; the heuristic damping rule
# (no split-half check: its two half fits took the 64-record runs past a call's limit) lets
# both reach their scores.
#   DATA=folder-with-gsm8k-jsonl OUT=... bash benchmarks/eigh_streams_suite.sh
set -uo pipefail
cd "$(dirname "$0")/.."
S="${S:-/tmp/eigh-streams}"; OUT="${OUT:-/tmp/eigh-streams-out}"; K="${STREAMS:-4}"
mkdir -p "$S" "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[ -d "$S/model" ] || python3 benchmarks/scale_setup.py --shape llama8b --gsm8k "${DATA:?gsm8k folder}" --out "$S" \
  --pool "${POOL:-64}" --targets "${TARGETS:-16}" || exit 3
for k in 1 "$K"; do
  gpu=$([ "$k" = 1 ] && echo 0 || echo 1)
  CUDA_VISIBLE_DEVICES=$gpu timeout "${BUDGET:-420}" python3 benchmarks/eigh_streams.py --streams "$k" -- -v score \
    --model "$S/model" --pool "$S/pool.jsonl" --targets "$S/targets.jsonl" --out "$S/run-streams$k" \
    --max-length 512 --cache-dir "$S/cache-streams$k" --cache-max-gb 1 --no-progress --overwrite \
    --damping-rule heuristic \
    > "$OUT/log-streams$k.txt" 2>&1 &
done
wait
mkdir -p "$OUT/runs"
for k in 1 "$K"; do cp "$S/run-streams$k/run.json" "$OUT/runs/run-streams$k.json" 2>/dev/null; done
python3 benchmarks/dist_report.py "$S/run-streams1" "$S/run-streams$K" --json "$OUT/eigh_streams_8b.json"
