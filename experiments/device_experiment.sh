#!/usr/bin/env bash
# Run prism-select experiment commands on the GPU machine from a bundle of
# experiments/device_bundle.sh (its part1/ carried by an earlier call on the same warm
# machine, its run/ by this one). Results stay in /tmp/prism-runs (a later call on the
# same warm machine resumes there); the log and a .tar.gz of each finished output
# (LoRA adapters left out) go to $OUT.
#
#   bash BUNDLE/run/tree/experiments/device_experiment.sh BUNDLE BUDGET_S NAME:PROTOCOL:CONFIG[:SEEDS[:TASKS]] [...]
#   e.g. ... .cache/b 560 money-refusal:repair:money_refusal.yaml:0,1,2
# (SEEDS: comma-separated, default the config's; a later call with more seeds reuses the
# finished runs; TASKS: a select job's target tasks, comma-separated, --target-tasks; for a
# ranking or repair job its harmful ratios, --harmful-ratios).
# Each job gets what is left of BUDGET_S.
# PARALLEL=1 runs the jobs side by side on the one GPU (a 135M model's LoRA steps and
# scoring leave most of the GPU idle, bound by kernel launches), each with the whole
# BUDGET_S and its own log (log-NAME.txt). Jobs may share an output folder when they
# run different seeds of one config (runs/<setting>/seed<k>/ are separate); a last
# sequential call with every seed then reuses all finished steps and writes the
# aggregated results.json and report. OUTNAME=DIR puts every job's output in
# /tmp/prism-runs/DIR (default: each job in its own, named after the job); OUTNAME=@config
# puts each config's jobs in one folder named after the config (two configs side by side in
# one call: dropped_carry_k20.yaml's jobs in /tmp/prism-runs/dropped_carry_k20). JOBS=N runs a
# repair job's retrainings in N worker processes (prism-select experiment --jobs).
# GPUS=0,1,2 (with PARALLEL=1) puts job i on GPU i (cycling through the list) on a
# machine with several GPUs (CUDA_VISIBLE_DEVICES per job).
# Each output folder has its own cache (/tmp/prism-cache/OUTNAME): a config's cache_max_gb
# bounds its own jobs' fits only. With PARALLEL=1 each process's OMP_NUM_THREADS is the cores
# over (jobs x JOBS), at least 1, unless given. Every 30 s the GPUs' use, host memory, /tmp's
# disk and the load average go to $OUT/usage.txt. PACK_LOGS=1 packs the logs into
# $OUT/logs.tar.gz at the end (a call brings back a few files only).
set -uo pipefail
B="$(cd "${1:?bundle}" && pwd)"; BUDGET="${2:?budget in seconds}"; shift 2
OUTDIR="${OUT:-/tmp/prism-out}"; mkdir -p "$OUTDIR" /tmp/prism-runs
# once per machine: a second script started beside this one (another GPU) reuses the install
[ -f /tmp/site/.prism-installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site "$B"/run/wheels/*.whl && touch /tmp/site/.prism-installed; } || exit 3
export PYTHONPATH="/tmp/site:$B/run/tree${PYTHONPATH:+:$PYTHONPATH}"
GGUF=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$GGUF" ] || { cat "$B"/part1/part.* "$B"/run/part2/part.* > "$GGUF.tmp" && mv "$GGUF.tmp" "$GGUF"; } || exit 4
if [ "$(sha256sum "$GGUF" | cut -d' ' -f1)" != "$(cat "$B/run/part2/sha256")" ]; then
  rm -f "$GGUF"; echo "the joined GGUF does not match its checksum: carry part1 in an earlier call" >&2; exit 4
fi
# an earlier run folder packed by device_bundle.sh (PRIOR=...): unpacked once per machine
if [ -f "$B/run/prior.tar.gz" ] && [ ! -f /tmp/prism-runs/.prior-unpacked ]; then
  tar xzf "$B/run/prior.tar.gz" -C /tmp/prism-runs && touch /tmp/prism-runs/.prior-unpacked || exit 3
fi
DATA=/tmp/prism-data  # the bundle's GSM8K and BBH, unpacked once per machine
[ -f "$DATA/.unpacked" ] || { mkdir -p "$DATA" && tar xzf "$B/run/data.tar.gz" -C "$DATA" && touch "$DATA/.unpacked"; } || exit 3
export PRISM_SELECT_DEFAULT_GGUF="$GGUF" PRISM_DATA_ROOT="$DATA" PRISM_SELECT_CACHE=/tmp/prism-cache \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'
end=$(( $(date +%s) + BUDGET )); status=0
( while :; do date +%T; nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
    free -g | sed -n 2p; df -h /tmp | tail -1; cat /proc/loadavg; sleep 30; done ) >>"$OUTDIR/usage.txt" 2>&1 &
monitor=$!; trap 'kill "$monitor" 2>/dev/null' EXIT
run_job() {  # run_job NAME PROTO CFG SEEDS OUTNAME LOG TASKS: one experiment command, its exit status in /tmp/prism-runs/.rc-NAME
  local name="$1" proto="$2" cfg="$3" seeds="$4" outname="$5" log="$6" tasks="${7:-}" left seedargs=() t0 s
  [ -n "$seeds" ] && seedargs=(--seeds ${seeds//,/ })
  if [ -n "$tasks" ]; then
    if [ "$proto" = select ]; then seedargs+=(--target-tasks ${tasks//,/ }); else seedargs+=(--harmful-ratios ${tasks//,/ }); fi
  fi
  [ "$proto" = repair ] && [ -n "${JOBS:-}" ] && seedargs+=(--jobs "$JOBS")
  left=$(( end - $(date +%s) )); [ "$left" -gt 20 ] || { echo "no time left for $name"; echo 124 >"/tmp/prism-runs/.rc-$name"; return; }
  echo "== $name: prism-select experiment $proto --config $cfg ($left s left)" | tee -a "$log"
  t0=$(date +%s)
  # from the bundle's tree: `python3 -m` puts the current folder first on the path
  # each output folder its own cache, so one config's --cache-max-gb never evicts another's fits
  (cd "$B/run/tree" && PRISM_SELECT_CACHE="/tmp/prism-cache/$outname" timeout "$left" python3 -m prism_select.cli -v experiment "$proto" --config "$B/run/tree/experiments/$cfg" \
      --out "/tmp/prism-runs/$outname" "${seedargs[@]}" 2>&1; echo "$?" >"/tmp/prism-runs/.rc-$name") >>"$log"
  s=$(cat "/tmp/prism-runs/.rc-$name"); echo "== $name: exit $s after $(( $(date +%s) - t0 )) s" | tee -a "$log"
}
names=(); outs=(); pids=(); IFS=, read -r -a gpus <<<"${GPUS:-}"; i=0
# side by side, each process (and each of its --jobs retraining workers) gets its share of the
# cores for its CPU threads, as torchrun sets OMP_NUM_THREADS; else each would start one
# thread per core (25 processes on 16 cores in one call). OMP_NUM_THREADS given: kept.
if [ -n "${PARALLEL:-}" ] && [ -z "${OMP_NUM_THREADS:-}" ]; then
  per=$(( $(nproc) / ($# * ${JOBS:-1}) )); export OMP_NUM_THREADS=$(( per > 0 ? per : 1 ))
fi
for job in "$@"; do
  IFS=: read -r name proto cfg seeds tasks <<<"$job"
  outname="${OUTNAME:-$name}"; [ "$outname" = @config ] && outname="$(basename "${cfg%.y*ml}")"
  names+=("$name"); outs+=("$outname")
  if [ -n "${PARALLEL:-}" ]; then
    if [ "${#gpus[@]}" -gt 0 ]; then
      CUDA_VISIBLE_DEVICES="${gpus[$(( i % ${#gpus[@]} ))]}" run_job "$name" "$proto" "$cfg" "${seeds:-}" "$outname" "$OUTDIR/log-$name.txt" "${tasks:-}" &
      pids+=($!)
    else
      run_job "$name" "$proto" "$cfg" "${seeds:-}" "$outname" "$OUTDIR/log-$name.txt" "${tasks:-}" &
      pids+=($!)
    fi
    i=$(( i + 1 ))
  else
    n=$(cat "$OUTDIR/log.txt" 2>/dev/null | wc -l)
    run_job "$name" "$proto" "$cfg" "${seeds:-}" "$outname" "$OUTDIR/log.txt" "${tasks:-}" >/dev/null; tail -n +$(( n + 1 )) "$OUTDIR/log.txt"
    s=$(cat "/tmp/prism-runs/.rc-$name"); [ "$s" = 0 ] || { status=$s; [ "$s" = 124 ] && break; }
  fi
done
[ "${#pids[@]}" -gt 0 ] && wait "${pids[@]}"  # the jobs, not the usage monitor
for name in "${names[@]}"; do
  s=$(cat "/tmp/prism-runs/.rc-$name" 2>/dev/null || echo 124); [ "$s" = 0 ] || status=$s
  [ -n "${PARALLEL:-}" ] && tail -n 20 "$OUTDIR/log-$name.txt"
done
for d in $(printf '%s\n' "${outs[@]}" | sort -u); do
  tar --exclude=adapter --exclude=.partial --exclude=checkpoints --exclude='*.safetensors' \
      -czf "$OUTDIR/$d.tar.gz" -C /tmp/prism-runs "$d" 2>/dev/null
done
kill "$monitor" 2>/dev/null
if [ -n "${PACK_LOGS:-}" ]; then
  (cd "$OUTDIR" && tar czf logs.tar.gz log*.txt usage.txt && rm -f log*.txt usage.txt)
fi
ls -la "$OUTDIR"; exit "$status"
