"""Step-graph build cost and decode speed with one of the Inductor settings specgraph chooses switched on and
off, on SmolLM2, in one process. The switches are module flags of ``specgraph.compiler.inductor``:

* ``SEPARATE_WRAPPER_BUILD``: the C++ wrapper compiled apart from the kernels (wrapper at Inductor's wrapper
  level -O1, kernels at -O3) or in one source at -O3;
* ``FREEZE_PANEL_GRAPHS``: Inductor's freezing of the weights (folded into the graph as constants) or the
  weights passed to the compiled graph as inputs, where the float32 linears are panel ops.

    .venv/bin/python benchmarks/inductor_switch_ab.py --switch FREEZE_PANEL_GRAPHS [--rounds 10] [--tokens 48]

Each variant builds an Engine (lowering "inductor") over its own empty Inductor cache, so every step graph is
generated and compiled by g++; the captured graph comes from specgraph's graph cache. Both variants compile the
same graphs where an earlier build on this machine saved the step plan; otherwise the first one measures it,
compiling the candidate buckets too (compare seconds per graph then, or run the script again). Then the two
engines decode the same prompts in turns (the order reversed every other round), batch 1 and batch 4, greedy:
the tokens must be identical, and the table gives the median tokens/s and the median of the same-round ratios.
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


SWITCHES = ("SEPARATE_WRAPPER_BUILD", "FREEZE_PANEL_GRAPHS")


def build(model, tok, switch: str, on: bool, cache_dir: str):
    setattr(inductor, switch, on)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    start = time.perf_counter()
    engine = specgraph.Engine(model, tokenizer=tok, lowering="inductor", max_num_seqs=4)
    total = time.perf_counter() - start
    steps = engine.program._steps
    return engine, total, steps.compile_seconds, steps.compiles


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--switch", choices=SWITCHES, required=True)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    print(cpu_description(), f"; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    model, tok = specgraph.load_model("smollm2-135m-instruct")
    prompts = [chat_prompt_ids(tok, p) for p in PROMPTS]
    engines, rows = {}, []
    caches = tempfile.mkdtemp(prefix="inductor_ab_")  # each build's Inductor cache; removed at the end
    default = getattr(inductor, args.switch)
    for i, (name, on) in enumerate(((f"{args.switch}=True", True), (f"{args.switch}=False", False))):
        log(f"building: {name}")
        engine, total, compile_s, compiles = build(model, tok, args.switch, on, os.path.join(caches, str(i)))
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
    print(format_table(["decode tok/s", "True", "False", "True/False (median)", "each round"], rows))
    print("tokens identical in every round")
    setattr(inductor, args.switch, default)
    shutil.rmtree(caches, ignore_errors=True)  # the engines' code is loaded already


if __name__ == "__main__":
    main()
