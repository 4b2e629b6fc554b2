# Sourced by the scripts that run on the GPU machine (experiments/device_run.sh,
# benchmarks/small_pools_device.sh), from the repository root: installs the carried
# wheels of experiments/device_prepare.sh's bundle (B=.cache/device-eval), joins and
# checks the embedded model's GGUF file, and exports the environment (offline, the model
# file, data root and cache under the bundle). Exits 3 (wheels) or 4 (model file) on failure.
B=.cache/device-eval
# once per machine (as experiments/device_experiment.sh): a job started beside another reuses
# the installed wheels and the joined file instead of rewriting what the other one reads
. experiments/device_wheels.sh
device_wheels_install "$B/wheels" /tmp/site || exit 3
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
GGUF=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$GGUF" ] || [ "$(sha256sum "$GGUF" | cut -d' ' -f1)" != "$(cat "$B/part2/sha256")" ]; then
  cat "$B"/part1/part.* "$B"/part2/part.* > "$GGUF.tmp" && mv "$GGUF.tmp" "$GGUF" || exit 4
fi
if [ "$(sha256sum "$GGUF" | cut -d' ' -f1)" != "$(cat "$B/part2/sha256")" ]; then
  echo "the joined GGUF file does not match its checksum: was .cache/device-eval/part1 carried by an earlier call?" >&2
  exit 4
fi
export PRISM_SELECT_DEFAULT_GGUF="$GGUF" PRISM_DATA_ROOT="$PWD/$B/data" \
       PRISM_SELECT_CACHE="$PWD/.cache/prism-select" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
