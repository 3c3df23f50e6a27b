"""bench_decode.py's context and prefix sections: one forward's decode cost at growing context
(specgraph and HF eager side by side), and the time to first token with a cached shared prefix."""
from __future__ import annotations

import inspect
import time

import torch

from common import cache_kwarg, log, median
from decode_runs import flush_prefix_cache, sg_generate
from prompts import PREFIX_QUESTIONS, SHARED_DOCUMENT


def run_context(args, model, engine, vocab: int) -> dict:
    """ms per decode step at two context lengths; the (mode, context) streams step round-robin."""
    from specgraph.compiler.program import AttentionMetadata

    gen = torch.Generator().manual_seed(1234)
    streams = []
    kw = cache_kwarg(model)
    fwd_params = inspect.signature(model.forward).parameters
    for L in args.contexts:
        ctx = torch.randint(100, vocab - 100, (L,), generator=gen)
        if "specgraph" in args.modes:
            sid = 10**9 + L
            engine.kv.add_sequence(sid, [])
            if engine.kv.allocate(sid, L) is None:
                raise RuntimeError(f"KV pool too small for a {L}-token context")
            meta = AttentionMetadata.build([(engine.kv.block_table(sid), 0, L)], engine.page_size, [[L - 1]])
            t0 = time.perf_counter()
            logits = engine.program(ctx, meta, engine.kv_cache)
            streams.append(dict(mode="specgraph", ctx=L, sid=sid, pos=L, tok=int(logits[-1].argmax()),
                                prefill_s=time.perf_counter() - t0, times=[], tokens=[]))
        if "hf-eager" in args.modes:
            from transformers import DynamicCache

            cache = DynamicCache(config=model.config)
            extra = {"logits_to_keep": 1} if "logits_to_keep" in fwd_params else {}
            t0 = time.perf_counter()
            out = model(input_ids=ctx.view(1, L), use_cache=True, **{kw: cache}, **extra)
            streams.append(dict(mode="hf-eager", ctx=L, cache=cache, tok=int(out.logits[0, -1].argmax()),
                                prefill_s=time.perf_counter() - t0, times=[], tokens=[]))
        log(f"context {L}: prefilled " + ", ".join(f"{s['mode']} {s['prefill_s']:.1f} s" for s in streams
                                                   if s["ctx"] == L))

    def step(s):
        t0 = time.perf_counter()
        if s["mode"] == "specgraph":
            copies = engine.kv.allocate(s["sid"], 1)
            if copies:
                raise RuntimeError("unexpected copy-on-write in the context test")
            meta = AttentionMetadata.build([(engine.kv.block_table(s["sid"]), s["pos"], 1)], engine.page_size, [[0]])
            logits = engine.program(torch.tensor([s["tok"]], dtype=torch.long), meta, engine.kv_cache)
            nxt = int(logits[0].argmax())
            s["pos"] += 1
        else:
            out = model(input_ids=torch.tensor([[s["tok"]]], dtype=torch.long), use_cache=True, **{kw: s["cache"]})
            nxt = int(out.logits[0, -1].argmax())
        dt = time.perf_counter() - t0
        s["tokens"].append(nxt)
        s["tok"] = nxt
        return dt

    warm = 2
    try:
        for i in range(warm + args.context_steps):
            order = streams[i % len(streams):] + streams[:i % len(streams)]
            for s in order:
                dt = step(s)
                if i >= warm:
                    s["times"].append(dt)
    finally:
        for s in streams:
            if s["mode"] == "specgraph":
                engine.kv.free(s["sid"])
    out = {}
    for s in streams:
        out.setdefault(s["mode"], {})[s["ctx"]] = dict(ms_per_token=median(s["times"]) * 1e3,
                                                      prefill_s=s["prefill_s"], tokens=s["tokens"])
    log("context test done")
    return out


def _prefix_ids(tok, n_prefix: int, salt: int) -> list[int]:
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    head = enc("<|im_start|>system\n")
    tail = enc("<|im_end|>\n<|im_start|>user\n")
    doc = enc(f"Copy {salt + 1} of the handbook.\n" + SHARED_DOCUMENT)
    k = n_prefix - len(head) - len(tail)
    if k < 1 or k > len(doc):
        raise ValueError(f"--prefix-tokens {n_prefix} not in [{len(head) + len(tail) + 1}, "
                         f"{len(head) + len(tail) + len(doc)}] for the stored document")
    return head + doc[:k] + tail


def run_prefix(args, tok, engine) -> dict:
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    questions = [enc(q + "<|im_end|>\n<|im_start|>assistant\n") for q in PREFIX_QUESTIONS]
    pc = engine.kv.prefix_cache
    q0, h0 = (pc.queried_tokens, pc.hit_tokens) if pc is not None else (0, 0)
    cold, warm, cached, prompt_len = [], [], [], 0
    flush_prefix_cache(engine)
    for t in range(args.prefix_trials):
        prefix = _prefix_ids(tok, args.prefix_tokens, salt=t)  # fresh prefix per trial: the first request is cold
        qa, qb = questions[(2 * t) % len(questions)], questions[(2 * t + 1) % len(questions)]
        r_cold = sg_generate(engine, [prefix + qa], 1, cold=False)
        r_warm = sg_generate(engine, [prefix + qb], 1, cold=False)
        cold.append(r_cold.first_token_s[0])
        warm.append(r_warm.first_token_s[0])
        cached.append((r_cold.cached_tokens[0], r_warm.cached_tokens[0]))
        prompt_len = len(prefix + qb)
        log(f"prefix trial {t}: cold {cold[-1] * 1e3:.0f} ms, warm {warm[-1] * 1e3:.0f} ms, cached {cached[-1]}")
    q1, h1 = (pc.queried_tokens, pc.hit_tokens) if pc is not None else (0, 0)
    return dict(cold_ttft_ms=median(cold) * 1e3, warm_ttft_ms=median(warm) * 1e3,
                speedup=median(cold) / median(warm), cached_tokens_cold_warm=cached, warm_prompt_tokens=prompt_len,
                test_hit_rate=(h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
                engine_prefix_cache_hit_rate=engine.stats["prefix_cache_hit_rate"],
                cold_ttft_ms_all=[c * 1e3 for c in cold], warm_ttft_ms_all=[w * 1e3 for w in warm])
