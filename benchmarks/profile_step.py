"""Where a step's time goes: torch profiler over SmolLM2 decode steps of a batch, or over verify-shaped
steps (one sequence feeding ``--tokens`` tokens, every row's logits, as a verify of ``tokens - 1`` drafts).

    .venv/bin/python benchmarks/profile_step.py [--batch 8] [--context 200] [--threads 2]
    .venv/bin/python benchmarks/profile_step.py --batch 1 --tokens 4
    .venv/bin/python benchmarks/profile_step.py --batch 1 --weight-dtype int4
"""
from __future__ import annotations

import argparse
import time

import torch

import specgraph
from specgraph.compiler.program import AttentionMetadata


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1, help="tokens per sequence per step (a verify: > 1)")
    parser.add_argument("--weight-dtype", default="auto", help="the Engine's weight_dtype (auto, int8, int4, ...)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = specgraph.load_model()
    engine = specgraph.Engine(model, tokenizer=tok, weight_dtype=args.weight_dtype)
    program, cache, page = engine.program, engine.kv_cache, engine.page_size
    n = args.tokens
    blocks = -(-(args.context + n) // page)
    tables = [list(range(1 + i * blocks, 1 + (i + 1) * blocks)) for i in range(args.batch)]
    with torch.no_grad():
        for t in tables:  # prefill each sequence
            program(torch.randint(0, program.vocab_size, (args.context,)),
                    AttentionMetadata.build([(t, 0, args.context)], page, [[args.context - 1]]), cache)
        meta = AttentionMetadata.build([(t, args.context, n) for t in tables], page, [list(range(n))] * args.batch)
        x = torch.randint(0, program.vocab_size, (args.batch * n,))
        for _ in range(3):
            program(x, meta, cache)
        t0 = time.perf_counter()
        for _ in range(5):
            program(x, meta, cache)
        print(f"step of {n} token(s) per sequence, batch {args.batch}, context {args.context}, "
              f"threads {torch.get_num_threads()}: "
              f"{(time.perf_counter() - t0) / 5 * 1e3:.1f} ms")
        with torch.autograd.profiler.profile() as prof:
            for _ in range(3):
                program(x, meta, cache)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
