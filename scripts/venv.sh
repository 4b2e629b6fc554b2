#!/usr/bin/env bash
# Create .venv with torch and this package with the given extras. Sourced by demo.sh and test.sh.
# torch is pinned: an unpinned one may pull a newer multi-GB build. On Linux without an NVIDIA
# GPU the CPU-only build comes from PyTorch's CPU index when that answers within seconds;
# otherwise (offline mirrors, CI behind a proxy) from pip's configured indexes, where
# PyPI's Linux wheel is the CUDA build (it runs on the CPU too, only larger).
set -euo pipefail
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
TORCH=torch==2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu
if [ "$(uname -s)" = Linux ] && ! command -v nvidia-smi >/dev/null 2>&1 \
   && .venv/bin/python -c "import urllib.request as u; u.urlopen('$CPU_INDEX/torch/', timeout=5)" 2>/dev/null; then
    .venv/bin/pip install -q "$TORCH" --index-url "$CPU_INDEX" --extra-index-url https://pypi.org/simple
else
    .venv/bin/pip install -q "$TORCH"
fi
.venv/bin/pip install -q -e ".[$1]"
