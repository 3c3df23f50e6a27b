"""bench_speculative.py's measurements: one timed run of HF ``generate`` (with a counter of its
prompt-lookup forwards) or of a specgraph Engine, their aggregation, and a meter of the CPU time other
processes used meanwhile (a run taken while the machine was busy is suspect), and the cost of verifying
k tokens in one target forward."""
from __future__ import annotations

import os
import time

import torch

from common import cache_kwarg, median


# ========================================================================= CPU meter
class CpuMeter:
    """CPU time used by *other* processes over an interval, in cores (machine busy time from
    ``/proc/stat`` minus this process's own user+system time). On a shared box it tells which
    timings were taken while something else was running; 0 when /proc/stat is unavailable."""

    def __init__(self):
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def snap(self) -> tuple[float, float, float]:
        busy = 0.0
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
            busy = (sum(fields) - fields[3] - fields[4]) / self.hz
        except (OSError, ValueError, IndexError):
            pass
        t = os.times()
        return time.perf_counter(), busy, t.user + t.system

    @staticmethod
    def other_cores(a, b) -> float:
        wall = b[0] - a[0]
        if wall <= 0 or b[1] == 0:
            return 0.0
        return max(0.0, (b[1] - a[1]) - (b[2] - a[2])) / wall

    def wait_quiet(self, busy_cores: float, max_s: float = 60.0, step_s: float = 5.0) -> float:
        """Sleep in ``step_s`` slices until other processes use <= ``busy_cores`` (at most ``max_s``); the last reading."""
        other, waited = 0.0, 0.0
        while waited < max_s:
            a = self.snap()
            time.sleep(step_s)
            waited += step_s
            other = self.other_cores(a, self.snap())
            if other <= busy_cores:
                break
        return other


# ========================================================================= HF runners
class PldCounter:
    """Counts calls (= target forwards) and candidate tokens of HF's prompt-lookup candidate generator."""

    def __init__(self):
        self.calls = 0
        self.drafted = 0
        self.installed = False
        try:
            from transformers.generation import candidate_generator as cg

            cls = cg.PromptLookupCandidateGenerator
        except (ImportError, AttributeError):
            return
        orig = cls.get_candidates
        counter = self

        def get_candidates(gen_self, input_ids, *a, **kw):
            out = orig(gen_self, input_ids, *a, **kw)
            counter.calls += 1
            counter.drafted += int(out[0].shape[1] - input_ids.shape[1])
            return out

        cls.get_candidates = get_candidates
        self.installed = True

    def reset(self):
        self.calls = self.drafted = 0


def hf_run(model, ids: list[int], n: int, temp: float, k: int | None, seed: int, pad: int,
           pld: PldCounter) -> dict:
    x = torch.tensor([ids], dtype=torch.long)
    kw = dict(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, eos_token_id=None,
              pad_token_id=pad, use_cache=True)
    if temp > 0:
        kw.update(do_sample=True, temperature=temp, top_k=0, top_p=1.0)
        torch.manual_seed(seed)
    else:
        kw.update(do_sample=False)
    if k is not None:
        kw.update(prompt_lookup_num_tokens=k)
    pld.reset()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**kw)
    elapsed = time.perf_counter() - t0
    tokens = out[0, x.shape[1]:].tolist()
    if len(tokens) != n:
        raise RuntimeError(f"HF generate made {len(tokens)} tokens, expected {n} (EOS not ignored?)")
    run = dict(elapsed_s=elapsed, tokens=tokens)
    if k is not None:
        if not pld.installed or pld.calls == 0:
            raise RuntimeError("could not count HF prompt-lookup forwards (transformers internals changed?)")
        # every forward emits its accepted candidates + 1 target token
        run.update(draft=pld.drafted, accepted=n - pld.calls, steps=pld.calls, emitted=n, forwards=pld.calls)
    else:
        run.update(forwards=n)
    return run


