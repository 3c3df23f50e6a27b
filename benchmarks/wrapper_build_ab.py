"""Step-graph build cost and decode speed with the C++ wrapper compiled apart from the kernels (wrapper at
Inductor's wrapper level -O1, kernels at -O3) or in one source at -O3, on SmolLM2, in one process.

    .venv/bin/python benchmarks/wrapper_build_ab.py [--rounds 10] [--tokens 48]

Each variant builds an Engine (lowering "inductor") over its own empty Inductor cache, so every step graph is
generated and compiled by g++; the captured graph comes from specgraph's graph cache. Both variants compile the
same graphs where an earlier build on this machine saved the step plan; otherwise the first one measures it,
compiling the candidate buckets too (compare seconds per graph then, or run the script again). Then the two engines decode the same prompts in turns (the order reversed
every other round), batch 1 and batch 4, greedy: the tokens must be identical, and the table gives the
median tokens/s and the median of the same-round ratios.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

import specgraph
from specgraph.compiler import inductor
from common import chat_prompt_ids, cpu_description, format_table, log

PROMPTS = ["Write a Python function that merges two sorted lists.", "Explain what a hash map is.",
           "Write a haiku about the sea.", "How do I read a CSV file in Python?"]


def build(model, tok, separate: bool, cache_dir: str):
    inductor.SEPARATE_WRAPPER_BUILD = separate
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    start = time.perf_counter()
    engine = specgraph.Engine(model, tokenizer=tok, lowering="inductor", max_num_seqs=4)
    total = time.perf_counter() - start
    steps = engine.program._steps
    return engine, total, steps.compile_seconds, steps.compiles


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    print(cpu_description(), f"; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    model, tok = specgraph.load_model("smollm2-135m-instruct")
    prompts = [chat_prompt_ids(tok, p) for p in PROMPTS]
    engines, rows = {}, []
    caches = tempfile.mkdtemp(prefix="wrapper_ab_")  # each build's Inductor cache; removed at the end
    for i, (name, separate) in enumerate((("apart (wrapper -O1, kernels -O3)", True), ("one source (-O3)", False))):
        log(f"building: {name}")
        engine, total, compile_s, compiles = build(model, tok, separate, os.path.join(caches, str(i)))
        engines[name] = engine
        rows.append([name, f"{compiles}", f"{compile_s:.1f}", f"{compile_s / max(compiles, 1):.1f}", f"{total:.1f}"])
        log(f"built in {total:.1f} s ({compiles} graphs, {compile_s:.1f} s compiling)")
    print(format_table(["build", "graphs", "compile s", "s/graph", "Engine() s"], rows))

    names = list(engines)
    speeds = {(name, batch): [] for name in names for batch in (1, 4)}
    outputs: dict = {}
    for round_ in range(args.rounds):
        for batch in (1, 4):
            for name in names if round_ % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                results = engines[name].generate(prompts[:batch], max_new_tokens=args.tokens, ignore_eos=True)
                speeds[name, batch].append(batch * args.tokens / (time.perf_counter() - start))
                tokens = [r.token_ids for r in results]
                if outputs.setdefault(batch, tokens) != tokens:
                    raise SystemExit(f"batch {batch}: the two builds generated different tokens")
    rows = []
    for batch in (1, 4):
        a, b = (speeds[name, batch] for name in names)
        ratios = [x / y for x, y in zip(a, b)]
        rows.append([f"batch {batch}", f"{statistics.median(a):.1f}", f"{statistics.median(b):.1f}",
                     f"{statistics.median(ratios):.3f}", " ".join(f"{r:.2f}" for r in ratios)])
    print(format_table(["decode tok/s", "apart", "one source", "apart/one (median)", "each round"], rows))
    print("tokens identical in every round")
    shutil.rmtree(caches, ignore_errors=True)  # the engines' code is loaded already


if __name__ == "__main__":
    main()
