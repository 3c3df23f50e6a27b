"""host ms per 64-token batch-4 greedy batch: the NumPy argmax vs torch's per-row argmax (the old path), alternating."""
import sys, time, gc, torch
sys.path.insert(0, "benchmarks")
from common import chat_prompt_ids
from prompts import HELDOUT_CHAT_PROMPTS, HELDOUT_CODE_PROMPTS
import specgraph
from specgraph.runtime import step_logits
torch.set_num_threads(2)
m, tok = specgraph.load_model()
fast = step_logits.row_argmax
slow = lambda l: [int(torch.argmax(row)) for row in l]
engines = {"none": specgraph.Engine(m, tokenizer=tok), "ngram k=2": specgraph.Engine(m, tokenizer=tok, draft="ngram", num_draft_tokens=2, adaptive=False)}
for kind, texts in (("chat", HELDOUT_CHAT_PROMPTS), ("code", HELDOUT_CODE_PROMPTS)):
    prompts = [chat_prompt_ids(tok, t) for t in texts[:4]]
    for ename, e in engines.items():
        rows = {}
        for rnd in range(4):
            for name, f in (("torch per row", slow), ("numpy", fast)):
                step_logits.row_argmax = f
                e.reset_stats(); gc.collect()
                t0 = time.perf_counter()
                out = e.generate(prompts, max_new_tokens=64, seed=0, ignore_eos=True)
                wall = time.perf_counter() - t0
                rows.setdefault(name, []).append((wall, e.stats["host_s"], [o.token_ids for o in out]))
        same = all(r[2] == rows["numpy"][0][2] for v in rows.values() for r in v)
        for name, r in rows.items():
            print(kind, ename, name, "wall", [round(x[0], 3) for x in r], "host ms", [round(1e3 * x[1], 1) for x in r], "same tokens", same, flush=True)
