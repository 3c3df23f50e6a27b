"""Are a verify step's logits bit for bit a plain decode's? (SmolLM2, one Engine's compiled program)

    python benchmarks/step_invariance.py [--batch 1,4] [--max-draft 3] [--context 200]

Speculation emits exactly no-speculation's tokens (greedy, and sampled with n-gram drafts) only if
the target's logits for a position do not depend on the step that computed them. This prefills
``batch`` code sequences, decodes their next ``max-draft`` tokens one step at a time (one token
per sequence), then feeds the same tokens again as verify streams of 2..max-draft tokens per
sequence (the cache slots are rewritten with the same values), alone and beside a prefill chunk of
one more sequence, and compares every row's logits with the decode's. Which compiled graph a
stream runs (a static bucket or the dynamic graph) comes from the step plan, measured at build on
this machine and printed; on CPU every graph's linears run the panel kernel and every step's
attention the C++ kernel, both batch-invariant.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_description, quiet_torch  # noqa: E402

CODE = ["def merge_sorted(a, b):\n    result = []\n    i = j = 0\n    while i < len(a)",
        "import os\nimport sys\n\ndef main():\n    path = sys.argv[1]\n    for name in os.listdir(path)",
        "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x)",
        "SELECT name, COUNT(*) FROM users WHERE age > 30 GROUP BY name ORDER"]


def compare(program, kv_cache, seqs: list[list[int]], draft: int, page_size: int,
            chunk: list[int] | None = None) -> list[tuple[str, int, float, int]]:
    """(step kind, stream tokens, largest |logit difference| against the decodes, rows not bitwise equal)
    per verify length: the verify streams alone, then (with ``chunk``) beside a prefill chunk of those
    tokens of one more sequence, as a step of continuous batching has when a request arrives."""
    import torch

    from specgraph.compiler.program import AttentionMetadata

    blocks = -(-max(len(s) for s in seqs + [chunk or []]) // page_size)
    tables = [list(range(1 + blocks * i, 1 + blocks * (i + 1))) for i in range(len(seqs) + 1)]
    starts = [len(s) - draft for s in seqs]
    build = AttentionMetadata.build
    with torch.no_grad():
        for ids, table, start in zip(seqs, tables, starts):
            program(torch.tensor(ids[:start]), build([(table, 0, start)], page_size, [[start - 1]]), kv_cache)
        decodes = []
        for i in range(draft):
            stream = torch.tensor([ids[start + i] for ids, start in zip(seqs, starts)])
            meta = build([(t, start + i, 1) for t, start in zip(tables, starts)], page_size, [[0]] * len(seqs))
            decodes.append(program(stream, meta, kv_cache))
        rows = []
        for kind in ("verify", "verify + prefill chunk") if chunk else ("verify",):
            extra = [(tables[-1], 0, len(chunk))] if kind != "verify" else []
            for k in range(2, draft + 1):
                stream = torch.tensor([t for ids, start in zip(seqs, starts) for t in ids[start:start + k]]
                                      + (list(chunk) if extra else []))
                meta = build([(t, start, k) for t, start in zip(tables, starts)] + extra, page_size,
                             [list(range(k))] * len(seqs) + [[len(chunk) - 1]] * len(extra))
                out = program(stream, meta, kv_cache)
                pairs = [(out[s * k + i], decodes[i][s]) for s in range(len(seqs)) for i in range(k)]
                rows.append((kind, len(seqs) * k, max((a - b).abs().max().item() for a, b in pairs),
                             sum(not torch.equal(a, b) for a, b in pairs)))
    return rows


def lengthen(ids: list[int], tokens: int) -> list[int]:
    """``ids`` repeated until at least ``tokens`` long (contexts past a kernel's size thresholds)."""
    return (ids * -(-tokens // len(ids)))[:max(tokens, len(ids))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", default="1,4", help="comma list of sequence counts (at most 4)")
    p.add_argument("--max-draft", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=200, help="tokens per sequence before the drafts (prompts repeated)")
    p.add_argument("--weight-dtype", default="auto", help="the Engine's weight_dtype (auto, int8, int4, fp8, bfloat16)")
    args = p.parse_args(argv)
    quiet_torch(args.threads)
    import specgraph

    model, tok = specgraph.load_model(args.model)
    model.eval()
    engine = specgraph.Engine(model, tokenizer=tok, page_size=16, num_blocks=128, prefix_caching=False,
                              weight_dtype=args.weight_dtype)
    seqs = [lengthen(tok(t, add_special_tokens=False)["input_ids"], args.context + args.max_draft) for t in CODE]
    chunk = tok(CODE[0] + CODE[1], add_special_tokens=False)["input_ids"]
    print(f"# step_invariance: {cpu_description()}\n# weights {args.weight_dtype}; step plan: {engine.program.step_plan}\n")
    print("batch  step                    verify stream  largest |logit diff| vs decodes  rows not bitwise equal")
    for batch in (int(b) for b in args.batch.split(",")):
        for kind, stream, diff, unequal in compare(engine.program, engine.kv_cache, seqs[:batch], args.max_draft, 16,
                                                   chunk):
            print(f"{batch:5d}  {kind:22s}  {stream:13d}  {diff:31.2e}  {unequal:3d} of {stream}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
