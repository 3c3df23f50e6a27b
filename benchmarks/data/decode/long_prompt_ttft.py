"""Cold time to first token of specgraph and llama.cpp (F32, reset() first) on prompts of 128-1000 tokens of
standard-library source (json.decoder, statistics), median of 3 rounds (specgraph's call, then llama.cpp's).

    .venv/bin/python benchmarks/data/decode/long_prompt_ttft.py
"""
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402
torch.set_num_threads(2)
import llama_cpp_runner  # noqa: E402
import specgraph  # noqa: E402
from common import cpu_description  # noqa: E402
from decode_runs import flush_prefix_cache  # noqa: E402

model, tok = specgraph.load_model("smollm2-135m-instruct")
eng = specgraph.Engine(model, tokenizer=tok)
llama = llama_cpp_runner.for_model("smollm2-135m-instruct", "f32", 2)
text = inspect.getsource(json.decoder) + inspect.getsource(statistics)
ids = tok(text)["input_ids"]
print(cpu_description(), "llama-cpp-python", llama.version)
res = {}
for n in (128, 256, 512, 1000):
    p = ids[:n]
    for r in range(3):
        flush_prefix_cache(eng)
        t0 = time.perf_counter(); eng.generate([p], max_new_tokens=1); a = time.perf_counter() - t0
        llama.llm.reset()
        t0 = time.perf_counter()
        for _ in llama.llm.generate(p, temp=0.0, top_k=1, reset=True): break
        b = time.perf_counter() - t0
        res.setdefault(n, []).append((a, b))
    a = statistics.median(x for x, _ in res[n]); b = statistics.median(y for _, y in res[n])
    print(f"prompt {n:5d} tokens: specgraph {a*1e3:7.0f} ms  llama.cpp {b*1e3:7.0f} ms  ratio {a/b:.2f}", flush=True)
