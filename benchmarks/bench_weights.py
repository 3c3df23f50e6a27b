"""Quantized weights on SmolLM2-135M-Instruct: accuracy and speed per weight dtype, llama.cpp beside.

    .venv/bin/python benchmarks/bench_weights.py [--weight-dtypes auto,int8,int4,fp8,bfloat16]
        [--fp8-kv int8,int4] [--new-tokens 64] [--batch 8] [--ppl-tokens 1024] [--threads 2]

One run, one table. Per configuration (weight dtype x KV dtype):

* perplexity through ``engine.score`` (prefill chunks of 16) on two texts no scheme was tuned on:
  prose (``data/eval_text.txt``) and code (the source of the standard library's ``textwrap``
  module), and top-1 next-token agreement with float32 weights on both;
* greedy agreement with float32 weights on the 6 benchmark prompts (mean tokens before the
  first difference, out of ``--new-tokens``);
* weight bytes read per decode step (every linear's stored weight and scales; the embedding
  lookup reads one row);
* batch-1 decode tok/s (each prompt alone, the configurations and llama.cpp interleaved per
  prompt, median) and batch-``--batch`` decode tok/s.

llama.cpp rows (F32, Q8_0, Q4_1 GGUFs made by llama.cpp's own quantizer from the shipped file)
when ``llama_cpp`` imports. The CPU model and its SIMD flags head the report.
"""
from __future__ import annotations

import argparse
import inspect
import math
import os
import sys
import textwrap

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from decode_runs import sg_generate  # noqa: E402
from common import ModeResult, chat_prompt_ids, cpu_description, fmt, format_table, log, median, quiet_torch  # noqa: E402
from prompts import PROMPTS, WARMUP_PROMPT  # noqa: E402

WEIGHT_DTYPES = ("auto", "int8", "int4", "fp8", "bfloat16")
LLAMA_FTYPES = ("f32", "q8_0", "q4_1")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weight-dtypes", default=",".join(WEIGHT_DTYPES))
    p.add_argument("--fp8-kv", default="int8,int4", help="weight dtypes also run with kv_dtype='fp8'")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ppl-tokens", type=int, default=1024, help="tokens scored per text")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--no-accuracy", action="store_true", help="speed only")
    a = p.parse_args(argv)
    a.weight_dtypes = [w for w in a.weight_dtypes.split(",") if w]
    a.fp8_kv = [w for w in a.fp8_kv.split(",") if w]
    return a


def weight_bytes_per_step(engine) -> int:
    """Bytes of every linear's stored weight (and scales) in the program: what a decode step streams."""
    gm = engine.program.gm
    linear_ops = {torch.ops.aten.linear.default, torch.ops.specgraph.quant_linear.default}
    seen, total = set(), 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in linear_ops:
            continue
        for arg in node.args[1:3]:
            if isinstance(arg, torch.fx.Node) and arg.op == "get_attr" and arg.target not in seen:
                seen.add(arg.target)
                t = gm.get_parameter(arg.target) if arg.target in dict(gm.named_parameters()) else \
                    gm.get_buffer(arg.target)
                total += t.numel() * t.element_size()
    return total


def texts(tok, n: int) -> dict[str, list[int]]:
    prose = open(os.path.join(HERE, "data", "eval_text.txt")).read()
    code = inspect.getsource(textwrap)
    return {name: tok(t, add_special_tokens=False)["input_ids"][:n] for name, t in (("prose", prose), ("code", code))}


