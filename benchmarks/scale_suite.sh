#!/usr/bin/env bash
# The scale suite on the GPU machine: random-init models of real shapes (built there from a
# config), 2,000 GSM8K records and 64 target pairs, `prism-select score` with default flags
# (plus --max-length 512), one step or several per call; a step stopped by the time budget
# resumes when the same step runs again (the run directory keeps its finished work).
#   bash benchmarks/scale_suite.sh STEP...   with STEP one of
#     setup-llama8b | setup-llama8b-4l | setup-qwen14b   model + adapters (8B) + data into $S
#     full | lora-qkvo128 | lora-all32         score with every decoder linear layer / an adapter
#     report                                   table + JSON of the finished runs into $OUT
#     stream                                   the whole job on a large pool (set up with, e.g.,
#                                              POOL=20000): score --stream (every decoder linear
#                                              layer, the fit on FIT sampled records, default the
#                                              library's), then select the top 5%; then
#                                              `scale_report.py $S/run-stream --project 270000`;
#                                              STREAM_GPUS=K: on K GPUs, the model sharded
#     shard                                    the same run on 1 GPU (kept if already there), then
#                                              on K GPUs for each K in KS (default: all) with
#                                              --shard fsdp and data-parallel: dist_report table
#     fsdp-full                                every decoder linear layer, --shard fsdp on FSDP_GPUS
#                                              GPUs (default all; FSDP_DEVICES: which ones)
#     keep                                     run.json, scores.jsonl and logs of every run into $OUT/runs
#     moe                                      a random-init MoE of a real shape (MOE_SHAPE: olmoe |
#                                              qwen3-30b-a3b, MOE_LAYERS blocks, default olmoe x 2):
#                                              prism-select score at default flags beside a training
#                                              step of the same model (benchmarks/moe_scale.py)
#     step                                     a training step and exact scoring side by side at
#                                              the 8B shape, batch 8 x 512 tokens (bench_scoring.py)
#   environment: S (work folder, default /tmp/s), OUT, BUDGET (seconds per score step),
#   DATA (folder with GSM8K train.jsonl and test.jsonl, default .device/data), POOL and
#   TARGETS (records and pairs of the setup steps, default 2000 and 64), MODS (modules of
#   the shard step, default the attention projections: the fit's eigendecompositions, which
#   do not divide over ranks, stay small next to the passes), EXTRA (more score flags),
#   NODDP (shard step without the data-parallel run), TAG (suffix of its result files),
#   DEADLINE (epoch seconds: every score step stops 20 s before it, to fit a call limit),
#   KS (GPU counts of the shard step), K1NOGRAPHS (shard step: also one GPU without CUDA
#   graphs, the FSDP runs' arithmetic), FSDP_LEAN (shard step: also each K with
#   --fsdp-sums step --fsdp-keep-gathered off, the transfers of every step, beside the
#   plan's choice), FSDP_SPLIT (shard step: also each K with one of the two choices alone,
#   --fsdp-sums pass / --fsdp-keep-gathered on), FSDP_GPUS / FSDP_DEVICES (fsdp-full step).
#   A step longer than a call: start it detached (setsid) on the warm machine,
#   `setsid nohup bash benchmarks/scale_suite.sh STEP > /tmp/STEP.log 2>&1 &`, and look at
#   the log in the next calls (it runs until the machine goes back).
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
LAUNCH="python3"
score() {  # score NAME [extra args]
  local name="$1"; shift
  local budget="${BUDGET:-540}"
  if [ -n "${DEADLINE:-}" ]; then
    local left=$(( DEADLINE - $(date +%s) - 20 )); [ "$left" -lt "$budget" ] && budget="$left"
    [ "$budget" -gt 30 ] || { echo "step $name: skipped, no time left before DEADLINE"; return; }
  fi
  timeout "$budget" $LAUNCH -m prism_select.cli -v score --model "$S/model" --pool "$S/pool.jsonl" \
    --targets "$S/targets.jsonl" --out "$S/run-$name" --max-length 512 --cache-dir "$S/cache" ${CAP:+--max-gpu-memory $CAP} --no-progress ${EXTRA:-} "$@" \
    2>&1 | grep --line-buffered -v "^INFO httpx" | tee -a "$OUT/log-$name.txt"
  echo "step $name: exit ${PIPESTATUS[0]}" | tee -a "$OUT/log-$name.txt"
}
for step in "$@"; do
  case "$step" in
    setup-llama8b) python3 benchmarks/scale_setup.py --shape llama8b --gsm8k "$DATA" --out "$S" \
                     --pool "${POOL:-2000}" --targets "${TARGETS:-64}" --adapter lora-qkvo128 lora-all32 ;;
    setup-llama8b-4l) python3 benchmarks/scale_setup.py --shape llama8b-4l --gsm8k "$DATA" --out "$S" \
                     --pool "${POOL:-2000}" --targets "${TARGETS:-64}" ;;
    setup-qwen14b) python3 benchmarks/scale_setup.py --shape qwen14b --gsm8k "$DATA" --out "$S" \
                     --pool "${POOL:-2000}" --targets "${TARGETS:-64}" ;;
    shard)
      export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
      MODS="${MODS:-self_attn\.(q|k|v|o)_proj}"; runs="$S/run-shard-k1"
      [ -d "$S/run-shard-k1" ] && [ -f "$S/run-shard-k1/run.json" ] || { LAUNCH="python3"; CUDA_VISIBLE_DEVICES=0 \
        score shard-k1 --modules "$MODS" --cache-dir "$S/cache-k1"; }
      if [ -n "${K1NOGRAPHS:-}" ]; then  # one GPU without CUDA graphs (as FSDP runs): the agreement baseline
        LAUNCH="python3"; CUDA_VISIBLE_DEVICES=0 score shard-k1-nographs --modules "$MODS" --cuda-graphs off \
          --cache-dir "$S/cache-k1-nographs"
        runs="$runs $S/run-shard-k1-nographs"
      fi
      for K in ${KS:-$(nvidia-smi -L | wc -l)}; do  # KS: GPU counts to run, e.g. "2 4" (default: all)
        LAUNCH="python3 -m torch.distributed.run --standalone --nproc-per-node $K"
        CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((K - 1))) score "fsdp-k$K" --modules "$MODS" --shard fsdp \
          --cache-dir "$S/cache-fsdp-k$K"
        runs="$runs $S/run-fsdp-k$K"
        if [ -n "${FSDP_LEAN:-}" ]; then  # the same with the fewest bytes held: transfers every step
          CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((K - 1))) score "fsdp-lean-k$K" --modules "$MODS" --shard fsdp \
            --fsdp-sums step --fsdp-keep-gathered off --cache-dir "$S/cache-fsdp-lean-k$K"
          runs="$runs $S/run-fsdp-lean-k$K"
        fi
        if [ -n "${FSDP_SPLIT:-}" ]; then  # each of the plan's two transfer choices alone
          CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((K - 1))) score "fsdp-pass-k$K" --modules "$MODS" --shard fsdp \
            --fsdp-sums pass --fsdp-keep-gathered off --cache-dir "$S/cache-fsdp-pass-k$K"
          CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((K - 1))) score "fsdp-gathered-k$K" --modules "$MODS" --shard fsdp \
            --fsdp-sums step --fsdp-keep-gathered on --cache-dir "$S/cache-fsdp-gathered-k$K"
          runs="$runs $S/run-fsdp-pass-k$K $S/run-fsdp-gathered-k$K"
        fi
        if [ -z "${NODDP:-}" ]; then
          CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((K - 1))) score "ddp-k$K" --modules "$MODS" --cache-dir "$S/cache-ddp-k$K"
          runs="$runs $S/run-ddp-k$K"
        fi
      done
      LAUNCH="python3"
      python3 benchmarks/dist_report.py $runs ${K1NOGRAPHS:+--agree-with 1} --json "$OUT/shard${TAG:-}.json" \
        | tee "$OUT/shard${TAG:-}.txt" ;;
    full) score full ;;
    moe) python3 benchmarks/moe_scale.py --shape "${MOE_SHAPE:-olmoe}" --layers "${MOE_LAYERS:-2}" --out "$S/moe" \
           --json "$OUT/moe_scale.json" 2>&1 | grep --line-buffered -v "^INFO httpx" | tee -a "$OUT/log-moe.txt" ;;
    step) python3 benchmarks/bench_scoring.py --config llama8b --seq-len 512 --batch 8 --n 128 --fit-n 0 \
            --routes forward,fwd_bwd,exact --json "$OUT/step_llama8b.json" 2>&1 | tail -25 ;;
    fsdp-full)
      export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
      K="${FSDP_GPUS:-$(nvidia-smi -L | wc -l)}"; LAUNCH="python3 -m torch.distributed.run --standalone --nproc-per-node $K"
      CUDA_VISIBLE_DEVICES=${FSDP_DEVICES:-$(seq -s, 0 $((K - 1)))} score "fsdp-full-k$K" --shard fsdp \
        --cache-dir "$S/cache-fsdp"; LAUNCH="python3" ;;
    keep) for r in "$S"/run-*; do [ -f "$r/run.json" ] || continue; mkdir -p "$OUT/runs/${r##*/}"
            cp "$r/run.json" "$r/scores.jsonl" "$OUT/runs/${r##*/}/" 2>/dev/null; done ;;
    lora-qkvo128|lora-all32) score "$step" --adapter "$S/$step" ;;
    report) python3 benchmarks/scale_report.py "$S"/run-* --json "$OUT/scale.json" ;;
    stream)  # STREAM_GPUS=K > 1: torchrun on K GPUs with the model sharded (--shard fsdp)
      if [ "${STREAM_GPUS:-1}" -gt 1 ]; then
        export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
        LAUNCH="python3 -m torch.distributed.run --standalone --nproc-per-node $STREAM_GPUS"
        score stream --stream ${FIT:+--fit-examples $FIT} --shard fsdp; LAUNCH="python3"
      else
        score stream --stream ${FIT:+--fit-examples $FIT}
      fi
      t0=$(date +%s)
      python3 -m prism_select.cli select --run "$S/run-stream" --pool "$S/pool.jsonl" --keep 5% \
        --out "$S/selected.jsonl" --overwrite 2>&1 | tail -2 | tee -a "$OUT/log-stream.txt"
      echo "step stream: select took $(( $(date +%s) - t0 )) s" | tee -a "$OUT/log-stream.txt" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
df -h "$S" | tail -1
