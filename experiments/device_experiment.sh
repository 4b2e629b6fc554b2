#!/usr/bin/env bash
# Run prism-select experiment commands on the GPU machine from a bundle of
# experiments/device_bundle.sh (its part1/ carried by an earlier call on the same warm
# machine, its run/ by this one). Results stay in /tmp/prism-runs (a later call on the
# same warm machine resumes there); the log and a .tar.gz of each finished output
# (LoRA adapters left out) go to $OUT.
#
#   bash BUNDLE/run/tree/experiments/device_experiment.sh BUNDLE BUDGET_S NAME:PROTOCOL:CONFIG[:SEEDS] [...]
#   e.g. ... .cache/b 560 money-refusal:repair:money_refusal.yaml:0,1,2
# (SEEDS: comma-separated, default the config's; a later call with more seeds reuses the
# finished runs). Each job gets what is left of BUDGET_S.
set -uo pipefail
B="$(cd "${1:?bundle}" && pwd)"; BUDGET="${2:?budget in seconds}"; shift 2
OUTDIR="${OUT:-/tmp/prism-out}"; mkdir -p "$OUTDIR" /tmp/prism-runs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$B"/run/wheels/*.whl || exit 3
export PYTHONPATH="/tmp/site:$B/run/tree${PYTHONPATH:+:$PYTHONPATH}"
GGUF=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$GGUF" ] || cat "$B"/part1/part.* "$B"/run/part2/part.* > "$GGUF" || exit 4
if [ "$(sha256sum "$GGUF" | cut -d' ' -f1)" != "$(cat "$B/run/part2/sha256")" ]; then
  rm -f "$GGUF"; echo "the joined GGUF does not match its checksum: carry part1 in an earlier call" >&2; exit 4
fi
export PRISM_SELECT_DEFAULT_GGUF="$GGUF" PRISM_DATA_ROOT="$B/run/data" PRISM_SELECT_CACHE=/tmp/prism-cache \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'
end=$(( $(date +%s) + BUDGET )); status=0
for job in "$@"; do
  IFS=: read -r name proto cfg seeds <<<"$job"
  seedargs=(); [ -n "${seeds:-}" ] && seedargs=(--seeds ${seeds//,/ })
  left=$(( end - $(date +%s) )); [ "$left" -gt 20 ] || { echo "no time left for $name"; status=124; break; }
  echo "== $name: prism-select experiment $proto --config $cfg ($left s left)"
  t0=$(date +%s)
  # from the bundle's tree: `python3 -m` puts the current folder first on the path
  (cd "$B/run/tree" && timeout "$left" python3 -m prism_select.cli experiment "$proto" --config "$B/run/tree/experiments/$cfg" \
      --out "/tmp/prism-runs/$name" "${seedargs[@]}" 2>&1; echo "rc=$?" >/tmp/prism-runs/.rc) | tee -a "$OUTDIR/log.txt"
  s=$(sed 's/rc=//' /tmp/prism-runs/.rc); echo "== $name: exit $s after $(( $(date +%s) - t0 )) s" | tee -a "$OUTDIR/log.txt"
  tar --exclude=adapter --exclude=.partial --exclude=checkpoints --exclude='*.safetensors' \
      -czf "$OUTDIR/$name.tar.gz" -C /tmp/prism-runs "$name" 2>/dev/null
  [ "$s" = 0 ] || { status=$s; [ "$s" = 124 ] && break; }
done
ls -la "$OUTDIR"; exit "$status"
