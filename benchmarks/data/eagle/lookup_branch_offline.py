"""Offline: what a prompt-lookup branch beside the shipped EAGLE head's chains could gain.

    python benchmarks/data/eagle/lookup_branch_offline.py

On the target's greedy answers (128 tokens) to the benchmarks' held-out and tuning prompts, a verify loop is
walked as the engine walks it (each step keeps the longer of the head's chain and the lookup's continuation
that the target's tokens confirm, then moves past them): tokens per forward and drafted nodes per verify,
for EAGLE chains of 2, 3, 5 and branch-length rules (by the matched suffix's length n: "1:2,2:4,3:6" is two
tokens per matched token, what ``lookup_branch.py`` does). Walking matters: a mean over every answer position
counts a long copied span once per position and read 2.5 tokens per forward for lookup alone on held-out
code, where the engine measures 1.68. The answers and drafts are cached in /tmp/oracle/seqs.pt.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
torch.set_num_threads(1)
from specgraph.runtime.heads.distill_data import Sequence
from specgraph.runtime.proposers.ngram import NgramProposer
cache = "/tmp/oracle/seqs.pt"
os.makedirs(os.path.dirname(cache), exist_ok=True)
if not os.path.exists(cache):
    import specgraph
    from prompts import HELDOUT_CHAT_PROMPTS, HELDOUT_CODE_PROMPTS, CODE_PROMPTS, CHAT_PROMPTS
    from specgraph.compiler.options import BackendOptions
    from specgraph.compiler.program import compile_decoder
    from specgraph.runtime.heads.base import load_head, target_fingerprint, target_vocab_weights
    from specgraph.runtime.heads.distill_data import chat_ids, teacher_features
    from specgraph.runtime.heads.eagle import EagleHead
    from specgraph.runtime.heads.training import chain_drafts
    from specgraph.runtime.proposers.learned import shipped_head
    model, tok = specgraph.load_model("smollm2-135m-instruct")
    plain = specgraph.Engine(model, tokenizer=tok)
    program = compile_decoder(model, BackendOptions(page_size=16, hidden_states=True, lowering="eager", self_check=False))
    vocab = program.vocab_size
    embed, lm = target_vocab_weights(model, vocab)
    head = load_head(shipped_head(target_fingerprint(model, vocab), "eagle"), {"eagle": EagleHead}).attach(embed, lm).eval()
    out = {}
    for name, prompts in {"heldout-code": HELDOUT_CODE_PROMPTS, "heldout-chat": HELDOUT_CHAT_PROMPTS, "tuning-code": CODE_PROMPTS, "tuning-chat": CHAT_PROMPTS}.items():
        seqs = []
        for p in prompts:
            ids = chat_ids(tok, p)
            o = plain.generate([ids], max_new_tokens=128)[0].token_ids
            seqs.append(Sequence(ids + o, name, True, prompt_len=len(ids), greedy=True))
        teacher_features(program, 16, seqs)
        with torch.no_grad():
            out[name] = [(s.ids, s.prompt_len, torch.stack(chain_drafts(head, torch.tensor(s.ids), s.feats.float(), 6)).tolist()) for s in seqs]
    torch.save(out, cache)
data = torch.load(cache)
ng = NgramProposer(3, 1)
def run(seqs, de, rule):
    toks = fwd = nodes = 0
    for ids, pl, drafts in seqs:
        pos = pl - 1
        while pos < len(ids) - 1:
            truth = ids[pos + 1:pos + 1 + 8]
            e = [drafts[j][pos] for j in range(de)]
            d = ng.draft(ids[:pos + 1], 8)
            l = d.token_ids[:rule(d.evidence)] if d.token_ids else []
            def acc(c):
                a = 0
                while a < min(len(c), len(truth)) and c[a] == truth[a]: a += 1
                return a
            a = max(acc(e), acc(l))
            # merged nodes: shared prefix counted once
            share = 0
            while share < min(len(e), len(l)) and e[share] == l[share]: share += 1
            nodes += len(e) + len(l) - share
            toks += a + 1; fwd += 1; pos += a + 1
    return toks / fwd, nodes / fwd
rules = {"none": lambda n: 0, "5": lambda n: 5, "ev>=2:5": lambda n: 5 if n >= 2 else 0,
         "1:2,2:4,3:6": lambda n: {1: 2, 2: 4}.get(n, 6), "1:1,2:3,3:6": lambda n: {1: 1, 2: 3}.get(n, 6), "8": lambda n: 8}
for name, seqs in data.items():
    for de in (2, 3, 5):
        print(name, f"eagle chain {de}", "  ".join(f"{r}: {t:.2f} tok/fwd {n:.1f} nodes" for r, (t, n) in ((r, run(seqs, de, f)) for r, f in rules.items())), flush=True)
