#!/usr/bin/env bash
# Scaling run on one multi-GPU host (docs/performance.md): the same `prism-select score`
# command with 1, 2 and 4 processes under torchrun, then 2 under `accelerate launch`.
#   bash benchmarks/dist_suite.sh OUT_DIR [POOL=8192] [FIT=2048]
set -uo pipefail
OUT="${1:?output folder}"; POOL="${2:-8192}"; FIT="${3:-2048}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
D=/tmp/d
python3 benchmarks/dist_setup.py --config 0.3b --out $D --pool "$POOL" --chars 700
ARGS="--model $D/model --pool $D/pool.jsonl --targets $D/targets.jsonl --batch-size 32 --chunk-size 256 --fit-examples $FIT --no-progress"
RUNS=""
for K in 1 2 4; do
  python3 -m torch.distributed.run --nproc-per-node $K -m prism_select.cli score $ARGS --out $D/run$K --cache-dir $D/cache$K \
     2>&1 | tail -3
  RUNS="$RUNS $D/run$K"
done
python3 -m accelerate.commands.launch --multi_gpu --num_processes 2 -m prism_select.cli score $ARGS --out $D/acc2 \
   --cache-dir $D/cacheacc2 2>&1 | tail -3
python3 benchmarks/dist_report.py $RUNS $D/acc2 --json "$OUT/dist.json" 2>&1 | tee "$OUT/dist.txt"
cp $D/run1/run.json "$OUT/run1.json"; cp $D/run4/run.json "$OUT/run4.json"
