#!/usr/bin/env bash
# Set up a virtual environment and run the default test suite (the README's test command).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh test
# kronfluence is an optional reference for one test; --no-deps keeps its torchvision pin away.
.venv/bin/pip install -q --no-deps kronfluence==1.0.1 einops einconv opt-einsum
.venv/bin/python -m pytest -q "$@"
