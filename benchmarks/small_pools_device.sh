#!/usr/bin/env bash
# benchmarks/small_pools.py on the GPU machine (no network), with the bundle of
# experiments/device_prepare.sh plus BBH:
#
#   bash experiments/device_prepare.sh && cp -r ../shared/data/bbh .cache/device-eval/data/
#   run(command="ls -la .cache/device-eval/part1", carry=[".cache/device-eval/part1"])
#   run(command="bash benchmarks/small_pools_device.sh",
#       carry=[".cache/device-eval/part2", ".cache/device-eval/wheels", ".cache/device-eval/data"], timeout_s=600)
#
# Writes $OUT/partK.json (one per part of the default pools; each written after every
# pool, kept in .cache/small-pools/ on the machine so that the same call again skips the
# finished pools) and $OUT/small_pools.txt (the log and tables). Extra arguments replace
# the default pools (see small_pools.py --help), under $BUDGET seconds (540). TIME_SCALE=F
# multiplies every part's time limit (e.g. 2 when the GPU is shared with another job).
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${OUT:-/tmp/prism-out}"
mkdir -p "$OUTDIR"
source experiments/device_env.sh
if [ $# -eq 0 ]; then
  # GSM8K at the ratios of the committed ranking results (10%, 50%; 3 seeds at 60 and 300
  # records), one 3,000-record pool each; BBH at 25%. Each part under its own time limit;
  # pools already in the JSON are skipped, so a second call on the warm machine goes on.
  RUNS=("--families mistake-math --sizes 60 300 --ratios 0.1 0.5 --seeds 0 1 2:220"
        "--families bbh-wrong --sizes 60 300 3000 --ratios 0.25 --seeds 0 1 2 --large-seeds 0:170"
        "--families mistake-math --sizes 3000 --ratios 0.1 0.5 --large-seeds 0:150")
else
  RUNS=("$*:${BUDGET:-540}")
fi
mkdir -p .cache/small-pools
status=0
k=0
for run in "${RUNS[@]}"; do
  args="${run%:*}"
  # shellcheck disable=SC2086
  limit=$(python3 -c "print(int(${run##*:} * ${TIME_SCALE:-1}))")
  timeout "$limit" python3 benchmarks/small_pools.py --data "$B/data" --batch 32 $args \
      --json ".cache/small-pools/part$k.json" 2>&1 | grep -v Warning | tee -a "$OUTDIR/small_pools.txt"
  s=${PIPESTATUS[0]}
  [ "$s" != 0 ] && status=$s
  cp ".cache/small-pools/part$k.json" "$OUTDIR/" 2>/dev/null
  k=$((k + 1))
done
exit "$status"
