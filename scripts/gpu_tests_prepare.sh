#!/usr/bin/env bash
# Prepare, on this machine, the wheels that scripts/gpu_tests.sh installs on the GPU
# machine (Python 3.12, no network): the packages the tests use that the machine's image
# lacks, at the versions installed here, in the ignored folder .cache/gpu-tests/wheels/,
# and the commit they were prepared at (.cache/gpu-tests/commit, for the log).
#
#   bash scripts/gpu_tests_prepare.sh              # PYTHON: the interpreter whose versions
#   EXTRA="pyarrow xxhash" bash scripts/...        #   are carried (default .venv/bin/python);
#                                                  # EXTRA: more packages to carry
# The image holds torch, transformers, peft, pyarrow, xxhash, pytest and hypothesis
# (see the device notes); it lacks datasets and two of its dependencies (dill,
# multiprocess), gguf, datasketch (select's near-duplicate rule) and kronfluence's reference
# (kronfluence, einconv). The tree a
# device call carries is capped at 64 MiB: the script prints the total and fails over
# 60 MiB (pyarrow alone is about 40 MiB: carry it only if the image's is too old).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
W=.cache/gpu-tests/wheels
MISSING="datasets dill multiprocess gguf datasketch kronfluence einconv"
rm -rf "$W"
. experiments/device_wheels.sh
# shellcheck disable=SC2086  # word splitting of the package lists is meant
device_wheels_download "$W" $MISSING ${EXTRA:-}
git rev-parse HEAD > .cache/gpu-tests/commit 2>/dev/null || echo unknown > .cache/gpu-tests/commit
[ -z "$(git status --porcelain 2>/dev/null)" ] || echo "(with uncommitted changes)" >> .cache/gpu-tests/commit
git check-ignore -q .cache/gpu-tests || echo "warning: .cache/gpu-tests is not git-ignored" >&2
ls "$W"
wheels_kib=$(du -sk "$W" | cut -f1)
tree_kib=$(git ls-files -z | xargs -0 du -ck 2>/dev/null | tail -1 | cut -f1)
echo "wheels $((wheels_kib / 1024)) MiB + tracked tree $((tree_kib / 1024)) MiB of the 64 MiB a call carries"
if [ $((wheels_kib + tree_kib)) -gt $((60 * 1024)) ]; then
  echo "over 60 MiB: carry fewer wheels (EXTRA)" >&2
  exit 1
fi
echo "ready: run scripts/gpu_tests.sh on the GPU machine with .cache/gpu-tests carried (see docs/checks.md)"