# ================================================================== specgraph runner
def sg_run(engine, ids: list[int], n: int, temp: float, k: int | None, seed: int, tree: str | None = None) -> dict:
    """One timed generate; ``k``: chains of k drafts; ``tree``: "default" (the engine's tree at build) or None."""
    if k is not None:
        engine.num_draft_tokens = k
    if engine.proposer is not None and engine.program.max_tree_nodes:
        engine.draft_tree = engine.default_tree if tree == "default" else None
    engine.reset_stats()
    t0 = time.perf_counter()
    res = engine.generate([ids], max_new_tokens=n, temperature=temp, seed=seed, ignore_eos=True)
    elapsed = time.perf_counter() - t0
    tokens = list(res[0].token_ids)
    if len(tokens) != n:
        raise RuntimeError(f"specgraph generate made {len(tokens)} tokens, expected {n}")
    s = engine.stats
    run = dict(elapsed_s=elapsed, tokens=tokens, forwards=s["target_forwards"], forward_s=s["forward_s"])
    if k is not None or tree is not None:
        if k is not None and s.get("num_draft_tokens") != k:
            raise RuntimeError(f"engine ran with num_draft_tokens={s.get('num_draft_tokens')}, expected {k}")
        run.update(draft=s["draft_tokens"], accepted=s["accepted_tokens"], steps=s["verify_steps"],
                   emitted=s["verify_emitted"], cached_prompt_tokens=s["cached_prompt_tokens"],
                   draft_s=s["draft_s"], decode_forwards=s["decode_forwards"], decode_emitted=s["decode_emitted"])
    return run


# ======================================================================== aggregation
def aggregate(runs: list[dict]) -> dict:
    toks = sum(len(r["tokens"]) for r in runs)
    secs = sum(r["elapsed_s"] for r in runs)
    out = dict(new_tokens=toks, elapsed_s=secs, tok_s=toks / secs if secs > 0 else float("nan"))
    if runs and "draft" in runs[0]:
        d, a = sum(r["draft"] for r in runs), sum(r["accepted"] for r in runs)
        st, em = sum(r["steps"] for r in runs), sum(r["emitted"] for r in runs)
        out.update(draft_tokens=d, accepted_tokens=a, verify_steps=st,
                   acceptance_rate=a / d if d else 0.0, mean_accepted_tokens=em / st if st else float("nan"))
    return out


# ================================================================ verification curve
@torch.no_grad()
def verify_curve(model, engine, vocab: int, ks: list[int], reps: int, context: int) -> dict:
    """Best-of-``reps`` ms of one target forward over k new tokens at ``context``, specgraph's and HF
    eager's side by side."""
    from transformers import DynamicCache

    from specgraph.compiler.program import AttentionMetadata

    L = context
    gen = torch.Generator().manual_seed(1234)
    ctx = torch.randint(100, vocab - 100, (L,), generator=gen)
    inputs = {k: torch.randint(100, vocab - 100, (k,), generator=gen) for k in ks}

    # specgraph: one sequence holding L + max(k) slots; the k tokens overwrite positions L..L+k-1
    sid = 10**9
    engine.kv.add_sequence(sid, [])
    if engine.kv.allocate(sid, L + max(ks)) is None:
        raise RuntimeError(f"KV pool too small for {L + max(ks)} tokens")
    table = engine.kv.block_table(sid)
    ps = engine.page_size
    engine.program(ctx, AttentionMetadata.build([(table, 0, L)], ps, [[L - 1]]), engine.kv_cache)
    metas = {k: AttentionMetadata.build([(table, L, k)], ps, [list(range(k))]) for k in ks}

    # HF eager: DynamicCache prefilled once, cropped back to L after every forward
    kw = cache_kwarg(model)
    cache = DynamicCache(config=model.config)
    model(input_ids=ctx.view(1, L), use_cache=True, **{kw: cache})

    def sg(k):
        t0 = time.perf_counter()
        logits = engine.program(inputs[k], metas[k], engine.kv_cache)
        dt = time.perf_counter() - t0
        assert logits.shape[0] == k
        return dt

    def hf(k):
        t0 = time.perf_counter()
        out = model(input_ids=inputs[k].view(1, k), use_cache=True, **{kw: cache})
        dt = time.perf_counter() - t0
        assert out.logits.shape[1] == k
        cache.crop(-k)
        return dt

    times = {m: {k: [] for k in ks} for m in ("specgraph", "hf-eager")}
    warm = 2
    try:
        for rep in range(warm + reps):
            shift = rep % len(ks)
            order = ks[shift:] + ks[:shift]
            for i, k in enumerate(order):
                pair = [("specgraph", sg), ("hf-eager", hf)]
                if (rep + i) % 2:
                    pair.reverse()
                for name, fn in pair:
                    dt = fn(k)
                    if rep >= warm:
                        times[name][k].append(dt)
            if rep == warm - 1 and cache.get_seq_length() != L:
                raise RuntimeError(f"HF cache length {cache.get_seq_length()} after crop, expected {L}")
    finally:
        engine.kv.free(sid)
    out = {}
    for name, per in times.items():
        best = {k: min(v) * 1e3 for k, v in per.items()}
        out[name] = dict(best_ms={k: best[k] for k in ks}, median_ms={k: median(v) * 1e3 for k, v in per.items()},
                         ratio={k: best[k] / best[ks[0]] for k in ks})
    return out
