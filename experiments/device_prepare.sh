#!/usr/bin/env bash
# Prepare, on this machine, what the GPU machine (no network) needs for
# experiments/device_run.sh: pure-Python wheels of peft and gguf, GSM8K, and the
# embedded model's GGUF file split in two parts (each device call carries at most
# 64 MiB). Everything lands in the ignored folder .cache/device-eval/:
#   part1/ (the GGUF's first 48 MiB), part2/ (the rest + its sha256), wheels/, data/gsm8k/.
#
#   bash experiments/device_prepare.sh            # data from $PRISM_DATA_ROOT or ../shared/data
set -euo pipefail
cd "$(dirname "$0")/.."
DATA="${PRISM_DATA_ROOT:-../shared/data}"
PY="${PYTHON:-.venv/bin/python}"
B=.cache/device-eval
rm -rf "$B"
mkdir -p "$B/wheels" "$B/part1" "$B/part2" "$B/data/gsm8k"
. experiments/device_wheels.sh
device_wheels_download "$B/wheels" peft gguf
cp "$DATA/gsm8k/train.jsonl" "$DATA/gsm8k/test.jsonl" "$B/data/gsm8k/"
GGUF="$("$PY" -c 'from prism_select.model import resolve_default_gguf; print(resolve_default_gguf())')"
split -b 48M -a 1 -d "$GGUF" /tmp/prism-gguf-part.
mv /tmp/prism-gguf-part.0 "$B/part1/part.0"
mv /tmp/prism-gguf-part.1 "$B/part2/part.1"
if ls /tmp/prism-gguf-part.* >/dev/null 2>&1; then echo "the GGUF file needs more than two parts" >&2; exit 1; fi
sha256sum "$GGUF" | cut -d' ' -f1 > "$B/part2/sha256"
du -sh "$B"/*
git check-ignore -q "$B" || echo "warning: $B is not git-ignored" >&2
echo "ready: see experiments/README.md for the two device calls"
