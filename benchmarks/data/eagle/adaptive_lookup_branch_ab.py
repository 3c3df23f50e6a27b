"""Adaptive (the default) engines side by side on the held-out prompts, batch 1, greedy, 128 tokens, interleaved per
prompt: none, draft="eagle", draft="eagle+ngram".  python benchmarks/data/eagle/adaptive_lookup_branch_ab.py"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import specgraph  # noqa: E402
from common import cpu_description  # noqa: E402
from prompts import HELDOUT_CHAT_PROMPTS, HELDOUT_CODE_PROMPTS  # noqa: E402
from specgraph.runtime.heads.distill_data import chat_ids  # noqa: E402
torch.set_num_threads(2)
print(f"cpu: {cpu_description()}; threads 2", flush=True)
model, tok = specgraph.load_model("smollm2-135m-instruct")
engines = {"none": specgraph.Engine(model, tokenizer=tok), "eagle": specgraph.Engine(model, tokenizer=tok, draft="eagle"),
           "eagle+ngram": specgraph.Engine(model, tokenizer=tok, draft="eagle+ngram")}
for name, prompts in {"code": HELDOUT_CODE_PROMPTS, "chat": HELDOUT_CHAT_PROMPTS}.items():
    tokens = dict.fromkeys(engines, 0); secs = dict.fromkeys(engines, 0.0); outs = {}
    for e in engines.values():
        e.generate([chat_ids(tok, prompts[0])], max_new_tokens=8); e.reset_stats()
    for i, p in enumerate(prompts):
        ids = chat_ids(tok, p)
        order = list(engines) if i % 2 == 0 else list(engines)[::-1]
        for n in order:
            t0 = time.perf_counter(); r = engines[n].generate([ids], max_new_tokens=128)[0]
            secs[n] += time.perf_counter() - t0; tokens[n] += len(r.token_ids); outs.setdefault(i, {})[n] = r.token_ids
    same = all(len({tuple(v) for v in o.values()}) == 1 for o in outs.values())
    for n, e in engines.items():
        s = e.stats
        print(f"{name:5s} {n:12s} {tokens[n] / secs[n]:6.1f} tok/s  {tokens[n] / secs[n] / (tokens['none'] / secs['none']):.2f}x none"
              f"  tokens/forward {s.get('mean_accepted_tokens', 1):.2f}  speculated {s.get('speculated_fraction', 0):.2f}", flush=True)
    print(name, "greedy identical:", same, flush=True)
