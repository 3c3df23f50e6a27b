#!/usr/bin/env bash
# Prepares what a lent GPU machine needs to run benchmarks/*.py on SmolLM2: it reaches no registry and
# takes at most 64 MiB per call (the tracked tree is ~14 MiB, the shipped GGUF 94 MiB), so the GGUF goes in
# two parts under .device/ (one per call; the first call keeps its part in /tmp, which lasts while the
# machine stays warm) and the gguf reader as a wheel under .whl/. Both folders are git-ignored here.
#
#   bash benchmarks/device_prepare.sh
#   call 1 (carry .device/p1 .whl):  cp .device/p1/part00 /tmp/p1 && <setup>
#   call 2 (carry .device/p2 .whl), within the machine's warm time:
#     <setup>; cat /tmp/p1 .device/p2/part01 > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf &&
#     python3 benchmarks/bench_adaptive.py --device cuda --model /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \
#       --proposers ngram --ks 2,4 --time-budget 520 --json $OUT/x.json   (timeout_s 580)
#   On an H100 (run Y) the two engines took 148 s and 130 s to build (four CUDA graph buckets) and a round of
#   the mixed workload about 140 s: 15 minutes of device time hold both calls once, with two rounds.
#   <setup>: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
#            mkdir -p /tmp/sg && ln -sfn $PWD /tmp/sg/specgraph && export PYTHONPATH=/tmp/sg:/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
gguf=$($py -c "from specgraph.runtime.loader import find_smollm2_gguf; print(find_smollm2_gguf())")
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for folder in /.device/ /.whl/; do grep -qxF "$folder" "$exclude" 2>/dev/null || echo "$folder" >> "$exclude"; done
rm -rf .device .whl && mkdir -p .device/p1 .device/p2
split -b 49M -d "$gguf" .device/part
if [ -e .device/part02 ]; then echo "the GGUF needs more than two 49 MiB parts: carry each in its own call" >&2; exit 1; fi
mv .device/part00 .device/p1/ && mv .device/part01 .device/p2/
$py -m pip download -q --no-deps --only-binary=:all: -d .whl "gguf==$($py -c 'import importlib.metadata as m; print(m.version("gguf"))')"
ls -l .device/p1 .device/p2 .whl
