"""The batch-invariant float32 linear on CPU (``specgraph_cpu::panel_linear``, ``cpu_panel_linear.cpp``).

**Contract.** ``panel_linear(x, panels, bias, n)``: ``x [..., K]`` float32, ``panels`` the weight
``w [n, K]`` as :func:`pack_panels_ref` lays it out (``[ceil(n / W), K, W]``: output columns in
panels of ``W =`` :func:`panel_width` (16 in an AVX2 build, 64 with AVX-512 or without either), k-major,
zero past ``n``), optional ``bias [n]``; returns ``x @ w.T + bias``
``[..., n]``. Each output is one FMA chain over ``k = 0 .. K-1`` in order, the bias added last, so
a row's result is bitwise the same whatever the other rows of ``x`` are: how many, how they are
tiled, how the threads split them. That is what makes speculation emit exactly the tokens plain
decoding does: a token's logits do not depend on whether a decode, a verify or a step with another
sequence's prefill chunk computed them. (A GEMM library blocks ``k`` by the row count, and its
results part from row count to row count in the last bits.)

**Speed** (SmolLM2's 211 linears, 513 MiB, 2 threads, an AMD EPYC with AVX-512; best of 5):
1 row 19.3 ms (oneDNN 28.7, the few-row kernel it replaced 20.2), 8 rows 20.9 (27.8, 30.6), 16
rows 30.7 (34.8, 45.9), 64 rows 96 (94), 256 rows 350 (342). ``benchmarks/bench_gemm.py`` compares
them on the model's shapes. A call of more rows than one register tile (7 and up with AVX-512) walks ``k``
in L1-sized spans, every tile of rows taking a span in turn, so the weights stream from memory once (on
an Intel Xeon: 8 rows 26.5 -> 24.6 ms, 1 row 20.4). With AVX2 (16 columns a panel, so a tile holds 6
rows; an AMD EPYC, 2 threads, ``benchmarks/ab_kernel.py``): 1 row 24.3 ms, 4 rows 22.9, 8 rows 35.6, 12
rows 36.6, where the 64-column panel of before took 24.7, 27.6, 40.8 and 48.2: a verify of up to 6 tokens
reads each weight once with every FMA under the stream.

**Prefetch.** The kernel prefetches the panel some rows of ``k`` ahead, one distance for row blocks of
1 row, one for those one register tile holds (verifies, small batches) and one for more, each set by timing
the model's own weights (``kernels/prefetch.py``; on an Intel
Xeon with AVX-512: 4 rows 25.0 -> 18.5 ms, 8 rows 30.1 -> 22.6 ms, 1 row best without). A prefetch
changes no arithmetic: results are bitwise the same at any distance.

:func:`panel_linear_ref` is the pure-torch reference; :func:`packed` packs a weight once per
process, kept while the weight lives (the eager lowering, the step graphs and every Engine built
on the same model share it).
"""
from __future__ import annotations

import weakref

import torch

from . import huge_pages

_packed: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # id(weight) -> (the weight, its panels)


def panel_width() -> int:
    """Output columns per panel of the built kernel (``cpu_panel_linear.cpp``'s ``kPanel``: a tile holds 6 rows
    of x by one panel row in vector registers, so 2 AVX2 or 4 AVX-512 vectors)."""
    return torch.ops.specgraph_cpu.panel_width()


def pack_panels_ref(w: torch.Tensor) -> torch.Tensor:
    """``w [n, K]`` -> panels ``[ceil(n / W), K, W]``: ``panels[p, k, c] = w[W p + c, k]``, zero past ``n``
    (``W =`` :func:`panel_width`)."""
    width = panel_width()
    n, k = w.shape
    padded = torch.zeros(-(-n // width) * width, k, dtype=w.dtype)
    padded[:n] = w
    return padded.view(-1, width, k).transpose(1, 2).contiguous()


def panel_linear_ref(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """The contract in torch (not batch-invariant itself: it checks the kernel's values, and the
    kernel's tests check invariance)."""
    w = panels.transpose(1, 2).reshape(-1, panels.shape[1])[:n]
    return torch.nn.functional.linear(x, w, bias)


def packed(w: torch.Tensor) -> torch.Tensor:
    """``pack_panels(w)`` by the C++ kernel, once per weight tensor in this process, in huge pages
    where they are available (``kernels/huge_pages.py``)."""
    key = id(w)
    hit = _packed.get(key)
    if hit is not None and hit[0]() is w:
        return hit[1]
    out = huge_pages.moved(torch.ops.specgraph_cpu.pack_panels(w.detach()))
    _packed[key] = (weakref.ref(w, lambda _: _packed.pop(key, None)), out)
    return out

