"""One Engine build in a fresh process with Inductor's freezing of panel-linear graphs on or off, over a given
Inductor cache (empty: a cold build; filled by an earlier run: a warm one), then batch-1 and batch-4 decoding.

    for v in off on; do .venv/bin/python benchmarks/data/capture/freeze_fresh_process.py $v /tmp/fab/$v; done
"""
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import specgraph  # noqa: E402
from common import chat_prompt_ids, cpu_description  # noqa: E402
from inductor_switch_ab import PROMPTS  # noqa: E402
from specgraph.compiler import inductor  # noqa: E402

freeze, cache = sys.argv[1] == "on", sys.argv[2]
inductor.FREEZE_PANEL_GRAPHS = freeze
os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
print(cpu_description(), "freeze", freeze, cache, flush=True)
model, tok = specgraph.load_model("smollm2-135m-instruct")
t0 = time.perf_counter()
eng = specgraph.Engine(model, tokenizer=tok, lowering="inductor", max_num_seqs=4)
steps = eng.program._steps
print(f"Engine {time.perf_counter() - t0:.1f} s, {steps.compiles} graphs, compile {steps.compile_seconds:.1f} s",
      flush=True)
prompts = [chat_prompt_ids(tok, p) for p in PROMPTS]
for batch in (1, 4):
    speeds = []
    for _ in range(3):
        t = time.perf_counter()
        res = eng.generate(prompts[:batch], max_new_tokens=48, ignore_eos=True)
        speeds.append(batch * 48 / (time.perf_counter() - t))
    print(f"batch {batch}: {statistics.median(speeds):.1f} tok/s", [round(x, 1) for x in speeds],
          hash(tuple(tuple(r.token_ids) for r in res)), flush=True)
