"""Capture cost and compiled-vs-eager forward time of the specgraph backend on SmolLM2-135M.

    .venv/bin/python benchmarks/bench_capture.py [--threads 2] [--lengths 16,64,256]

Capture = Dynamo trace + ATen re-trace + phase-1 passes (normalize, annotate) on the first call;
then `compiled(ids)` vs `model(ids)` (full cache-free forwards, interleaved, median of repeats),
and the full decoder pipeline (`compile_decoder`, what `Engine` does) for comparison.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import specgraph
from specgraph.compiler.program import compile_decoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", default="16,64,256")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = specgraph.load_model("smollm2-135m-instruct")
    backend = specgraph.backend()
    compiled = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    ids = torch.randint(0, 49152, (1, lengths[0]))
    t0 = time.perf_counter()
    with torch.no_grad():
        compiled(ids)
    first = time.perf_counter() - t0
    graph = backend.compiled[0]
    print(f"threads {torch.get_num_threads()}; first call (capture + passes + one forward) {first:.1f} s, of which "
          f"ATen capture + passes {graph.capture_seconds:.1f} s; {len(graph.gm.graph.nodes)} nodes, "
          f"{len(graph.context.analysis.sites)} attention sites")
    for record in graph.context.log:
        print("   ", record.line())
    print(f"\n{'T':>5} {'eager ms':>9} {'compiled ms':>12} {'ratio':>6} {'max |diff|':>11}")
    for T in lengths:
        ids = torch.randint(0, 49152, (1, T))
        eager, comp = [], []
        with torch.no_grad():
            ref, got = model(ids).logits, compiled(ids).logits
            for _ in range(args.repeats):
                t = time.perf_counter(); model(ids); eager.append(time.perf_counter() - t)
                t = time.perf_counter(); compiled(ids); comp.append(time.perf_counter() - t)
        e, c = statistics.median(eager) * 1e3, statistics.median(comp) * 1e3
        print(f"{T:>5} {e:9.1f} {c:12.1f} {c / e:6.2f} {(ref - got).abs().max().item():11.2e}")
    print(f"graphs compiled for {len(lengths)} lengths: {len(backend.compiled)}")
    t0 = time.perf_counter()
    program = compile_decoder(model)
    print(f"\nfull decoder pipeline (capture + positions, kv_cache, paging, cleanup, select_logits): "
          f"{time.perf_counter() - t0:.1f} s")
    for record in program.compiled.context.log:
        print("   ", record.line())


if __name__ == "__main__":
    main()
