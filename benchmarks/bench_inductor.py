"""Does Inductor's CPU code pay on top of specgraph's CPU lowering? One SmolLM2 decode step, both ways.

    .venv/bin/python benchmarks/bench_inductor.py [--threads 2] [--context 128] [--no-freezing]

The same DecoderProgram graph (after every specgraph pass) runs

* ``lowered``:  specgraph's CPU lowering (oneDNN linears over prepacked weights, the attention
  reference called directly, see ``compiler/lowering.py``), eager ATen for the rest;
* ``inductor``: ``torch.compile(graph, backend="inductor", dynamic=True)`` with weight freezing
  (Inductor then prepacks the linears for oneDNN itself, because the row count is symbolic), its
  generated C++ for the elementwise chains, and the ``specgraph::`` ops as extern calls.

Printed: the first-call cost of Inductor (compile; the FX graph cache makes later processes
faster), then the median decode-step time of batch 1 and batch 8 for both, measured side by side
on the same cache and inputs, and the largest logit difference between them.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import specgraph
from specgraph.compiler.program import AttentionMetadata


def decode_step_ms(program, cache, batch: int, context: int, repeats: int = 8) -> tuple[float, torch.Tensor]:
    g = torch.Generator().manual_seed(batch)
    page = program.page_size
    blocks = -(-(context + 1) // page)
    tables = [list(range(1 + i * blocks, 1 + (i + 1) * blocks)) for i in range(batch)]
    for t in tables:  # prefill each sequence
        ids = torch.randint(0, program.vocab_size, (context,), generator=g)
        program(ids, AttentionMetadata.build([(t, 0, context)], page, [[context - 1]]), cache)
    meta = AttentionMetadata.build([(t, context, 1) for t in tables], page, [[0]] * batch)
    x = torch.randint(0, program.vocab_size, (batch,), generator=g)
    for _ in range(3):
        out = program(x, meta, cache)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        program(x, meta, cache)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--no-freezing", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = specgraph.load_model()
    engine = specgraph.Engine(model, tokenizer=tok)
    program, cache = engine.program, engine.kv_cache
    batches = (1, 8)
    with torch.no_grad():
        lowered = {b: decode_step_ms(program, cache, b, args.context) for b in batches}
        import torch._inductor.config as inductor_config
        import torch.fx.experimental._config as fx_config

        inductor_config.freezing = not args.no_freezing
        fx_config.use_duck_shape = False  # equal sizes (e.g. N == S at decode) must not specialize
        gm = program.gm

        def run(*inputs):
            return gm(*inputs)

        program._executable = torch.compile(run, backend="inductor", dynamic=True, fullgraph=True)
        t0 = time.perf_counter()
        for b in batches:  # compiles: prefill (N > 1) and decode (N == 1) graphs, then batch shapes
            decode_step_ms(program, cache, b, args.context, repeats=1)
        compile_s = time.perf_counter() - t0
        inductor = {b: decode_step_ms(program, cache, b, args.context) for b in batches}
    print(f"threads {torch.get_num_threads()}, context {args.context}, freezing {not args.no_freezing}; "
          f"Inductor first calls (compile) {compile_s:.0f} s")
    print(f"{'batch':>5} {'lowered ms':>11} {'inductor ms':>12} {'inductor/lowered':>17} {'max |logit diff|':>17}")
    for b in batches:
        diff = (inductor[b][1] - lowered[b][1]).abs().max().item()
        print(f"{b:>5} {lowered[b][0]:>11.1f} {inductor[b][0]:>12.1f} {inductor[b][0] / lowered[b][0]:>17.2f} "
              f"{diff:>17.2e}")


if __name__ == "__main__":
    main()
