"""KV-cache quantization accuracy on SmolLM2-135M-Instruct: perplexity, top-1 and greedy agreement.

    .venv/bin/python benchmarks/bench_kv_quant.py [--chunk 16] [--new-tokens 128] [--threads 2]

Perplexity of benchmarks/data/eval_text.txt (about 5,200 tokens) through ``engine.score`` with
prefill chunks of 16 tokens (so every chunk attends to quantized K/V of the chunks before it),
top-1 next-token agreement with the float32 cache, greedy agreement on the 6 benchmark prompts,
and KV bytes per token / pool capacity for the same memory budget.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

import specgraph

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from prompts import PROMPTS  # noqa: E402

KV_DTYPES = ("float32", "bfloat16", "fp8", "int4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=0, help="score only the first N tokens (0: all)")
    parser.add_argument("--kv-dtypes", default=",".join(KV_DTYPES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = specgraph.load_model("smollm2-135m-instruct")
    text = open(os.path.join(HERE, "data", "eval_text.txt")).read()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if args.max_tokens:
        ids = ids[: args.max_tokens]
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               for _, p in PROMPTS]
    budget = 256 << 20
    print(f"text: {len(ids)} tokens, chunk {args.chunk}; greedy: {len(prompts)} prompts x {args.new_tokens} tokens; "
          f"threads {torch.get_num_threads()}; KV budget {budget >> 20} MiB", flush=True)
    rows, ref_top1, ref_gen = [], None, None
    for kv in args.kv_dtypes.split(","):
        engine = specgraph.Engine(model, tokenizer=tok, kv_dtype=kv, kv_cache_memory=budget)
        t0 = time.perf_counter()
        logp, top1 = engine.score(ids, chunk_size=args.chunk, return_top1=True)
        score_s = time.perf_counter() - t0
        gen = [r.token_ids for r in engine.generate(prompts, max_new_tokens=args.new_tokens, ignore_eos=True)]
        if ref_top1 is None:
            ref_top1, ref_gen = top1, gen
        same_prefix = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(r)) for g, r in zip(gen, ref_gen)]
        s = engine.stats
        rows.append(dict(kv=kv, ppl=math.exp(-float(logp.mean())), top1=float((top1 == ref_top1).float().mean()),
                         greedy_same=sum(g == r for g, r in zip(gen, ref_gen)),
                         prefix=sum(same_prefix) / len(same_prefix), bytes=s["kv_bytes_per_token"],
                         pool=s["kv_pool_tokens"], score_s=score_s))
        print(f"  {kv}: done ({score_s:.0f} s scoring)", file=sys.stderr, flush=True)
    base = rows[0]
    print(f"\n{'kv cache':<10} {'ppl':>8} {'vs f32':>8} {'top-1 agree':>12} {'greedy same':>12} "
          f"{'mean agree prefix':>18} {'bytes/token':>12} {'vs f32':>7} {'pool tokens':>12}")
    for r in rows:
        print(f"{r['kv']:<10} {r['ppl']:8.3f} {100 * (r['ppl'] / base['ppl'] - 1):+7.2f}% {r['top1']:12.4f} "
              f"{r['greedy_same']:>7}/{len(prompts):<4} {r['prefix']:18.1f} {r['bytes']:12d} "
              f"{r['bytes'] / base['bytes']:7.3f} {r['pool']:12d}")


if __name__ == "__main__":
    main()
