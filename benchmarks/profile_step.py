"""Where a step's time goes: torch profiler over SmolLM2 steps of a batch, each sequence feeding ``--tokens``
tokens (1: a decode; more: a verify of ``tokens - 1`` drafts, every row's logits). Several token counts
(``--tokens 1,3``) are timed and profiled in one process, round by round in turn, so that their difference is
not the machine's drift between two processes (on an AMD EPYC a 3-token step read 26.8 and 34.6 ms in two
processes, 25.7 and 29.6 interleaved). Each op's self time per step is printed beside the first count's,
linears per weight shape (``[panels, K, width]``: which product moved).

    .venv/bin/python benchmarks/profile_step.py [--batch 8] [--context 200] [--threads 2]
    .venv/bin/python benchmarks/profile_step.py --batch 1 --tokens 1,3 --hidden
    .venv/bin/python benchmarks/profile_step.py --batch 1 --weight-dtype int4
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter

import torch

import specgraph
from specgraph.compiler.program import AttentionMetadata

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cpu_description  # noqa: E402

LINEARS = ("specgraph_cpu::panel_linear", "specgraph_cpu::quant_linear")


def op_name(event) -> str:
    """The profiler event's op, a linear's with its weight's shape (its second input)."""
    if event.key in LINEARS and len(event.input_shapes) > 1:
        return f"{event.key} {event.input_shapes[1]}"
    return event.key if not event.key.startswith("## Call CompiledFxGraph") else "the compiled graph's own code"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", default="1", help="tokens per sequence per step, comma-separated (> 1: a verify)")
    parser.add_argument("--hidden", action="store_true", help="also return the last hidden states (EAGLE's verifies)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--rows", type=int, default=14, help="ops printed per token count")
    parser.add_argument("--weight-dtype", default="auto", help="the Engine's weight_dtype (auto, int8, int4, ...)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    counts = [int(n) for n in args.tokens.split(",")]
    model, tok = specgraph.load_model()
    engine = specgraph.Engine(model, tokenizer=tok, weight_dtype=args.weight_dtype,
                              draft="eagle" if args.hidden else None, adaptive=False if args.hidden else None)
    program, cache, page = engine.program, engine.kv_cache, engine.page_size
    blocks = -(-(args.context + max(counts)) // page)
    tables = [list(range(1 + i * blocks, 1 + (i + 1) * blocks)) for i in range(args.batch)]

    def run(x, meta):
        return program(x, meta, cache, return_hidden=True) if args.hidden else program(x, meta, cache)

    steps = {}
    with torch.no_grad():
        for t in tables:  # prefill each sequence
            program(torch.randint(0, program.vocab_size, (args.context,)),
                    AttentionMetadata.build([(t, 0, args.context)], page, [[args.context - 1]]), cache)
        for n in counts:
            steps[n] = (torch.randint(0, program.vocab_size, (args.batch * n,)),
                        AttentionMetadata.build([(t, args.context, n) for t in tables], page,
                                                [list(range(n))] * args.batch))
            for _ in range(3):
                run(*steps[n])
        wall = {n: [] for n in counts}
        self_us = {n: Counter() for n in counts}
        for _ in range(args.rounds):
            for n in counts:
                t0 = time.perf_counter()
                run(*steps[n])
                wall[n].append(time.perf_counter() - t0)
                with torch.autograd.profiler.profile(record_shapes=True) as prof:
                    run(*steps[n])
                for e in prof.key_averages(group_by_input_shape=True):
                    self_us[n][op_name(e)] += e.self_cpu_time_total / args.rounds
    print(f"cpu: {cpu_description()}; threads {torch.get_num_threads()}; batch {args.batch}, context {args.context}, "
          f"weights {args.weight_dtype}{', with hidden states' if args.hidden else ''}; {args.rounds} rounds")
    first = counts[0]
    for n in counts:
        print(f"\n{n} token(s) per sequence: {statistics.median(wall[n]) * 1e3:.1f} ms a step (median, unprofiled); "
              f"self time per step, ms{'' if n == first else f' (and {first} token(s))'}:")
        for name, us in self_us[n].most_common(args.rows):
            other = "" if n == first else f"  ({self_us[first][name] / 1e3:6.2f})"
            print(f"  {us / 1e3:6.2f}{other}  {name}")


if __name__ == "__main__":
    main()
