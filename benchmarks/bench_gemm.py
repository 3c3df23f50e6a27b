"""Few-row GEMMs of a SmolLM2-135M decode step: aten.linear vs prepacked MKL vs prepacked oneDNN.

    .venv/bin/python benchmarks/bench_gemm.py [--threads 2] [--rows 1,2,4,8,9,16,64,256] [--repeats 7]

One "step" runs every projection of the 30 layers and the LM head on M rows, each weight read
once, as the real decode step does (538 MB of float32: the weights do not fit in any cache, so
this is the streaming cost, not a hot-cache microbenchmark). Layouts:

* ``separate``: q, k, v, o, gate, up, down (7 GEMMs per layer), as Hugging Face runs them;
* ``fused``:    qkv, o, gate_up, down (4 per layer), as after specgraph's ``fuse_linears`` pass.

Kernels: ``aten.linear`` (MKL sgemm on the plain weight), ``torch.mm(W, x.T)`` (the same GEMM
transposed), MKL's packed GEMM (``mkl._mkl_linear``, what Inductor's freezing picks for float32
with a static batch), and oneDNN over weights reordered once (``mkldnn._linear_pointwise``,
what specgraph's CPU lowering uses without its C++ kernels) and specgraph's batch-invariant panel
kernel (``specgraph_cpu::panel_linear``, what every CPU step graph runs).
The median of ``--repeats`` steps is printed, plus the
weight bytes per ms it implies.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

HIDDEN, INTER, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
LAYOUTS = {
    "separate": [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTER, HIDDEN), (INTER, HIDDEN),
                 (HIDDEN, INTER)],
    "fused": [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)],
}


def make_kernels(weights: list[torch.Tensor]) -> dict[str, list]:
    """Per kernel, one callable per weight taking the input rows."""
    kernels = {
        "aten.linear": [lambda x, w=w: F.linear(x, w) for w in weights],
        "mm(W, x.T)": [lambda x, w=w: torch.mm(w, x.t()).t() for w in weights],
    }
    if torch._C.has_mkl:
        packed = [(torch.ops.mkl._mkl_reorder_linear_weight(w, 8), w) for w in weights]
        kernels["mkl packed"] = [lambda x, p=p, w=w: torch.ops.mkl._mkl_linear(x, p, w, None, x.shape[0])
                                 for p, w in packed]
    if torch.backends.mkldnn.is_available():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
        kernels["oneDNN packed"] = [lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                    for p in packed]
    from specgraph.kernels import cpu_kernels

    panel_linear = cpu_kernels.native_op("panel_linear")
    if panel_linear is not None:
        from specgraph.kernels.panel_linear import packed

        kernels["specgraph panel"] = [lambda x, p=packed(w), n=w.shape[0]: panel_linear(x, p, None, n)
                                      for w in weights]
    return kernels


def time_step(calls: list, weights: list[torch.Tensor], rows: int, repeats: int) -> float:
    inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
    args = [inputs[w.shape[1]] for w in weights]

    def step():
        for f, x in zip(calls, args):
            f(x)

    step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,2,4,8,9,16,64,256")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"threads {torch.get_num_threads()}; ms per decode step of GEMMs (30 layers + LM head), median of "
          f"{args.repeats}; [GB/s of weights]")
    head = torch.randn(VOCAB, HIDDEN)
    for layout, shapes in LAYOUTS.items():
        weights = [torch.randn(*s) for _ in range(LAYERS) for s in shapes] + [head]
        gb = sum(w.numel() for w in weights) * 4 / 1e9
        kernels = make_kernels(weights)
        print(f"\n{layout} ({len(shapes)} GEMMs per layer, {gb * 1e3:.0f} MB)")
        print(f"{'rows':>5} " + " ".join(f"{k:>22}" for k in kernels))
        for m in rows:
            cells = []
            for calls in kernels.values():
                ms = time_step(calls, weights, m, args.repeats)
                cells.append(f"{ms:8.1f} ms [{gb / ms * 1e3:5.1f}]")
            print(f"{m:>5} " + " ".join(f"{c:>22}" for c in cells), flush=True)
        del weights, kernels


if __name__ == "__main__":
    main()