def main(argv=None) -> int:
    args = parse_args(argv)
    quiet_torch(args.threads)
    import specgraph

    log(cpu_description())
    log(f"threads {torch.get_num_threads()}")
    model, tok = specgraph.load_model("smollm2-135m-instruct")
    prompt_ids = [chat_prompt_ids(tok, p) for _, p in PROMPTS]
    warm = tok(WARMUP_PROMPT, add_special_tokens=False)["input_ids"]
    eval_ids = texts(tok, args.ppl_tokens)
    configs = [(w, "auto") for w in args.weight_dtypes] + [(w, "fp8") for w in args.fp8_kv]

    engines, rows = {}, {}
    for w, kv in configs:
        log(f"compiling weight_dtype={w}, kv_dtype={kv}")
        e = engines[(w, kv)] = specgraph.Engine(model, tokenizer=tok, weight_dtype=w, kv_dtype=kv,
                                                max_num_seqs=max(8, args.batch))
        rows[(w, kv)] = dict(compile_s=e.compile_seconds, weight_mb=weight_bytes_per_step(e) / 1e6,
                             plan=e.program.step_plan)

    llamas = {}
    if not args.no_llama_cpp:
        import llama_cpp_runner

        if llama_cpp_runner.available():
            for ftype in LLAMA_FTYPES:
                llamas[ftype] = llama_cpp_runner.for_model("smollm2-135m-instruct", ftype, torch.get_num_threads())
        else:
            log("llama.cpp rows skipped: llama_cpp is not importable (pip install llama-cpp-python)")

    # speed first, while nothing else runs: batch 1, every runner on each prompt in turn (rotating
    # order), then batch N
    log("speed: batch 1")
    runners = {f"specgraph {w}" + (" + fp8 KV" if kv == "fp8" else ""): (lambda b, n, e=e: sg_generate(e, b, n))
               for (w, kv), e in engines.items()}
    runners.update({f"llama.cpp {f.upper()}": l.generate for f, l in llamas.items()})
    names = list(runners)
    for fn in runners.values():
        fn([warm], 8)
    b1 = {name: [] for name in names}
    for k, ids in enumerate(prompt_ids):
        for name in names[k % len(names):] + names[:k % len(names)]:
            b1[name].append(ModeResult(name, 1, [runners[name]([ids], args.new_tokens)]).decode_tok_s)
    log(f"speed: batch {args.batch}")
    batch = (prompt_ids * args.batch)[:args.batch]
    bn = {}
    for (w, kv), e in engines.items():
        sg_generate(e, batch, 8)
        bn[(w, kv)] = ModeResult(str(w), args.batch, [sg_generate(e, batch, args.new_tokens)]).decode_tok_s
    log("speed done; accuracy")

    for (w, kv), e in engines.items() if not args.no_accuracy else ():
        row = rows[(w, kv)]
        for name, ids in eval_ids.items():
            logp, top1 = e.score(ids, chunk_size=16, return_top1=True)
            row[f"ppl_{name}"] = math.exp(-float(logp.mean()))
            row[f"top1_{name}"] = top1
        row["greedy"] = [r.token_ids for r in e.generate(prompt_ids, max_new_tokens=args.new_tokens,
                                                         ignore_eos=True)]
    ref = rows.get(("auto", "auto")) if not args.no_accuracy else None

    lines = [f"CPU: {cpu_description()}", f"threads {torch.get_num_threads()}; perplexity over {args.ppl_tokens} "
             f"tokens per text (chunks of 16); greedy over {len(prompt_ids)} prompts x {args.new_tokens} tokens"]
    headers = ["configuration", "weights MB/step", "ppl prose", "ppl code", "top-1 agree", "greedy agree",
               "b1 tok/s", f"b{args.batch} tok/s", "b1 vs float32"]
    f32_b1 = median(b1.get("specgraph auto", [float("nan")]))
    table = []
    for (w, kv), row in rows.items():
        name = f"specgraph {w}" + (" + fp8 KV" if kv == "fp8" else "")
        agree = "-"
        if ref is not None:
            same = [float((row[f"top1_{t}"] == ref[f"top1_{t}"]).float().mean()) for t in eval_ids]
            agree = f"{sum(same) / len(same):.3f}"
            firsts = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(r))
                      for g, r in zip(row["greedy"], ref["greedy"])]
            greedy = f"{sum(firsts) / len(firsts):.1f}/{args.new_tokens}"
        ppl = [row.get("ppl_prose", float("nan")), row.get("ppl_code", float("nan"))]
        if ref is not None and (w, kv) != ("auto", "auto"):
            ppl = [f"{p:.3f} ({100 * (p / r - 1):+.2f}%)" for p, r in zip(ppl, (ref["ppl_prose"], ref["ppl_code"]))]
        else:
            ppl = [f"{p:.3f}" for p in ppl]
        tps = median(b1[name])
        table.append([name, f"{row['weight_mb']:.0f}", *ppl, agree, greedy if ref is not None else "-",
                      fmt(tps, ".1f"), fmt(bn[(w, kv)], ".1f"), fmt(tps / f32_b1, ".2f") + "x"])
    for f in llamas:
        tps = median(b1[f"llama.cpp {f.upper()}"])
        table.append([f"llama.cpp {f.upper()}", "-", "-", "-", "-", "-", fmt(tps, ".1f"), "-",
                      fmt(tps / f32_b1, ".2f") + "x"])
    lines.append(format_table(headers, table, right=set(range(1, len(headers)))))
    lines += [f"step plan, {w} weights: {row['plan']}" for (w, kv), row in rows.items() if kv == "auto"]
    if llamas and "q8_0" in llamas and ("int8", "auto") in rows:
        q8 = median(b1["llama.cpp Q8_0"])
        lines.append(f"int8 batch 1 vs llama.cpp Q8_0: {median(b1['specgraph int8']) / q8:.2f}x")
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
