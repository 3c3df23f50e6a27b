"""One command for a CUDA machine (about 12 minutes): GPU tests, kernels, the engine end to end, bandwidth.

    python benchmarks/gpu_check.py [--skip-smollm2] [--model NAME_OR_GGUF] [--peak-gbps 4800]
                                   [--sections tests,kernels,engine,bandwidth]

Prepared on a machine without a GPU (specgraph's CI cannot run it); run it as is on any CUDA
machine. Prints a report, and exits non-zero if a correctness check fails.

0. **The GPU tests** (``tests/test_cuda_graphs.py``: CUDA-graph replay against launching the
   kernels one by one and against the eager lowering; CI, without a GPU, skips them).
1. **Kernels on CUDA vs their torch references** (registry: the ``"triton"`` implementations):
   cache writes (float32/bf16/fp16, fp8, int4) and paged attention over random ragged batches
   (decodes, a verify, a prefill chunk; GQA; page sizes 8/16/32).
2. **Engine on CUDA, generated code** (``lowering="inductor"``: Inductor's Triton for the dense
   graph, specgraph's Triton kernels as extern calls, static bucket graphs): a tiny random Llama and
   SmolLM2-135M, greedy tokens against Hugging Face on the same GPU; decode tok/s at batch 1 and 8
   for specgraph with and without CUDA graphs and HF eager; ``engine.stats["recompiles"]`` after
   warm-up (expect 0); speculation (ngram, fixed k) and an fp8 hot/cold cache on the GPU: greedy
   tokens identical to plain decoding.
3. **Paged attention's achieved bandwidth**: a decode step of 64 sequences x 4096 keys (SmolLM2's
   heads), bytes of K/V read per second against ``--peak-gbps`` (H100 SXM ~3350, H200 ~4800,
   A100 80GB ~2039).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

FAILURES: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILURES.append(name)


def _batch(seqs, page, kv_heads, group, head_dim, dtype, device, num_blocks=None):
    """Random ragged stream: ``seqs`` = [(context_len, new_tokens)]; each sequence's blocks are
    scattered over the pool; returns (q, k_new, v_new, block_tables, seq_lens, qsl, positions, slots)."""
    g = torch.Generator().manual_seed(len(seqs) * 7 + page)
    need = [-(-L // page) for L, _ in seqs]
    num_blocks = num_blocks or 1 + sum(need)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables, pos, slots, qsl = [], [], [], [0]
    for (L, n), b in zip(seqs, need):
        t, perm = perm[:b], perm[b:]
        tables.append(t + [0] * (max(need) - b))
        for j in range(L - n, L):
            pos.append(j)
            slots.append(t[j // page] * page + j % page)
        qsl.append(qsl[-1] + n)
    N = len(pos)
    q = torch.randn(N, kv_heads * group, head_dim, generator=g).to(device, dtype)
    k = torch.randn(N, kv_heads, head_dim, generator=g).to(device, dtype)
    v = torch.randn(N, kv_heads, head_dim, generator=g).to(device, dtype)
    meta = dict(block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
                seq_lens=torch.tensor([L for L, _ in seqs], dtype=torch.int32, device=device),
                query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
                positions=torch.tensor(pos, dtype=torch.int64, device=device),
                slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device))
    return q, k, v, meta, num_blocks


def gpu_tests() -> None:
    print("0. the GPU tests", flush=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="0")  # tests/conftest.py would otherwise interpret the kernels
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-p", "no:logging",
                           "tests/test_cuda_graphs.py"], cwd=root, env=env)
    check("tests/test_cuda_graphs.py", done.returncode == 0, f"pytest exit code {done.returncode}")


def kernel_checks(device) -> None:
    from specgraph.kernels import get_scheme, registry

    print("1. kernels on CUDA vs the torch references", flush=True)
    cases = [([(40, 1), (17, 1), (300, 1)], 16, 3, 3, 64), ([(70, 5), (33, 3)], 8, 2, 4, 64),
             ([(128, 48), (9, 1)], 32, 1, 8, 128)]
    for seqs, page, kvh, group, hd in cases:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            q, k, v, m, nb = _batch(seqs, page, kvh, group, hd, dtype, device)
            kc = torch.randn(nb, page, kvh, hd, device=device).to(dtype)
            vc = torch.randn_like(kc)
            caches = {name: (kc.clone(), vc.clone()) for name in ("triton", "reference")}
            for name, (a, b) in caches.items():
                impl = next(i for i in registry.implementations("cache_write") if i.name == name)
                impl.fn(k, v, a, b, m["slot_mapping"])
            same = all(torch.equal(x, y) for x, y in zip(caches["triton"], caches["reference"]))
            check(f"cache_write {dtype} page {page}", same)
            args = (q, caches["triton"][0], caches["triton"][1], m["block_tables"], m["seq_lens"],
                    m["query_start_loc"], m["positions"], hd ** -0.5)
            got = registry.select("paged_attention", *args).fn(*args)  # on CUDA: the Triton kernel
            ref = next(i for i in registry.implementations("paged_attention") if i.name == "reference").fn(*args)
            err = (got.float() - ref.float()).abs().max().item()
            tol = 2e-3 if dtype == torch.float32 else 3e-2
            check(f"paged_attention {dtype} page {page} seqs {seqs}", err <= tol, f"max |diff| {err:.2e}")
        for scheme in ("fp8", "int4"):
            q, k, v, m, nb = _batch(seqs, page, kvh, group, hd, torch.float32, device)
            cache = get_scheme(scheme).allocate(nb, page, kvh, hd, device=device).tensors()
            ref_cache = tuple(t.clone() for t in cache)
            impls = {i.name: i.fn for i in registry.implementations(f"cache_write_{scheme}")}
            impls["triton"](k, v, *cache, m["slot_mapping"])
            impls["reference"](k, v, *ref_cache, m["slot_mapping"])
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(cache, ref_cache))
            check(f"cache_write_{scheme} page {page}", diff <= (0.0 if scheme == "int4" else 1e-6), f"{diff:.2e}")
            args = (q, *cache, m["block_tables"], m["seq_lens"], m["query_start_loc"], m["positions"], hd ** -0.5)
            attn = {i.name: i.fn for i in registry.implementations(f"paged_attention_{scheme}")}
            err = (attn["triton"](*args) - attn["reference"](*args)).abs().max().item()
            check(f"paged_attention_{scheme} page {page}", err <= 5e-3, f"max |diff| {err:.2e}")


def _hf_greedy(model, prompt, n, device):
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def divergence(model, prompt, got, want, device) -> str:
    """Where specgraph's greedy tokens part from HF's, and HF's own logit margin there (teacher-forced).

    A margin near float32 rounding (a near-tie) means the two are both right; a large one is a bug."""
    i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
    ids = torch.tensor([prompt + want[:i]], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0, -1].float()
    gap = (logits[want[i]] - logits[got[i]]).item()
    return (f"parts from HF at token {i}: HF {want[i]}, specgraph {got[i]}; HF's logit margin between them "
            f"{gap:.2e} (logit scale {logits.abs().max().item():.1f})")


def _rate(fn, sequences, new_tokens) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return sequences * new_tokens / (time.perf_counter() - t0)


def engine_checks(device, smollm2: bool, model_name: str) -> None:
    try:
        tiny_llama_check(device)
    except Exception:  # the real model's checks still run
        traceback.print_exc()
        check("tiny Llama ran", False)
    if smollm2:
        smollm2_checks(device, model_name)


def tiny_llama_check(device) -> None:
    import specgraph
    from transformers import LlamaConfig, LlamaForCausalLM

    print("2. Engine on CUDA (lowering='inductor')", flush=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False)
    tiny = LlamaForCausalLM(cfg).eval().to(device)
    t0 = time.perf_counter()
    engine = specgraph.Engine(tiny, lowering="inductor", page_size=8, num_blocks=64)
    print(f"  tiny Llama: built in {time.perf_counter() - t0:.1f} s; {engine.program.step_plan}")
    prompts = [[1, 5, 9, 3, 7], [2, 4, 6, 8, 10, 12, 14]]
    got = [r.token_ids for r in engine.generate(prompts, max_new_tokens=8)]
    want = [_hf_greedy(tiny, p, 8, device) for p in prompts]
    check("tiny Llama greedy == HF on the GPU", got == want, f"{got} vs {want}")
    check("tiny Llama: no recompiles after build", engine.stats["recompiles"] == 0, str(engine.stats["recompiles"]))
    # tokens picked on the device (runtime/step_logits.py): sampled draws of plain decoding and of n-gram verifies,
    # and whole rows fetched for logprobs
    ngram = specgraph.Engine(tiny, lowering="inductor", page_size=8, num_blocks=64, draft="ngram",
                             num_draft_tokens=3, adaptive=False)
    repetitive, kw = [[1, 5, 9, 3, 7] * 4, [2, 4, 6, 8] * 5], dict(max_new_tokens=24, temperature=0.3, seed=3,
                                                                   ignore_eos=True)
    sampled = {name: [r.token_ids for r in e.generate(repetitive, **kw)] for name, e in (("plain", engine), ("ngram", ngram))}
    check("tiny Llama sampled: n-gram verifies == plain decoding (draws on the GPU)",
          sampled["plain"] == sampled["ngram"] and ngram.stats["draft_tokens"] > 0,
          f"{sampled['plain']} vs {sampled['ngram']}; {ngram.stats['draft_tokens']} drafts verified")
    scored = {}
    for name, e in (("plain", engine), ("ngram", ngram)):  # rows fetched whole, through verifies too
        scored[name] = e.submit(repetitive[0], max_new_tokens=12, logprobs=2)[0]
        while not scored[name].finished:
            e.step()
    same = [len(s.output_logprobs) == len(s.output_ids) == 12 for s in scored.values()]
    check("tiny Llama greedy with logprobs: plain == n-gram verifies, a log p each",
          all(same) and scored["plain"].output_ids == scored["ngram"].output_ids,
          f"{scored['plain'].output_ids} vs {scored['ngram'].output_ids}")


def smollm2_checks(device, model_name: str) -> None:
    import specgraph

    model, tok = specgraph.load_model(model_name)
    model = model.to(device).eval()
    texts = ["def fib(n):", "The capital of France is", "Write a haiku about the sea.", "import numpy as np\n"]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    want = [_hf_greedy(model, p, 32, device) for p in prompts]
    engines, got, n = {}, {}, 64
    for graphs in (True, False):  # with CUDA graphs first: the figure that matters if time runs out
        t0 = time.perf_counter()
        engine = engines[graphs] = specgraph.Engine(model, tokenizer=tok, lowering="inductor", cuda_graphs=graphs)
        label = f"CUDA graphs {'on' if graphs else 'off'}"
        print(f"  SmolLM2 ({label}): built in {time.perf_counter() - t0:.1f} s; {engine.program.step_plan}", flush=True)
        got[graphs] = [r.token_ids for r in engine.generate(prompts, max_new_tokens=32, ignore_eos=True)]
        same = sum(g == w for g, w in zip(got[graphs], want))
        check(f"SmolLM2 greedy == HF eager on the GPU ({label})", same == len(prompts), f"{same}/{len(prompts)} identical")
        for p, g, w in zip(prompts, got[graphs], want):
            if g != w:
                print(f"    {divergence(model, p, g, w, device)}", flush=True)
        if graphs:  # the build recorded one graph per bucket (reset_stats below starts the count again)
            check("SmolLM2: one CUDA graph per bucket", engine.stats["cuda_graph_captures"] == len(engine.program.buckets),
                  f"{engine.stats['cuda_graph_captures']} captures, buckets {engine.program.buckets}")
        engine.reset_stats()
        for batch in (1, 8):
            batch_prompts = (prompts * 8)[:batch]
            rate = _rate(lambda: engine.generate(batch_prompts, max_new_tokens=n, ignore_eos=True), batch, n)
            print(f"  batch {batch} ({label}): specgraph {rate:.1f} tok/s; host overhead "
                  f"{100 * engine.stats['host_overhead_fraction']:.1f}%", flush=True)
        check(f"SmolLM2 ({label}): no recompiles in steady state", engine.stats["recompiles"] == 0,
              str(engine.stats["recompiles"]))
    check("SmolLM2 greedy: CUDA graphs == kernels launched one by one", got[True] == got[False])
    check("SmolLM2: the timed runs replayed the graphs (no new captures)", engines[True].stats["cuda_graph_captures"] == 0,
          f"{engines[True].stats['cuda_graph_captures']} captures")
    for batch in (1, 8):
        hf = 0.0
        for p in (prompts * 8)[:batch]:  # HF eager, one sequence at a time (no padding effects)
            hf_t0 = time.perf_counter()
            _hf_greedy(model, p, n, device)
            torch.cuda.synchronize()
            hf += time.perf_counter() - hf_t0
        print(f"  batch {batch}: HF eager (sequential) {batch * n / hf:.1f} tok/s", flush=True)
    variant_checks(model, tok, prompts, got[True])


def variant_checks(model, tok, prompts, plain) -> None:
    """Speculation and a quantized cache on the GPU: greedy tokens must match plain decoding."""
    import specgraph

    # (engine arguments, whether its greedy tokens must equal plain decoding's: fp8 is lossy, its tokens
    # may part from float32's after a few steps, so they are reported, not checked)
    variants = {"ngram k=4 (fixed)": (dict(draft="ngram", num_draft_tokens=4, adaptive=False), True),
                "ngram adaptive": (dict(draft="ngram"), True),
                "kv fp8 (hot window)": (dict(kv_dtype="fp8"), False)}
    for name, (kwargs, lossless) in variants.items():
        try:
            t0 = time.perf_counter()
            engine = specgraph.Engine(model, tokenizer=tok, lowering="inductor", **kwargs)
            got = [r.token_ids for r in engine.generate(prompts, max_new_tokens=32, ignore_eos=True)]
            n = 64
            rate = _rate(lambda: engine.generate(prompts[:1], max_new_tokens=n, ignore_eos=True), 1, n)
        except Exception:
            traceback.print_exc()
            check(f"SmolLM2 {name} ran", False)
            continue
        same = sum(g == w for g, w in zip(got, plain))
        detail = f"{same}/{len(prompts)} identical; built+ran in {time.perf_counter() - t0:.1f} s; batch 1 {rate:.1f} tok/s"
        if engine.proposer is not None:
            detail += f", {engine.stats['mean_accepted_tokens']:.2f} tokens/forward"
        if lossless:
            check(f"SmolLM2 {name}: greedy == plain", same == len(prompts), detail)
        else:
            print(f"  SmolLM2 {name}: {detail}", flush=True)


def bandwidth(device, peak_gbps: float) -> None:
    from specgraph.kernels import registry

    print("3. paged attention bandwidth (decode: 64 sequences x 4096 keys, 3 kv heads x 64, bf16)", flush=True)
    seqs = [(4096, 1)] * 64
    q, _, _, m, nb = _batch(seqs, 16, 3, 3, 64, torch.bfloat16, device)
    kc = torch.randn(nb, 16, 3, 64, device=device, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    args = (q, kc, vc, m["block_tables"], m["seq_lens"], m["query_start_loc"], m["positions"], 0.125)
    for _ in range(3):
        registry.dispatch("paged_attention", *args)
    torch.cuda.synchronize()
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        registry.dispatch("paged_attention", *args)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / reps
    read = 2 * 64 * 4096 * 3 * 64 * 2  # K and V, bf16
    gbps = read / seconds / 1e9
    print(f"  {seconds * 1e6:.0f} us per call, {gbps:.0f} GB/s of K/V = {100 * gbps / peak_gbps:.0f}% of "
          f"{peak_gbps:.0f} GB/s peak")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-smollm2", action="store_true")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="load_model's name or a .gguf path")
    parser.add_argument("--peak-gbps", type=float, default=4800.0, help="the GPU's peak memory bandwidth")
    parser.add_argument("--sections", default="tests,kernels,engine,bandwidth", help="which sections to run, in order")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: this script runs the compiled kernels on the GPU")
        return 2
    if not torch.cuda.is_available():
        print("no CUDA device: this script is for a GPU machine")
        return 2
    device = torch.device("cuda")
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    t0 = time.perf_counter()
    sections = {"tests": gpu_tests, "kernels": lambda: kernel_checks(device),
                "engine": lambda: engine_checks(device, not args.skip_smollm2, args.model),
                "bandwidth": lambda: bandwidth(device, args.peak_gbps)}
    chosen = args.sections.split(",")
    unknown = sorted(set(chosen) - set(sections))
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {list(sections)}")
    for name, run in ((n, sections[n]) for n in chosen):  # a section that breaks is a failure; the others still run
        try:
            run()
        except Exception:
            traceback.print_exc()
            check(f"section {name} ran to the end", False)
    print(f"done in {time.perf_counter() - t0:.0f} s; {len(FAILURES)} failed check(s)"
          + (f": {', '.join(FAILURES)}" if FAILURES else ""))
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
