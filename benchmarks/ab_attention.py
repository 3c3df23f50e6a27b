"""Two versions of the CPU paged-attention kernel (``kernels/cpu_kernels.cpp``) timed side by side in one process.

    git show HEAD~1:kernels/cpu_kernels.cpp > /tmp/old.cpp
    .venv/bin/python benchmarks/ab_attention.py /tmp/old.cpp kernels/cpu_kernels.cpp [--differ] [--threads 1,2]

Each file is built as its own extension (its op library renamed) with the flags specgraph builds with. A case
is SmolLM2's attention (9 query heads over 3 kv heads, head size 64, pages of 16) for ``batch`` sequences at
``context`` keys feeding ``--tokens`` tokens each (1: decodes; more: verifies or prefill chunks, causal), over
30 layers' caches (more than any CPU cache at 1,000 keys and up, as in a step, where the weights stream between
two visits of a layer's cache). The versions alternate, the order flipping every round;
the median of ``--rounds`` rounds is printed. Both must give bitwise the same outputs (checked first), or with
``--differ`` (a change of the order of float operations) each must be within the reference's tolerance
(``paged_attention_ref``), and the largest difference is printed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cpu_description  # noqa: E402
from specgraph.kernels.cpu_kernels import CFLAGS  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE, LAYERS = 9, 3, 64, 16, 30


def build(name: str, source: Path):
    """``source`` as an extension named ``name`` whose ``paged_attention_short`` is an attribute."""
    return load_inline(name=name, cpp_sources=[source.read_text().replace("specgraph_cpu", name)],
                       functions=["paged_attention_short"],
                       extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"])


def case(context: int, batch: int, tokens: int = 1) -> tuple[list, tuple]:
    """30 layers' caches and the step's other arguments: ``batch`` sequences feeding positions ``context -
    tokens .. context - 1``."""
    per_seq = -(-context // PAGE)
    blocks = batch * per_seq + 1
    caches = [(torch.randn(blocks, PAGE, KV_HEADS, HEAD_DIM), torch.randn(blocks, PAGE, KV_HEADS, HEAD_DIM))
              for _ in range(LAYERS)]
    tables = torch.arange(1, blocks, dtype=torch.int32).reshape(batch, per_seq)
    positions = torch.arange(context - tokens, context).repeat(batch)
    step = (tables, torch.full((batch,), context, dtype=torch.int32),
            torch.arange(0, (batch + 1) * tokens, tokens, dtype=torch.int32), positions, HEAD_DIM ** -0.5, 0, 0.0,
            None, None)
    return caches, step


def check(modules: dict, q: torch.Tensor, caches: list, step: tuple, differ: bool) -> str:
    """Raise if the versions disagree (bitwise, or beyond the reference's tolerance with ``differ``); the
    largest difference between them, as text."""
    from specgraph.kernels.paged_attention import paged_attention_ref

    k, v = caches[0]
    old, new = (modules[name].paged_attention_short(q, k, v, *step) for name in ("old", "new"))
    if not differ:
        if not torch.equal(old, new):
            raise SystemExit("the two versions differ (--differ allows it)")
        return ""
    want = paged_attention_ref(q, k, v, *step)
    for name, got in (("old", old), ("new", new)):
        if (got - want).abs().max() > 1e-4:
            raise SystemExit(f"{name} is off the reference by {(got - want).abs().max():.3g}")
    return f"; largest difference {float((old - new).abs().max()):.2g}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--differ", action="store_true", help="the versions may differ within the reference's tolerance")
    p.add_argument("--contexts", default="200,1000,4000")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--tokens", type=int, default=1, help="tokens per sequence per step")
    p.add_argument("--threads", default="2")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    modules = {"old": build("sg_ab_attention_old", args.old), "new": build("sg_ab_attention_new", args.new)}
    print(f"cpu: {cpu_description()}; {args.old} vs {args.new}")
    print(f"us per layer's attention (SmolLM2's heads, {LAYERS} layers' caches in turn), median of {args.rounds}")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for context in (int(c) for c in args.contexts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                caches, step = case(context, batch, args.tokens)
                q = torch.randn(batch * args.tokens, HEADS, HEAD_DIM)
                note = check(modules, q, caches, step, args.differ)
                times = {"old": [], "new": []}
                for r in range(args.rounds):
                    for name in ("old", "new") if r % 2 else ("new", "old"):
                        t0 = time.perf_counter()
                        for k, v in caches:
                            modules[name].paged_attention_short(q, k, v, *step)
                        times[name].append((time.perf_counter() - t0) / LAYERS * 1e6)
                old, new = statistics.median(times["old"]), statistics.median(times["new"])
                print(f"threads {threads} context {context:5d} batch {batch} tokens {args.tokens}: "
                      f"old {old:7.1f}  new {new:7.1f}  new/old {new / old:.2f}{note}", flush=True)


if __name__ == "__main__":
    main()
