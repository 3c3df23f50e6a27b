"""Decode benchmark: specgraph's Engine against Hugging Face generate on the same weights.

    python benchmarks/bench_decode.py                 # full run (10+ minutes on 2 CPU cores)
    python benchmarks/bench_decode.py --quick         # smoke test: 2 prompts, 16 new tokens
    python benchmarks/bench_decode.py --hf-compile    # also HF static cache + torch.compile (~2 min compile)
    specgraph bench --quick                           # same script through the CLI

Everything is measured in one process, one run, and printed as one table plus labelled lines:

1. Throughput, greedy, ``--new-tokens`` tokens per sequence (EOS ignored everywhere), for
   ``hf-eager`` (HF dynamic cache), ``hf-static-compile`` (HF static cache + torch.compile,
   with ``--hf-compile``), ``no-cache`` (full recompute every token, 1 prompt), ``specgraph``
   (the Engine, generated code: ``lowering="inductor"``), ``specgraph-eager`` (the Engine running
   the graph op by op) and ``llama-cpp-f32`` (llama.cpp on an F32 GGUF that llama.cpp's own
   quantizer made from the shipped file: the same weights; batch 1; only when ``llama_cpp``
   imports, see ``llama_cpp_runner.py``). Batch 1 runs every prompt alone, the modes interleaved per prompt (the order
   rotates) so load swings on a shared machine hit all of them; batch ``--batch`` runs the
   prompts cycled to the batch size in one call (HF: left padding + attention mask).
2. Whether specgraph's greedy tokens equal HF eager's for every prompt.
3. Decode ms/token at a short and a long context (``--contexts``), specgraph's DecoderProgram
   against HF with a DynamicCache, the four (mode, context) streams stepped round-robin.
4. Prefix caching: time to first token of a request with a ``--prefix-tokens`` shared prefix,
   cold and then warm (same prefix, different question).
5. Read memory bandwidth and the batch-1 decode ceiling it implies (bandwidth / weight bytes).

Definitions: decode tok/s = (new tokens - 1 per sequence) / (call time - mean time to first
token), summed over calls: the first token comes out of the prefill, so it is not counted as a
decode token. End-to-end tok/s = new tokens / call time. TTFT = mean over sequences of the time
from the call to its first new token. Peak RSS = highest VmRSS sampled (5 ms) during the mode's
timed calls minus VmRSS when each call started (the largest such delta over its calls). Free heap
memory is returned to the OS (glibc malloc_trim) before each baseline, so a mode reusing memory an
earlier run freed still shows its working set; memory allocated before a mode (model weights,
specgraph's preallocated KV pool) is not in it.

Before every timed specgraph call the Engine's prefix cache is emptied, so throughput rows
compare cold prefills (the shared chat-template system prompt and the repeated prompts of the
batch would otherwise hit blocks cached by earlier calls); section 4 measures the cache itself.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # prompts.py, common.py

import torch  # noqa: E402
import transformers  # noqa: E402

from common import (ModeResult, RssSampler, chat_prompt_ids, cpu_description, fmt, format_table,  # noqa: E402
                    load_average, log, measure_read_bandwidth, print_report, quiet_torch, weight_bytes_per_token)
from decode_runs import compare_tokens, dynamo_graphs, hf_generate, nocache_generate, sg_generate  # noqa: E402
from decode_sections import run_context, run_prefix  # noqa: E402
from prompts import PROMPTS, WARMUP_PROMPT  # noqa: E402

ALL_MODES = ("hf-eager", "hf-static-compile", "no-cache", "specgraph", "specgraph-eager", "llama-cpp-f32")
SPECGRAPH_MODES = {"specgraph": "inductor", "specgraph-eager": "eager"}  # mode -> Engine lowering
ALL_SECTIONS = ("throughput", "context", "prefix", "bandwidth")


# ============================================================================ arguments
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="specgraph.load_model name or path")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens per sequence (default 128; --quick 16)")
    p.add_argument("--batch", type=int, default=8, help="batch size of the batched runs (prompts cycled); 0: skip")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 2 prompts, 16 new tokens, fewer steps/trials, no hf-static-compile")
    p.add_argument("--modes", default=",".join(ALL_MODES),
                   help=f"comma-separated subset of {','.join(ALL_MODES)} (hf-static-compile also needs --hf-compile)")
    p.add_argument("--hf-compile", action="store_true",
                   help="run hf-static-compile (first compile ~2 min on 2 cores; batch 1 only)")
    p.add_argument("--sections", default=",".join(ALL_SECTIONS),
                   help=f"comma-separated subset of {','.join(ALL_SECTIONS)}")
    p.add_argument("--nocache-tokens", type=int, default=None, help="tokens of the no-cache loop (default 32; --quick 8)")
    p.add_argument("--contexts", default="64,1024", help="two context lengths for the per-token decode test")
    p.add_argument("--context-steps", type=int, default=None, help="timed decode steps per context (default 20; --quick 5)")
    p.add_argument("--prefix-tokens", type=int, default=512, help="shared prefix length of the prefix-caching test")
    p.add_argument("--prefix-trials", type=int, default=None,
                   help="cold/warm pairs, each with a fresh prefix (default 3; --quick 1); medians reported")
    p.add_argument("--repeats", type=int, default=1, help="repeat the throughput runs (all interleaved)")
    p.add_argument("--bw-gib", type=float, default=1.0, help="GiB read by the bandwidth test")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--json", default=None, metavar="PATH", help="also save the results as JSON")
    a = p.parse_args(argv)

    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = set(a.modes) - set(ALL_MODES)
    if bad:
        p.error(f"unknown modes {sorted(bad)}; choose from {', '.join(ALL_MODES)}")
    a.sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    bad = set(a.sections) - set(ALL_SECTIONS)
    if bad:
        p.error(f"unknown sections {sorted(bad)}; choose from {', '.join(ALL_SECTIONS)}")
    a.contexts = [int(x) for x in a.contexts.split(",")]
    if len(a.contexts) != 2:
        p.error("--contexts takes exactly two lengths, e.g. 64,1024")
    # --quick picks small defaults; explicit values still win.
    a.new_tokens = a.new_tokens or (16 if a.quick else 128)
    a.nocache_tokens = a.nocache_tokens or (8 if a.quick else 32)
    a.context_steps = a.context_steps or (5 if a.quick else 20)
    a.prefix_trials = a.prefix_trials or (1 if a.quick else 3)
    a.prompts = [PROMPTS[0], PROMPTS[3]] if a.quick else list(PROMPTS)  # quick: one code, one chat
    if "hf-static-compile" in a.modes and not a.hf_compile:  # opt-in (so --quick never runs it by default)
        a.modes.remove("hf-static-compile")
    if a.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (decode rate needs tokens after the first)")
    return a


# ========================================================================= sections
def run_throughput(args, model, tok, engines, hf_compiled, llama, prompt_ids, warm_ids, mem) -> dict:
    n, modes = args.new_tokens, args.modes
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    b1_modes = [m for m in ("hf-eager", "hf-static-compile", "specgraph", "specgraph-eager", "llama-cpp-f32")
                if m in modes]
    runners = {
        "hf-eager": lambda batch, k: hf_generate(model, batch, k, pad),
        "hf-static-compile": lambda batch, k: hf_generate(hf_compiled, batch, k, pad),
        "llama-cpp-f32": lambda batch, k: llama.generate(batch, k),
    }
    for m, engine in engines.items():
        runners[m] = lambda batch, k, engine=engine: sg_generate(engine, batch, k)
    results: dict[tuple[str, int], ModeResult] = {}
    tokens: dict[tuple[str, int], dict[int, list[int]]] = {}

    # warm-up: one short generate per mode (and one at the batch size for the batched modes)
    batched = [m for m in ("hf-eager", "specgraph", "specgraph-eager") if m in modes] if args.batch > 1 else []
    for m in b1_modes:
        if m != "hf-static-compile":  # already warmed (and compiled) when it was built
            log(f"warm-up {m}")
            runners[m]([warm_ids], 4)
    for m in batched:
        log(f"warm-up {m} batch {args.batch}")
        runners[m]([warm_ids] * args.batch, 2)

    graphs_before = dynamo_graphs()
    # batch 1: each prompt alone, the modes interleaved per prompt with a rotating order
    k = 0
    for rep in range(args.repeats):
        for i, ids in enumerate(prompt_ids):
            order = b1_modes[k % len(b1_modes):] + b1_modes[:k % len(b1_modes)] if b1_modes else []
            k += 1
            for m in order:
                log(f"batch 1 {m} prompt {i} ({len(ids)} prompt tokens) rep {rep}")
                with mem.track(f"{m}/1"):
                    run = runners[m]([ids], n)
                results.setdefault((m, 1), ModeResult(m, 1)).runs.append(run)
                tokens.setdefault((m, 1), {}).setdefault(i, run.tokens[0])
                log(f"  {run.new_tokens} tokens in {run.elapsed_s:.1f} s (TTFT {run.first_token_s[0] * 1e3:.0f} ms)")

    # batch B: the prompts cycled to B sequences, one call per mode, order alternating per repeat
    if args.batch > 1:
        idx = [j % len(prompt_ids) for j in range(args.batch)]
        batch = [prompt_ids[j] for j in idx]
        for rep in range(args.repeats):
            for m in (batched if rep % 2 == 0 else batched[::-1]):
                log(f"batch {args.batch} {m} rep {rep}")
                with mem.track(f"{m}/{args.batch}"):
                    run = runners[m](batch, n)
                results.setdefault((m, args.batch), ModeResult(m, args.batch)).runs.append(run)
                got = tokens.setdefault((m, args.batch), {})
                for j, t in zip(idx, run.tokens):
                    got.setdefault(j, t)
                log(f"  {run.new_tokens} tokens in {run.elapsed_s:.1f} s")

    # no-cache: expensive, one prompt and a few tokens
    if "no-cache" in modes:
        log("warm-up no-cache")
        nocache_generate(model, warm_ids, 1)
        log(f"no-cache prompt 0, {args.nocache_tokens} tokens")
        with mem.track("no-cache/1"):
            run = nocache_generate(model, prompt_ids[0], args.nocache_tokens)
        results[("no-cache", 1)] = ModeResult("no-cache", 1, [run])
        tokens[("no-cache", 1)] = {0: run.tokens[0]}
        log(f"  {run.new_tokens} tokens in {run.elapsed_s:.1f} s")

    for (m, b), r in results.items():
        r.peak_rss_mib = mem.mib(f"{m}/{b}")
    graphs_compiled = dynamo_graphs() - graphs_before  # only torch.compile'd HF can add any

    checks = []
    ref = tokens.get(("hf-eager", 1))
    if ref:
        for key, label in [(("specgraph", 1), "specgraph batch 1 vs hf-eager batch 1"),
                           (("specgraph", args.batch), f"specgraph batch {args.batch} vs hf-eager batch 1"),
                           (("specgraph-eager", 1), "specgraph-eager batch 1 vs hf-eager batch 1"),
                           (("llama-cpp-f32", 1), "llama-cpp-f32 batch 1 vs hf-eager batch 1"),
                           (("hf-eager", args.batch), f"hf-eager batch {args.batch} vs hf-eager batch 1"),
                           (("hf-static-compile", 1), "hf-static-compile batch 1 vs hf-eager batch 1")]:
            if key in tokens and key != ("hf-eager", 1):
                checks.append(compare_tokens(label, tokens[key], ref))
        if ("no-cache", 1) in tokens:
            k0 = len(tokens[("no-cache", 1)][0])
            checks.append(compare_tokens(f"no-cache vs hf-eager batch 1 (first {k0} tokens of prompt 0)",
                                         tokens[("no-cache", 1)], {0: ref[0][:k0]}))
    elif ("specgraph", 1) in tokens and ("specgraph", args.batch) in tokens:
        checks.append(compare_tokens(f"specgraph batch {args.batch} vs specgraph batch 1",
                                     tokens[("specgraph", args.batch)], tokens[("specgraph", 1)]))
    cached = [c for r in results.get(("specgraph", 1), ModeResult("", 1)).runs for c in getattr(r, "cached_tokens", [])]
    return dict(results=results, checks=checks, specgraph_cached_tokens=sum(cached),
                graphs_compiled_during_timed_runs=graphs_compiled)


@torch.no_grad()
# ============================================================================== main
def main(argv=None) -> int:
    args = parse_args(argv)
    quiet_torch(args.threads)
    import specgraph

    report: dict = dict(config={k: v for k, v in vars(args).items() if k != "prompts"},
                        env=dict(torch=torch.__version__, transformers=transformers.__version__,
                                 python=platform.python_version(), cpu=platform.processor() or platform.machine(),
                                 threads=torch.get_num_threads(), load_average_start=load_average()))
    log(f"threads {torch.get_num_threads()}, modes {args.modes}, sections {args.sections}, "
        f"{len(args.prompts)} prompts x {args.new_tokens} tokens")
    mem = RssSampler().start()

    bw = []
    if "bandwidth" in args.sections:
        log(f"bandwidth ({args.bw_gib:g} GiB)")
        bw.append(measure_read_bandwidth(args.bw_gib))

    log(f"loading {args.model}")
    model, tok = specgraph.load_model(args.model)
    model.eval()
    vocab = model.config.vocab_size
    weights = weight_bytes_per_token(model)
    prompt_ids = [chat_prompt_ids(tok, text) for _, text in args.prompts]
    warm_ids = chat_prompt_ids(tok, WARMUP_PROMPT)

    engines = {}
    for mode, lowering in SPECGRAPH_MODES.items():
        wanted = "throughput" in args.sections or (mode == "specgraph" and set(args.sections) & {"context", "prefix"})
        if mode in args.modes and wanted:
            log(f"compiling the specgraph Engine ({mode}: lowering={lowering!r})")
            e = engines[mode] = specgraph.Engine(model, tokenizer=tok, page_size=args.page_size, prefix_caching=True,
                                                 max_num_seqs=max(8, args.batch), lowering=lowering)
            log(f"  compiled in {e.compile_seconds:.1f} s")
            report[mode] = dict(compile_s=e.compile_seconds, lowering=lowering, step_plan=e.program.step_plan,
                                num_blocks=e.num_blocks,
                                kv_bytes_per_token=e.stats["kv_bytes_per_token"],
                                kv_pool_bytes=sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                                                  for k, v in e.kv_cache))
    engine = engines.get("specgraph")

    llama = None
    if "llama-cpp-f32" in args.modes and "throughput" in args.sections:
        import llama_cpp_runner

        if llama_cpp_runner.available():
            log("llama.cpp: converting the shipped GGUF to F32 with llama.cpp's own quantizer (cached)")
            llama = llama_cpp_runner.for_model(args.model, "f32", torch.get_num_threads())
            report["llama_cpp"] = dict(version=llama.version, gguf=str(llama.path))
        else:
            args.modes.remove("llama-cpp-f32")
            report["llama_cpp"] = dict(skipped="llama_cpp is not importable (pip install llama-cpp-python)")

    hf_compiled = None
    if "hf-static-compile" in args.modes and "throughput" in args.sections:
        log("hf-static-compile: loading a second copy of the model and compiling (static cache)")
        hf_compiled, _ = specgraph.load_model(args.model)
        hf_compiled.eval()
        hf_compiled.generation_config.cache_implementation = "static"
        hf_compiled.generation_config.max_cache_len = max(map(len, prompt_ids + [warm_ids])) + args.new_tokens
        hf_compiled.forward = torch.compile(hf_compiled.forward)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        longest, shortest = max(prompt_ids, key=len), min(prompt_ids + [warm_ids], key=len)
        t0 = time.perf_counter()
        hf_generate(hf_compiled, [longest], 4, pad)  # compiles prefill (static shape) and decode
        t1 = time.perf_counter()
        hf_generate(hf_compiled, [shortest], 4, pad)  # a second prompt length: the dynamic-shape recompile
        t2 = time.perf_counter()
        third = longest[:len(longest) - 3]  # yet another length: should not compile any more
        hf_generate(hf_compiled, [third], 4, pad)
        t3 = time.perf_counter()
        report["hf_static_compile"] = dict(first_call_s=t1 - t0, second_call_s=t2 - t1, third_call_s=t3 - t2)
        log(f"  compile: first call {t1 - t0:.1f} s, second {t2 - t1:.1f} s, third {t3 - t2:.1f} s")

    tp = None
    if "throughput" in args.sections:
        tp = run_throughput(args, model, tok, engines, hf_compiled, llama, prompt_ids, warm_ids, mem)
    ctx = None
    if "context" in args.sections and {"specgraph", "hf-eager"} & set(args.modes):
        ctx = run_context(args, model, engine, vocab)
    pre = None
    if "prefix" in args.sections and engine is not None:
        pre = run_prefix(args, tok, engine)
    if "bandwidth" in args.sections:
        log("bandwidth again")
        bw.append(measure_read_bandwidth(args.bw_gib))
    mem.stop()
    report["env"]["load_average_end"] = load_average()

    # ------------------------------------------------------------------ report
    out = []
    out.append("== specgraph decode benchmark ==")
    nparams = sum(p.numel() for p in model.parameters())
    out.append(f"model: {args.model} ({nparams / 1e6:.1f}M params, {weights / 1e6:.1f} MB "
               f"{str(next(model.parameters()).dtype).replace('torch.', '')})")
    out.append(f"cpu: {cpu_description()}")
    out.append(f"threads: {torch.get_num_threads()} (torch {torch.__version__}, transformers {transformers.__version__}); "
               f"load average start {report['env']['load_average_start']}, end {report['env']['load_average_end']}")
    kinds = [k for k, _ in args.prompts]
    out.append(f"prompts: {len(args.prompts)} ({kinds.count('code')} code, {kinds.count('chat')} chat; "
               f"{min(map(len, prompt_ids))}-{max(map(len, prompt_ids))} tokens), greedy, {args.new_tokens} new tokens, "
               f"EOS ignored, repeats {args.repeats}")
    for mode in engines:
        s = report[mode]
        out.append(f"{mode} Engine (lowering={s['lowering']!r}) compile: {s['compile_s']:.1f} s; KV pool "
                   f"{s['kv_pool_bytes'] / 2**20:.0f} MiB preallocated ({s['kv_bytes_per_token']} B/token, "
                   f"page {args.page_size}), not in peak RSS; {s['step_plan']}")
    if "llama_cpp" in report:
        lc = report["llama_cpp"]
        out.append(f"llama.cpp: {lc.get('skipped') or 'llama-cpp-python ' + lc['version'] + ', ' + lc['gguf']}")
    if "hf_static_compile" in report:
        h = report["hf_static_compile"]
        line = (f"hf-static-compile compile: first call {h['first_call_s']:.1f} s (+ {h['second_call_s']:.1f} s "
                f"for a second prompt length; a third length took {h['third_call_s']:.1f} s)")
        if tp is not None:
            line += f"; graphs compiled during timed runs: {tp['graphs_compiled_during_timed_runs']} (expect 0)"
            report["hf_static_compile"]["graphs_compiled_during_timed_runs"] = tp["graphs_compiled_during_timed_runs"]
        out.append(line)

    if tp is not None:
        res = tp["results"]
        rows, jrows = [], []
        order = sorted(res.values(), key=lambda r: (r.batch, ALL_MODES.index(r.mode)))
        for r in order:
            base = res.get(("hf-eager", r.batch))
            ratio_d = r.decode_tok_s / base.decode_tok_s if base else None
            ratio_e = r.e2e_tok_s / base.e2e_tok_s if base else None
            rows.append([r.mode, str(r.batch), r.shape(), fmt(r.decode_tok_s), fmt(r.e2e_tok_s),
                         fmt(r.ttft_s * 1e3, ".0f"), fmt(r.peak_rss_mib, ".0f"),
                         fmt(ratio_d, ".2f") + ("x" if ratio_d else ""), fmt(ratio_e, ".2f") + ("x" if ratio_e else "")])
            jrows.append(dict(mode=r.mode, batch=r.batch, sequences=sum(x.num_seqs for x in r.runs),
                              new_tokens=r.new_tokens, elapsed_s=r.elapsed_s, decode_tok_s=r.decode_tok_s,
                              e2e_tok_s=r.e2e_tok_s, ttft_ms=r.ttft_s * 1e3, peak_rss_mib=r.peak_rss_mib,
                              vs_hf_eager_decode=ratio_d, vs_hf_eager_e2e=ratio_e,
                              runs=[dict(elapsed_s=x.elapsed_s, first_token_s=x.first_token_s, tokens=x.tokens)
                                    for x in r.runs]))
        out.append("")
        out.append(format_table(["mode", "batch", "seqs x tok", "decode tok/s", "e2e tok/s", "TTFT ms",
                                 "peak RSS MiB", "decode vs hf", "e2e vs hf"], rows, right=set(range(1, 9))))
        out.append("  decode tok/s = (new tokens - 1 per sequence) / (time - TTFT); batch 1 sums over prompts; "
                   "ratios are against hf-eager at the same batch")
        if ("no-cache", 1) in res:
            out.append(f"  no-cache: prompt 0 only, {args.nocache_tokens} tokens (full recompute every token)")
        for r in order:
            fractions = [x.host_fraction for x in r.runs if hasattr(x, "host_fraction")]
            if fractions:
                out.append(f"  {r.mode} batch {r.batch}: host overhead (scheduling, metadata, sampling; outside the "
                           f"forward) {100 * sum(fractions) / len(fractions):.1f}% of step time")
        llama_row = res.get(("llama-cpp-f32", 1))
        if llama_row is not None and ("specgraph", 1) in res:
            out.append(f"  specgraph batch-1 decode vs llama-cpp-f32: "
                       f"{res[('specgraph', 1)].decode_tok_s / llama_row.decode_tok_s:.2f}x")
        out.append("")
        for c in tp["checks"]:
            out.append("greedy tokens, " + c["line"])
        report["throughput"] = jrows
        report["token_checks"] = [{k: v for k, v in c.items() if k != "line"} for c in tp["checks"]]

    if ctx is not None:
        out.append("")
        a, b = args.contexts
        for mode, per in ctx.items():
            if a in per and b in per:
                out.append(f"decode ms/token, {mode}: context {a}: {per[a]['ms_per_token']:.1f} ms, "
                           f"context {b}: {per[b]['ms_per_token']:.1f} ms, ratio {b}/{a}: "
                           f"{per[b]['ms_per_token'] / per[a]['ms_per_token']:.2f} "
                           f"(median of {args.context_steps} steps; prefill {per[a]['prefill_s']:.1f} s / "
                           f"{per[b]['prefill_s']:.1f} s)")
        if "specgraph" in ctx and "hf-eager" in ctx:
            same = [ctx["specgraph"][L]["tokens"] == ctx["hf-eager"][L]["tokens"] for L in args.contexts]
            out.append("  context-test greedy tokens specgraph == hf-eager: "
                       + ", ".join(f"context {L}: {'yes' if s else 'no'}" for L, s in zip(args.contexts, same)))
        report["context"] = {m: {str(L): v for L, v in per.items()} for m, per in ctx.items()}

    if pre is not None:
        out.append("")
        out.append(f"prefix caching ({args.prefix_tokens}-token shared prefix, {pre['warm_prompt_tokens']}-token prompt, "
                   f"median of {args.prefix_trials}): TTFT cold {pre['cold_ttft_ms']:.0f} ms, warm "
                   f"{pre['warm_ttft_ms']:.0f} ms, speed-up {pre['speedup']:.2f}x")
        cw = pre["cached_tokens_cold_warm"][-1]
        out.append(f"  cached prompt tokens cold/warm: {cw[0]}/{cw[1]}; hit rate over this test's requests "
                   f"{pre['test_hit_rate']:.3f}; engine.stats['prefix_cache_hit_rate'] "
                   f"{pre['engine_prefix_cache_hit_rate']:.3f} (cumulative since the Engine was built)")
        report["prefix"] = pre

    if bw:
        best = max(bw)
        ceiling = best / weights
        out.append("")
        out.append(f"read bandwidth: {best / 1e9:.1f} GB/s (torch.sum over {args.bw_gib:g} GiB float32, best of 5; "
                   f"start {bw[0] / 1e9:.1f}, end {bw[-1] / 1e9:.1f} GB/s)")
        out.append(f"batch-1 decode ceiling: {ceiling:.1f} tok/s ({weights / 1e6:.1f} MB of weights read per token, "
                   f"tied embedding counted once as the LM head)")
        report["bandwidth"] = dict(bytes_per_s=bw, best_bytes_per_s=best, weight_bytes_per_token=weights,
                                   ceiling_tok_s=ceiling)
        if tp is not None:
            for m in ("specgraph", "specgraph-eager", "llama-cpp-f32", "hf-eager", "hf-static-compile"):
                r = tp["results"].get((m, 1))
                if r is not None:
                    out.append(f"  {m} batch-1 decode: {r.decode_tok_s:.2f} tok/s = "
                               f"{100 * r.decode_tok_s / ceiling:.1f}% of the ceiling")
                    report["bandwidth"][f"{m}_fraction_of_ceiling"] = r.decode_tok_s / ceiling

    print_report(out, report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
