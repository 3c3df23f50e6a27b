"""How far ahead the CPU linears prefetch their weights: chosen by timing on this machine.

A decode step streams every weight once (more bytes than any cache). The hardware prefetchers alone
left the C++ linears short of the memory's bandwidth on an Intel Xeon (2 threads, SmolLM2):
* the float32 panel kernel (``cpu_panel_linear.cpp``), where a tile of several rows spends more
  cycles per weight byte than the memory takes to deliver it: 4 rows 25.0 ms with no prefetch, 18.5
  at 16 panel rows ahead (1 row: 17.0 with none, 17.9-18.9 with one);
* the quantized kernel (``cpu_quant_linear.cpp``), which streams 4 weight rows at once: int8, 1 row,
  5.0 ms at the 2 KiB it used to prefetch ahead, 3.6 at 8 KiB, 3.7 at 16 KiB.
The best distance is the machine's (its memory latency, bandwidth and prefetchers), so each is
chosen by timing the model's own weights at build, each distance against a base in the same round (the
median ratio over rounds, ``paired_timing.py``, so that a load swing does not pick a distance; a panel
distance must beat its class's default clearly, else the default stays), and kept per machine beside the
step plan (``compiler/step_plan.py``). The
settings are process-wide, like the machine they describe. A prefetch changes no arithmetic: every
result is bitwise the same at any distance.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable

import torch

from .paired_timing import clearly_faster, median_ratio

ROWS = (1, 2, 4, 8)  # row counts of x timed: a decode; verifies and small batches
#: the panel kernel's classes of row blocks, in ``set_panel_prefetch``'s order: 1 row; the rows one register tile
#: holds (the C++ kernel's kTileRows, 6 in every build that prefetches); more, walked in L1 spans by several
#: tiles. Each with the row counts of ROWS that time it and the distance it keeps unless another is clearly
#: faster (the C++ defaults): none for 1 row, whose stream the hardware prefetchers keep up with (an Intel Xeon:
#: 17.0 ms with none, 17.9-18.9 with one); 16 rows for more, which fall short without one (the Xeon: 4 rows 25.0
#: ms with none, 18.5 at 16; an AMD EPYC with AVX2: 3 rows about 10% slower with none than at 16).
PANEL_CLASSES = (("single", (1,), 0), ("tile", (2, 4), 16), ("spans", (8,), 16))
PANEL_DISTANCES = (0, 8, 16, 32)  # panel rows of k ahead (0: no prefetch)
QUANT_DISTANCES = (1024, 2048, 4096, 8192, 16384)  # bytes ahead of each weight row's stream


def _timings(set_distance: Callable[[int], None], run: Callable[[int], None], distances, repeats: int):
    """{(distance, rows): [seconds of ``run(rows)`` per round]} over ``repeats`` rounds after a warm-up one.
    Within a round each row count runs at every distance back to back, the order reversed every other round."""
    times = {(d, rows): [] for d in distances for rows in ROWS}
    with torch.no_grad():
        for round_ in range(repeats + 1):
            for rows in ROWS:
                for d in distances if round_ % 2 else distances[::-1]:
                    set_distance(d)
                    t0 = time.perf_counter()
                    run(rows)
                    if round_ > 0:
                        times[d, rows].append(time.perf_counter() - t0)
    return times


def _relative(times, d: int, base: int, rows: int) -> float:
    """Distance ``d``'s time over ``base``'s at ``rows`` rows: the median same-round ratio (``paired_timing``)."""
    return median_ratio(times[d, rows], times[base, rows])


def _clearly_faster(times, d: int, base: int, row_counts, margin: float = 0.03) -> bool:
    """Whether distance ``d`` beat ``base`` at each of ``row_counts``: by ``margin`` in the median same-round
    ratio, and in at least 80% of the rounds. (A distance that wins only some rounds is noise.
    On an AMD EPYC with AVX2 one build measured 32 rows ahead 9% faster than none for 1 row, where decoding
    in the Engine then ran 11% slower with it: 43.5 against 48.5 tok/s, interleaved in one process.)"""
    return all(clearly_faster(times[d, rows], times[base, rows], margin) for rows in row_counts)


def _table(times, distances, unit: str) -> str:
    return "; ".join(f"{rows} row{'s' if rows > 1 else ''} " + "/".join(
        f"{statistics.median(times[d, rows]) * 1e3:.1f}" for d in distances) for rows in ROWS) + \
        f" ms (medians) at {'/'.join(map(str, distances))} {unit} ahead"


def choose_panel_prefetch(weights: list[torch.Tensor], repeats: int = 9) -> tuple[tuple[int, int, int], str]:
    """Set the panel kernel's three distances (``set_panel_prefetch``: row blocks of 1 row, of one register
    tile's rows, of more) from timings over ``weights`` (the model's float32 ``[N, K]`` linear weights): for each
    class of :data:`PANEL_CLASSES` the fastest of :data:`PANEL_DISTANCES` over its row counts together, each
    against the class's default in the same round (:func:`_relative`), and only where it is clearly faster than
    the default (:func:`_clearly_faster`), else the default. Returns the three and a line saying what was
    measured. (One distance for all calls of more than 1 row, timed over 4 and 8 rows together against none,
    came out 16 on one build and 32 on another of an AMD EPYC, where 2-4 rows ran 5-10% faster at 16 and 8 rows
    alike, and none on a third, whose 5 rounds did not show 16 clearly faster than none: an EAGLE chain of 2
    decoded 1.26x no speculation at 16 and 1.15x at 32.)"""
    from . import cpu_kernels
    from .panel_linear import packed

    module, panel_linear = cpu_kernels.load(), cpu_kernels.native_op("panel_linear")
    if module is None or panel_linear is None or not weights:
        return (0, 0, 0), "no panel kernel" if weights else "no float32 linears"
    panels = [(packed(w), w.shape[0]) for w in weights]
    x = {rows: {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights} for rows in ROWS}

    def run(rows: int) -> None:
        for (p, n), w in zip(panels, weights):
            panel_linear(x[rows][w.shape[1]], p, None, n)

    previous = module.set_panel_prefetch(0, 0, 0)
    try:
        times = _timings(lambda d: module.set_panel_prefetch(d, d, d), run, PANEL_DISTANCES, repeats)
    finally:
        module.set_panel_prefetch(*previous)
    chosen = []
    for _, rows, default in PANEL_CLASSES:
        best = min(PANEL_DISTANCES, key=lambda d: sum(_relative(times, d, default, r) for r in rows))
        chosen.append(best if best != default and _clearly_faster(times, best, default, rows) else default)
    single, tile, spans = chosen
    module.set_panel_prefetch(single, tile, spans)
    return (single, tile, spans), (f"panel linears: {_table(times, PANEL_DISTANCES, 'panel rows')} -> {single} "
                                   f"ahead for 1 row, {tile} for a tile's rows, {spans} for more")


def choose_quant_prefetch(linears: list[tuple[torch.Tensor, torch.Tensor | None, str]],
                          repeats: int = 5) -> tuple[int, str]:
    """Set the quantized kernel's distance (``set_quant_prefetch``) from timings over ``linears`` (the
    model's quantized weights as ``(weight, scales, scheme)``): the fastest of :data:`QUANT_DISTANCES`
    over every row count together, each against the shortest in the same round (:func:`_relative`).
    Returns it and a line saying what was measured."""
    from . import cpu_kernels

    module = cpu_kernels.load()
    if module is None:
        return 0, "no quantized kernel"
    if not linears:
        return _current_quant_distance(module), "no quantized linears"
    in_features = {w.shape[1] * (2 if scheme == "int4" else 1) for w, _, scheme in linears}
    x = {rows: {k: torch.randn(rows, k) for k in in_features} for rows in ROWS}

    def run(rows: int) -> None:
        for w, scales, scheme in linears:
            module.quant_linear_cpu(x[rows][w.shape[1] * (2 if scheme == "int4" else 1)], w, scales, None, scheme)

    previous = module.set_quant_prefetch(QUANT_DISTANCES[0])
    try:
        times = _timings(module.set_quant_prefetch, run, QUANT_DISTANCES, repeats)
    finally:
        module.set_quant_prefetch(previous)
    ahead = min(QUANT_DISTANCES, key=lambda d: sum(_relative(times, d, QUANT_DISTANCES[0], rows) for rows in ROWS))
    module.set_quant_prefetch(ahead)
    return ahead, f"quantized linears: {_table(times, QUANT_DISTANCES, 'bytes')} -> {ahead} bytes ahead"


def _current_quant_distance(module) -> int:
    ahead = module.set_quant_prefetch(0)
    module.set_quant_prefetch(ahead)
    return ahead


@contextlib.contextmanager
def distances(panel: tuple[int, int, int] | None = None, quant: int | None = None):
    """Run a block with the given distances (panel: ``(1 row, a tile's rows, more rows)``; quantized: bytes), and
    restore the ones set before it after (tests, side-by-side timings). Yields the C++ module."""
    from . import cpu_kernels

    module = cpu_kernels.load()
    if module is None:
        raise RuntimeError(f"the C++ CPU kernels did not build: {cpu_kernels.build_error()}")
    panel_before = module.set_panel_prefetch(*panel) if panel is not None else None
    quant_before = module.set_quant_prefetch(quant) if quant is not None else None
    try:
        yield module
    finally:
        if panel_before is not None:
            module.set_panel_prefetch(*panel_before)
        if quant_before is not None:
            module.set_quant_prefetch(quant_before)
