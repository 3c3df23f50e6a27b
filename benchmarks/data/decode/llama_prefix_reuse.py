"""llama.cpp's time to first token with and without ``reset()`` before each call, the two ways in alternating
passes over six prompts (each call follows another prompt, as in bench_decode.py). Without it llama-cpp-python
reuses the last call's longest common prefix (the chat template's system prompt).

    .venv/bin/python benchmarks/data/decode/llama_prefix_reuse.py
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import llama_cpp_runner  # noqa: E402
from common import chat_prompt_ids, cpu_description  # noqa: E402
from prompts import CHAT_PROMPTS, CODE_PROMPTS  # noqa: E402

import specgraph  # noqa: E402

_, tok = specgraph.load_model("smollm2-135m-instruct")
llama = llama_cpp_runner.for_model("smollm2-135m-instruct", "f32", 2)
prompts = [chat_prompt_ids(tok, p) for p in (CODE_PROMPTS[:3] + CHAT_PROMPTS[:3])]
print(cpu_description(), "llama-cpp-python", llama.version)
print("prompt tokens", [len(p) for p in prompts])


def ttft(ids: list[int], reset: bool) -> float:
    if reset:
        llama.llm.reset()
    t0 = time.perf_counter()
    for _ in llama.llm.generate(ids, temp=0.0, top_k=1, reset=True):
        return time.perf_counter() - t0


res = {True: [], False: []}
for r in range(4):
    for reset in ((True, False) if r % 2 else (False, True)):
        for p in prompts:
            res[reset].append(ttft(p, reset))
for reset in (False, True):
    print(f"reset={reset}: median {statistics.median(res[reset]) * 1e3:.0f} ms, per call",
          [round(x * 1e3) for x in res[reset]])
