"""KV-cache precision on SmolLM2-135M-Instruct: perplexity per text, bytes per token, pool capacity.

    .venv/bin/python benchmarks/bench_kv_quant.py [--texts tuned|heldout|all] [--chunk 16] [--new-tokens 64]

Each setting is ``kv_dtype[:hot_window]`` (``fp8:0``: every page quantized as written, as before
the hot/cold cache; ``int4:64``: a 64-token hot window; ``fp8`` / ``int4`` / ``adaptive``: the
default window). Texts run through ``engine.score`` in prefill chunks of 16 tokens, so each chunk
attends to the cached K/V of the chunks before it, cold pages included. Two text sets:

* ``tuned`` (what the hot window and the schemes were chosen on): the project's own
  ``benchmarks/data/eval_text.txt`` and the source of the standard library's ``textwrap``;
* ``heldout`` (reported, never tuned on): prose, the Python reference's "execution model" section
  (``pydoc_data.topics``), and code, the source of the standard library's ``calendar``.

Also: top-1 next-token agreement with float32 over all texts, greedy agreement on the benchmark
prompts, bytes per token (cold pages; and for a 4,096-token sequence with its hot pages: the
"long context" figure), and the pool's capacity in tokens for one memory budget.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import math
import os
import sys
import time

import torch

import specgraph

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import chat_prompt_ids, cpu_description  # noqa: E402
from prompts import PROMPTS  # noqa: E402

SETTINGS = ("float32", "bfloat16", "fp8:0", "int4:0", "fp8", "int4", "adaptive")
TEXTS = {"tuned": ("project", "code:textwrap"), "heldout": ("prose:execmodel", "code:calendar")}
LONG_CONTEXT = 4096


def load_text(name: str) -> str:
    """``project``: eval_text.txt; ``code:MODULE``: a standard-library module's source; ``prose:TOPIC``:
    a section of the Python reference (``pydoc_data.topics``)."""
    if name == "project":
        return open(os.path.join(HERE, "data", "eval_text.txt")).read()
    kind, _, what = name.partition(":")
    if kind == "code":
        return inspect.getsource(importlib.import_module(what))
    if kind == "prose":
        from pydoc_data.topics import topics

        return topics[what]
    raise ValueError(f"unknown text {name!r}")


def parse_setting(setting: str) -> tuple[str, int | None]:
    kv, _, window = setting.partition(":")
    return kv, int(window) if window else None


def long_context_bytes(stats: dict, page: int, hot_window: int, length: int = LONG_CONTEXT) -> float:
    """Bytes per token of one ``length``-token sequence: its hot window and last page in float, the rest cold."""
    if "kv_hot_bytes_per_token" not in stats:
        return float(stats["kv_bytes_per_token"])
    hot = min(length, hot_window + page)
    return (hot * stats["kv_hot_bytes_per_token"] + (length - hot) * stats["kv_bytes_per_token"]) / length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", default="all", choices=("tuned", "heldout", "all"))
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=1500, help="tokens scored per text (0: all)")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt (0: skip)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="kv_dtype[:hot_window], comma-separated")
    parser.add_argument("--lowering", default="eager", help="eager: no step compile (the numbers are the same)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_description(), flush=True)
    model, tok = specgraph.load_model("smollm2-135m-instruct")
    names = TEXTS["tuned"] + TEXTS["heldout"] if args.texts == "all" else TEXTS[args.texts]
    texts = {}
    for name in names:
        ids = tok(load_text(name), add_special_tokens=False)["input_ids"]
        texts[name] = ids[: args.max_tokens] if args.max_tokens else ids
    prompts = [chat_prompt_ids(tok, p) for _, p in PROMPTS]
    budget = 256 << 20
    print(f"texts: {', '.join(f'{n} ({len(i)} tokens)' for n, i in texts.items())}; chunk {args.chunk}; greedy: "
          f"{len(prompts)} prompts x {args.new_tokens} tokens; threads {torch.get_num_threads()}; KV budget "
          f"{budget >> 20} MiB", flush=True)
    rows, ref = [], None
    for setting in args.settings.split(","):
        kv, window = parse_setting(setting)
        engine = specgraph.Engine(model, tokenizer=tok, kv_dtype=kv, kv_hot_window=window, kv_cache_memory=budget,
                                  lowering=args.lowering)
        t0 = time.perf_counter()
        ppl, top1 = {}, []
        for name, ids in texts.items():
            logp, top = engine.score(ids, chunk_size=args.chunk, return_top1=True)
            ppl[name] = math.exp(-float(logp.mean()))
            top1.append(top)
        top1 = torch.cat(top1)
        gen = [r.token_ids for r in engine.generate(prompts, max_new_tokens=args.new_tokens, ignore_eos=True)] \
            if args.new_tokens else []
        if ref is None:
            ref = dict(top1=top1, gen=gen)
        s = engine.stats
        options = engine.program.compiled.context.options
        rows.append(dict(setting=setting, ppl=ppl, top1=float((top1 == ref["top1"]).float().mean()),
                         greedy_same=sum(g == r for g, r in zip(gen, ref["gen"])), bytes=s["kv_bytes_per_token"],
                         long=long_context_bytes(s, engine.page_size, options.hot_window_tokens),
                         pool=s["kv_pool_tokens"], window=options.hot_window_tokens))
        print(f"  {setting}: done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    base = rows[0]
    head = "".join(f" {n[:16]:>16}" for n in texts)
    print(f"\nperplexity vs {base['setting']} per text (chunk {args.chunk}); held-out: "
          f"{', '.join(TEXTS['heldout'])}")
    print(f"{'setting':<11} {'window':>6}{head} {'top-1':>7} {'greedy':>7} {'B/token':>8} {'@4k vs f32':>10} "
          f"{'pool tokens':>11}")
    for r in rows:
        cells = "".join(f" {r['ppl'][n]:8.3f} {100 * (r['ppl'][n] / base['ppl'][n] - 1):+6.2f}%" for n in texts)
        print(f"{r['setting']:<11} {r['window']:>6}{cells} {r['top1']:7.4f} {r['greedy_same']:>3}/{len(ref['gen']):<3} "
              f"{r['bytes']:8d} {r['long'] / base['bytes']:10.3f} {r['pool']:11d}")


if __name__ == "__main__":
    main()
