"""Huge pages on and off, side by side (``kernels/huge_pages.py``): two SmolLM2 engines per weight dtype
in one process, one built with ``SPECGRAPH_HUGE_PAGES=0`` (weights and KV pool in 4 KiB pages), one
with huge pages; ``generate`` on held-out code prompts, the engines alternating over ``--rounds``
rounds, best round per cell. Checks that both give the same tokens.

    python benchmarks/bench_huge_pages.py [--weight-dtypes auto,int8] [--batches 1,4] [--rounds 4]
"""
from __future__ import annotations

import argparse
import os
import time

import torch

import specgraph
from common import chat_prompt_ids, cpu_description
from prompts import HELDOUT_CODE_PROMPTS
from specgraph.kernels import huge_pages


def _rate(engine, prompts, new_tokens: int) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    out = engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)
    return sum(len(r.token_ids) for r in out) / (time.perf_counter() - t0), [r.token_ids for r in out]


def _build(model, tok, weight_dtype: str, huge: bool):
    os.environ["SPECGRAPH_HUGE_PAGES"] = "1" if huge else "0"
    try:
        return specgraph.Engine(model, tokenizer=tok, weight_dtype=weight_dtype)
    finally:
        os.environ.pop("SPECGRAPH_HUGE_PAGES")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--weight-dtypes", default="auto,int8")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_description())
    if not huge_pages.available():
        raise SystemExit("huge pages are not available here (THP 'never', or not Linux): nothing to compare")
    model, tok = specgraph.load_model()
    batches = [int(b) for b in args.batches.split(",")]
    prompts = {b: [chat_prompt_ids(tok, t) for t in HELDOUT_CODE_PROMPTS[:b]] for b in batches}
    print(f"{'weights':8} {'batch':>5} {'4 KiB tok/s':>12} {'huge tok/s':>11} {'ratio':>6}  same tokens")
    for weight_dtype in args.weight_dtypes.split(","):
        engines = {huge: _build(model, tok, weight_dtype, huge) for huge in (False, True)}
        for engine in engines.values():
            _rate(engine, prompts[batches[0]], 8)  # warm-up
        best = {(huge, b): 0.0 for huge in engines for b in batches}
        tokens = {}
        for _ in range(args.rounds):
            for huge, engine in engines.items():
                for b in batches:
                    rate, out = _rate(engine, prompts[b], args.new_tokens)
                    best[huge, b] = max(best[huge, b], rate)
                    tokens.setdefault((huge, b), out)
        for b in batches:
            off, on = best[False, b], best[True, b]
            print(f"{weight_dtype:8} {b:>5} {off:>12.1f} {on:>11.1f} {on / off:>6.2f}  "
                  f"{tokens[False, b] == tokens[True, b]}")
        del engines


if __name__ == "__main__":
    main()
