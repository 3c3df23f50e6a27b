"""Two versions of the float32 panel kernel (``kernels/cpu_panel_linear.cpp``) timed side by side in one process.

    git show HEAD~1:kernels/cpu_panel_linear.cpp > /tmp/old.cpp
    .venv/bin/python benchmarks/ab_panel_kernel.py /tmp/old.cpp kernels/cpu_panel_linear.cpp [--rows 1,2,4,8,64]

Each file is built as its own extension (its ops renamed, the shared vector header taken from
``kernels/cpu_kernels.cpp``) with the flags specgraph builds with. One "step" runs SmolLM2-135M's fused linears
(30 layers x qkv, o, gate_up, down, then the LM head: 538 MB of float32, more than any cache) on ``rows`` rows;
the two versions alternate, the order flipping every round, and the median of ``--rounds`` steps is printed.
Both versions must give bitwise the same outputs (checked first). Prefetch distances stay at each build's
defaults (the Engine sets them by measurement, ``kernels/prefetch.py``).
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

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
HIDDEN, INTER, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
LAYER = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # qkv, o, gate_up, down
SHAPES = LAYER * LAYERS + [(VOCAB, HIDDEN)]


def build(name: str, source: Path):
    """``source`` as an extension whose ops live in ``torch.ops.<name>``."""
    header = (KERNELS / "cpu_kernels.cpp").read_text().split("// a . b over D floats")[0]  # includes + FloatVec
    text = (source.read_text().replace("specgraph_cpu", name).replace("TORCH_LIBRARY_FRAGMENT", "TORCH_LIBRARY")
            .replace("specgraph_panel", f"{name}_panel"))
    load_inline(name=name, cpp_sources=[header + text], functions=["set_panel_prefetch"],
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"], extra_ldflags=["-fopenmp"])
    return getattr(torch.ops, name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--rows", default="1,2,4,8,16,64")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ops = {"old": build("sg_ab_old", args.old), "new": build("sg_ab_new", args.new)}
    weights = [torch.randn(n, k) * 0.02 for n, k in SHAPES]
    packs = {v: [op.pack_panels(w) for w in weights] for v, op in ops.items()}
    print(f"cpu: {cpu_description()}; threads {args.threads}; {args.old} vs {args.new}")
    print(f"ms per step of SmolLM2's fused linears (538 MB), median of {args.rounds}")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in (HIDDEN, INTER)}
        for (n, k), a, b in zip(SHAPES, packs["old"], packs["new"]):
            if not torch.equal(ops["old"].panel_linear(xs[k], a, None, n), ops["new"].panel_linear(xs[k], b, None, n)):
                raise SystemExit(f"the two versions differ on a [{n}, {k}] weight at {rows} rows")
        times = {"old": [], "new": []}
        for r in range(args.rounds):
            for v in ("old", "new") if r % 2 else ("new", "old"):
                t0 = time.perf_counter()
                for (n, k), w in zip(SHAPES, packs[v]):
                    ops[v].panel_linear(xs[k], w, None, n)
                times[v].append((time.perf_counter() - t0) * 1e3)
        old, new = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"rows {rows:4d}: old {old:7.1f}  new {new:7.1f}  new/old {new / old:.3f}", flush=True)


if __name__ == "__main__":
    main()
