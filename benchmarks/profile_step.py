"""Where a decode step's time goes: torch profiler over SmolLM2 decode steps of a batch.

    .venv/bin/python benchmarks/profile_step.py [--batch 8] [--context 200] [--threads 2]
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = specgraph.load_model()
    engine = specgraph.Engine(model, tokenizer=tok)
    program, cache, page = engine.program, engine.kv_cache, engine.page_size
    blocks = -(-(args.context + 1) // page)
    tables = [list(range(1 + i * blocks, 1 + (i + 1) * blocks)) for i in range(args.batch)]
    with torch.no_grad():
        for t in tables:  # prefill each sequence
            program(torch.randint(0, program.vocab_size, (args.context,)),
                    AttentionMetadata.build([(t, 0, args.context)], page, [[args.context - 1]]), cache)
        meta = AttentionMetadata.build([(t, args.context, 1) for t in tables], page, [[0]] * args.batch)
        x = torch.randint(0, program.vocab_size, (args.batch,))
        for _ in range(3):
            program(x, meta, cache)
        t0 = time.perf_counter()
        for _ in range(5):
            program(x, meta, cache)
        print(f"decode step, batch {args.batch}, context {args.context}, threads {torch.get_num_threads()}: "
              f"{(time.perf_counter() - t0) / 5 * 1e3:.1f} ms")
        with torch.autograd.profiler.profile() as prof:
            for _ in range(3):
                program(x, meta, cache)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
