"""Start-up cost: time to first token in a fresh process, with a cold and a warm graph cache.

    .venv/bin/python benchmarks/bench_startup.py [--runs 2]

Each row is a new Python process that imports specgraph, loads SmolLM2-135M-Instruct, builds the
Engine as the CLI does (the generated-code step graphs compile in the background while the eager
lowering answers) and generates; "first token" is measured from the process's first line. The
cold row starts with empty caches (capture, passes and self-check run, Inductor generates the code,
and both fill their caches); the warm rows reuse them. "code ready" is when every step graph's generated code is in use (loaded from Inductor's
FX graph cache when warm). The last column times the whole
``specgraph generate "Say hello." --max-new-tokens 4``.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import cpu_description

CHILD = r"""
import time
t0 = time.perf_counter()
import specgraph
model, tok = specgraph.load_model()
t_load = time.perf_counter()
engine = specgraph.Engine(model, tokenizer=tok, compile_in_background=True)
t_engine = time.perf_counter()
engine.generate(["Say hello."], max_new_tokens=1)
t_first = time.perf_counter()
ready = engine.program.wait_for_steps()
t_ready = time.perf_counter()
print(f"RESULT {t_load - t0:.2f} {t_engine - t_load:.2f} {t_first - t0:.2f} {engine.program.from_cache} "
      f"{t_ready - t0 if ready else float('nan'):.2f}")
import os; os._exit(0)
"""


def run_child(env: dict) -> list[str]:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=900)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT")), None)
    if line is None:
        raise RuntimeError(f"the child failed:\n{out.stderr[-3000:]}")
    return line.split()[1:]


def cli_seconds(env: dict) -> float:
    specgraph_cli = Path(sys.executable).with_name("specgraph")
    t0 = time.perf_counter()
    subprocess.run([str(specgraph_cli), "generate", "Say hello.", "--max-new-tokens", "4"], capture_output=True,
                   env=env, timeout=900, check=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=2, help="warm runs")
    args = parser.parse_args()
    print(f"CPU: {cpu_description()}")
    with tempfile.TemporaryDirectory() as cache:
        # both caches start empty: specgraph's graphs and Inductor's generated code
        env = {**os.environ, "SPECGRAPH_GRAPH_CACHE": cache, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor")}
        print(f"{'graph cache':<12} {'import+load s':>13} {'engine s':>9} {'first token s':>14} "
              f"{'from cache':>10} {'code ready s':>13} {'CLI generate s':>15}")
        for label in ["cold"] + ["warm"] * args.runs:
            load, engine, first, hit, ready = run_child(env)
            cli = cli_seconds(env)
            print(f"{label:<12} {float(load):>13.1f} {float(engine):>9.1f} {float(first):>14.1f} {hit:>10} "
                  f"{float(ready):>13.1f} {cli:>15.1f}", flush=True)


if __name__ == "__main__":
    main()
