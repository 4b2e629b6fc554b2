#!/usr/bin/env bash
# One GPU call's worth of measurements (docs/performance.md, run 5): the CUDA-only tests,
# then bench_scoring.py on the embedded model (GSM8K), the 0.3B and the 1B configs.
#   bash benchmarks/gpu_suite.sh OUT_DIR GGUF|- [all|embedded|random|fit|vstage]
#   ("fit": the curvature fit with and without CUDA graphs on all three models, run 6;
#   "vstage": the direction and the fit as --precision model and split32 compute them, run 12)
#   (GGUF: the embedded model's file; "-" skips the embedded model; the third argument
#   splits the suite over two calls of at most 10 minutes each)
set -uo pipefail
OUT="${1:?output folder}"; GGUF="${2:--}"; WHAT="${3:-all}"
[ "$GGUF" = "-" ] && GGUF=""
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -n "$GGUF" ] && export PRISM_SELECT_DEFAULT_GGUF="$GGUF"
if [ "$WHAT" = vstage ]; then
  # docs/performance.md, run 12: the direction and the fit as --precision model and split32
  # compute them (and on float32-upcast weights, for comparison): what each costs, and
  # which part of v's precision moves the ranking
  python3 -m pytest -q -p no:cacheprovider tests/test_precision.py tests/test_graphs.py 2>&1 | tail -4 | tee "$OUT/gpu_tests.txt"
  R=forward,fwd_bwd,fwd_bwd_graphs,direction,direction_s32,direction_f32w,fit,fit_s32,fit_f32w
  [ -n "$GGUF" ] && python3 benchmarks/bench_scoring.py --config embedded --pool benchdata/gsm8k_1100.jsonl --n 1000 \
     --targets 64 --batch 32 --fit-n 1000 --routes $R --json "$OUT/run12_embedded_vstage.json" 2>&1 | grep -A30 "^## "
  [ -n "$GGUF" ] && python3 benchmarks/v_precision.py --pool benchdata/gsm8k_1100.jsonl --n 1000 --targets 64 \
     --batch 32 --json "$OUT/run12_v_precision_n1000.json" 2>&1 | tail -3
  [ -n "$GGUF" ] && python3 benchmarks/v_precision.py --pool benchdata/gsm8k_1100.jsonl --n 128 --targets 16 \
     --batch 16 --json "$OUT/run12_v_precision_n128.json" 2>&1 | tail -3
  python3 benchmarks/bench_scoring.py --config 0.3b --seq-len 512 --batch 16 --n 256 --fit-n 256 --targets 16 \
     --routes $R --json "$OUT/run12_03b_vstage.json" 2>&1 | grep -A30 "^## "
  python3 benchmarks/bench_scoring.py --config 1b --seq-len 512 --batch 16 --n 128 --fit-n 128 --targets 16 \
     --routes forward,fwd_bwd,direction,direction_s32,fit,fit_s32 --json "$OUT/run12_1b_vstage.json" 2>&1 | grep -A30 "^## "
  exit 0
fi
if [ "$WHAT" = fit ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py tests/test_numerics.py 2>&1 | tail -4 | tee "$OUT/gpu_tests.txt"
  R=forward,fwd_bwd,fwd_bwd_graphs,lib_exact,lib_exact_graphs,fit,fit_eager
  [ -n "$GGUF" ] && python3 benchmarks/bench_scoring.py --config embedded --pool benchdata/gsm8k_1100.jsonl --n 1000 \
     --targets 64 --batch 32 --fit-n 1000 --warm-all --routes $R --json "$OUT/run6_embedded.json" 2>&1 | grep -A30 "^## "
  python3 benchmarks/bench_scoring.py --config 0.3b --seq-len 512 --batch 16 --n 512 --fit-n 512 --routes $R \
     --json "$OUT/run6_03b.json" 2>&1 | grep -A30 "^## "
  python3 benchmarks/bench_scoring.py --config 1b --seq-len 512 --batch 16 --n 256 --fit-n 256 --routes $R \
     --json "$OUT/run6_1b.json" 2>&1 | grep -A30 "^## "
  exit 0
fi
[ "$WHAT" != random ] && python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py tests/test_model.py tests/integration/test_reliability.py \
    -k "cuda or gpu or graph" 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
B="python3 benchmarks/bench_scoring.py"
REFS=forward,fwd_bwd,forward_nomask,fwd_bwd_nomask,forward_graphs,fwd_bwd_graphs
if [ -n "$GGUF" ] && [ "$WHAT" != random ]; then
  $B --config embedded --pool benchdata/gsm8k_1100.jsonl --n 1000 --targets 64 --batch 32 --fit-n 1000 --warm-all \
     --routes $REFS,exact,lib_exact,lib_exact_graphs,fd32,fd32_graphs,fd_graphs,fd,fit \
     --fd32-eps 3e-6,1e-5,3e-5,1e-4 --fd-eps 0.03 --json "$OUT/run5_embedded.json" 2>&1 | tee "$OUT/run5_embedded.txt" | tail -45
fi
[ "$WHAT" = embedded ] && exit 0
$B --config 0.3b --seq-len 512 --batch 16 --n 512 --fit-n 512 \
   --routes $REFS,exact,lib_exact,lib_exact_graphs,fd32_graphs,fd_graphs,fit --fd-eps 0.03 --fd32-eps 1e-4 \
   --json "$OUT/run5_03b.json" 2>&1 | tee "$OUT/run5_03b.txt" | tail -30
$B --config 1b --seq-len 512 --batch 16 --n 256 --fit-n 256 \
   --routes $REFS,exact,lib_exact,lib_exact_graphs,fd32_graphs,fd_graphs,fit --fd-eps 0.03 --fd32-eps 1e-4 \
   --json "$OUT/run5_1b.json" 2>&1 | tee "$OUT/run5_1b.txt" | tail -30
