#!/usr/bin/env bash
# Run on the GPU machine, from the repository root, with .cache/gpu-tests (made here by
# scripts/gpu_tests_prepare.sh) carried: installs the carried wheels, prints what the
# tests rely on, then runs every test that needs CUDA (marked `gpu`, or skipped with the
# reason "needs CUDA": tests/conftest.py marks those `gpu` too), slow or not, together with
# the default suite: `pytest -m "gpu or not slow"`. The log goes to $OUT/gpu_tests.log
# (OUT defaults to /tmp/gpu-tests); the exit status is pytest's (3: the wheels did not
# install, 5: no CUDA device; REQUIRE_CUDA=0 runs without one, for a check of the script).
# Extra arguments go to pytest after the marker (e.g. -x, -k NAME, or -m gpu for the CUDA
# tests alone). SITE: where the wheels are installed (default /tmp/site-gpu-tests).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-tests}"
mkdir -p "$OUT"
LOG="$OUT/gpu_tests.log"
. experiments/device_wheels.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
{
  echo "gpu_tests.sh $(date -u +%Y-%m-%dT%H:%M:%SZ), prepared at $(cat .cache/gpu-tests/commit 2>/dev/null || echo '?')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  SITE="${SITE:-/tmp/site-gpu-tests}"
  device_wheels_install .cache/gpu-tests/wheels "$SITE" || { echo "the carried wheels did not install"; exit 3; }
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  python3 - <<'PY' || exit 5
import importlib.metadata as m
import os

import torch
names = ["torch", "transformers", "peft", "datasets", "pyarrow", "dill", "multiprocess", "xxhash", "gguf",
         "kronfluence", "pytest", "hypothesis", "matplotlib", "safetensors", "numpy"]
have = {}
for n in names:
    try:
        have[n] = m.version(n)
    except m.PackageNotFoundError:
        have[n] = "MISSING"
print("versions:", ", ".join(f"{n} {v}" for n, v in have.items()))
print("cuda:", torch.cuda.is_available(), torch.cuda.device_count(), torch.version.cuda)
if not torch.cuda.is_available() and os.environ.get("REQUIRE_CUDA", "1") != "0":
    raise SystemExit("no CUDA device: the GPU tests would all skip")
PY
  python3 -m pytest -m "gpu or not slow" -ra -q -p no:cacheprovider "$@" tests
} 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
echo "exit status $rc; log: $LOG"
exit "$rc"
