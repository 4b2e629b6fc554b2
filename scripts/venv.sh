#!/usr/bin/env bash
# Create .venv with the CPU build of torch and this package with the given extras
# (a pinned torch: an unpinned one pulls a multi-GB CUDA build). Sourced by demo.sh and test.sh.
set -euo pipefail
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[$1]"
