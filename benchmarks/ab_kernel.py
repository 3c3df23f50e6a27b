"""Two versions of a CPU linear kernel timed side by side in one process: the float32 panel kernel
(``kernels/cpu_panel_linear.cpp``) or the quantized one (``kernels/cpu_quant_linear.cpp``, ``--scheme``).

    git show HEAD~1:kernels/cpu_panel_linear.cpp > /tmp/old.cpp
    .venv/bin/python benchmarks/ab_kernel.py /tmp/old.cpp kernels/cpu_panel_linear.cpp [--rows 1,2,4,8,64]
    git show HEAD~1:kernels/cpu_quant_linear.cpp > /tmp/old.cpp
    .venv/bin/python benchmarks/ab_kernel.py /tmp/old.cpp kernels/cpu_quant_linear.cpp --scheme int4 --differ

Each file is built as its own extension (its ops renamed, the shared vector header taken from
``kernels/cpu_kernels.cpp``) with the flags specgraph builds with. One "step" runs SmolLM2-135M's fused linears
(30 layers x qkv, o, gate_up, down, then the LM head; float32: 538 MB, more than any cache; a quantized scheme
keeps the LM head int8 under int4 and fp8, as ``passes/quantize_weights.py`` does) on ``rows`` rows; the two
versions alternate, the order flipping every round, and the median of ``--rounds`` steps is printed. Both
versions must give bitwise the same outputs (checked first), or with ``--differ`` (a change of the order of
float operations) each must be within the reference's tolerance (``quant_linear_ref``), and the largest
difference is printed. Prefetch distances stay at each build's defaults (the Engine sets them by measurement,
``kernels/prefetch.py``).
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

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
HIDDEN, INTER, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
LAYER = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # qkv, o, gate_up, down
SHAPES = LAYER * LAYERS + [(VOCAB, HIDDEN)]
HEAD_SCHEME = {"int4": "int8", "fp8": "int8"}


def build(name: str, source: Path, quantized: bool, cflags: tuple[str, ...] = ()):
    """``source`` as an extension whose ops live in ``torch.ops.<name>`` (and whose functions are its attributes),
    built with specgraph's flags plus ``cflags`` (``-mno-avx2``: the scalar paths)."""
    header = (KERNELS / "cpu_kernels.cpp").read_text().split("// a . b over D floats")[0]  # includes + FloatVec
    text = (source.read_text().replace("specgraph_cpu", name).replace("TORCH_LIBRARY_FRAGMENT", "TORCH_LIBRARY")
            .replace("specgraph_panel", f"{name}_panel"))
    functions = ["quant_linear_cpu"] if quantized else ["set_panel_prefetch"]
    return load_inline(name=name, cpp_sources=[header + text], functions=functions,
                       extra_cflags=[*CFLAGS, *cflags],
                       extra_ldflags=["-fopenmp"])


class Panel:
    """The float32 panel kernel of one build over SmolLM2's weights."""

    def __init__(self, name: str, source: Path, weights: list[torch.Tensor]):
        build(name, source, quantized=False)
        self.op = getattr(torch.ops, name)
        self.packs = [self.op.pack_panels(w) for w in weights]

    def run(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self.op.panel_linear(x, self.packs[i], None, SHAPES[i][0])


class Quantized:
    """The quantized kernel of one build over SmolLM2's weights in ``scheme`` (the LM head in HEAD_SCHEME's)."""

    def __init__(self, name: str, source: Path, quantized: list[tuple[str, torch.Tensor, torch.Tensor]]):
        self.module, self.weights = build(name, source, quantized=True), quantized

    def run(self, i: int, x: torch.Tensor) -> torch.Tensor:
        scheme, data, scales = self.weights[i]
        return self.module.quant_linear_cpu(x, data, scales, None, scheme)


def check(versions: dict, quantized, xs: dict, rows: int, differ: bool) -> str:
    """Raise if the versions disagree (bitwise, or beyond the reference's tolerance with ``differ``); the
    largest difference between them, as text."""
    from specgraph.kernels.quant_linear import quant_linear_ref

    worst = 0.0
    for i, (n, k) in enumerate(SHAPES):
        old, new = versions["old"].run(i, xs[k]), versions["new"].run(i, xs[k])
        if not differ:
            if not torch.equal(old, new):
                raise SystemExit(f"the two versions differ on a [{n}, {k}] weight at {rows} rows (--differ allows it)")
            continue
        want = quant_linear_ref(xs[k], *quantized[i][1:], None, quantized[i][0])
        tol = 1e-4 * float(want.abs().max()) + 1e-5
        for v, got in (("old", old), ("new", new)):
            if (got - want).abs().max() > tol:
                raise SystemExit(f"{v} is off the reference by {(got - want).abs().max():.3g} on a [{n}, {k}] weight")
        worst = max(worst, float((old - new).abs().max() / want.abs().max()))
    return f"; largest difference {worst:.2g} of the largest output" if differ else ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--scheme", default="float32", choices=["float32", "int8", "int4", "fp8", "bfloat16"])
    p.add_argument("--differ", action="store_true", help="the versions may differ within the reference's tolerance")
    p.add_argument("--rows", default="1,2,4,8,16,64")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    weights = [torch.randn(n, k) * 0.02 for n, k in SHAPES]
    quantized = None
    if args.scheme == "float32":
        versions = {v: Panel(f"sg_ab_{v}", path, weights) for v, path in (("old", args.old), ("new", args.new))}
    else:
        from specgraph.kernels.quant_linear import quantize_weight

        schemes = [args.scheme] * (len(SHAPES) - 1) + [HEAD_SCHEME.get(args.scheme, args.scheme)]
        quantized = [(s, *quantize_weight(w, s)) for s, w in zip(schemes, weights)]
        versions = {v: Quantized(f"sg_ab_{v}", path, quantized) for v, path in (("old", args.old), ("new", args.new))}
    stored = [t for _, *tensors in quantized for t in tensors if t is not None] if quantized else weights
    megabytes = sum(t.numel() * t.element_size() for t in stored) / 1e6
    print(f"cpu: {cpu_description()}; threads {args.threads}; {args.scheme}; {args.old} vs {args.new}")
    print(f"ms per step of SmolLM2's fused linears ({megabytes:.0f} MB), median of {args.rounds}")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in (HIDDEN, INTER)}
        note = check(versions, quantized, xs, rows, args.differ)
        times = {"old": [], "new": []}
        for r in range(args.rounds):
            for v in ("old", "new") if r % 2 else ("new", "old"):
                t0 = time.perf_counter()
                for i, (n, k) in enumerate(SHAPES):
                    versions[v].run(i, xs[k])
                times[v].append((time.perf_counter() - t0) * 1e3)
        old, new = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"rows {rows:4d}: old {old:7.1f}  new {new:7.1f}  new/old {new / old:.3f}{note}", flush=True)


if __name__ == "__main__":
    main()
