"""The target's forward cost by stream size, as the speculation controller (``runtime/controller.py``)
reads it: measured once per machine when the engine starts (:func:`measure_forward_cost` over
:func:`cost_sizes`), then scaled and corrected by the decode steps as they run (:class:`ForwardCost`).
"""
from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from statistics import median
from typing import Callable, Sequence

from ..compiler.graph_cache import read_json, write_json


class ForwardCost:
    """Seconds of one target forward by stream size: a shape measured when the engine starts, times one
    machine-speed factor that every decode step updates, times a per-size correction learned from the
    steps of that size.

    The shape is the measured table made non-decreasing (a larger stream never costs less: it could
    always be padded; pool-adjacent-violators averages out what timing noise put out of order), linear
    between the measured points, which ``cost_sizes`` puts at every bucket edge. ``observe`` folds a
    step into the factor: the median of the last ``window`` ratios of seconds seen to the measured
    shape's seconds, whatever the step's size, the start counting as ``anchor`` ratios of 1. A shared
    VM's speed drifts by tens of percent for seconds at a time; one factor moves every size together,
    so two sizes are always compared at the same moment's speed. A per-size estimate alone, which this
    replaced, kept each size's value from whenever it was last chosen: a size measured in a slow
    period looked dear, was not chosen, and so was never measured again (tables like 1: 35, 2: 56,
    3: 55, 4: 39 ms were seen), and the plan followed the noise. The median keeps a pause or two from
    moving anything.

    The start-up shape can be wrong too: one measured while another process shared the cores read a
    verify of 2-4 tokens 1.13x a 1-token forward where steps took 1.4x, and, cached per machine, kept
    a controller speculating at a loss on every later build. So each step also leaves, for its size,
    its ratio divided by the factor of that moment (what that size costs relative to the rest, free of
    the machine's speed); once a size has ``min_observations``, the median of its last ``window`` such
    ratios corrects the shape there (moved only when it moves by more than ``resolution``: finer moves
    are timing noise, and the table was rebuilt for them on nearly every step), and sizes between
    corrected ones take the linear mix of their corrections (beyond them, the nearest one's). Only sizes that steps use are corrected, so the
    failure above does not come back: an unused size keeps its measured cost, and one seen to cost
    what it was measured at keeps that. A size observed alone says nothing about relative cost (all
    its ratios are the factor), so its correction stays 1.

    A start-up table too dear at a size would still keep it unused, and so uncorrected (one build read
    a 2-token verify 1.46x a decode; timed again, 1.31x). Planning therefore reads a size outside the
    span of corrected ones (between two, the mix of their corrections is trusted) ``uncertainty``
    cheaper (:meth:`optimistic`), as bandit policies read an arm they have not tried: while no size
    is corrected every size reads alike, so nothing changes; once plain decode steps have corrected
    their size, a verify that the table put near the break-even gets tried, and its first
    ``min_observations`` steps settle what it costs. 15% covers the build-time errors seen (-20% to
    +11%); a wrong try costs a few steps once per engine.
    """

    def __init__(self, seconds_by_size: dict[int, float], window: int = 15, anchor: int = 3,
                 min_observations: int = 5, uncertainty: float = 0.15, resolution: float = 0.01):
        if not seconds_by_size or min(seconds_by_size) < 1:
            raise ValueError(f"forward cost needs measured stream sizes >= 1; got {sorted(seconds_by_size)}")
        self.sizes = sorted(seconds_by_size)
        self.shape = non_decreasing([float(seconds_by_size[n]) for n in self.sizes])  # as measured
        self.scale = 1.0
        self.window, self.min_observations, self.uncertainty = window, min_observations, uncertainty
        self.resolution = resolution
        self._ratios = deque([1.0] * anchor, maxlen=window)
        self._relative: dict[int, deque] = {}  # stream size -> its recent ratios over the factor then
        self.corrections: dict[int, float] = {}  # stream size -> the median of those (enough of them)
        self._table = (self.sizes, self.shape)  # the shape with the corrections applied
        self._corrected_span = (0, -1)  # the smallest and largest corrected size (none yet: empty)
        # shape_seconds and optimistic's share of the table by size, until the table changes (planning reads
        # tens of sizes per step, for a few distinct ones)
        self._shape_at: dict[int, float] = {}
        self._optimistic_at: dict[int, float] = {}

    def __call__(self, n: int) -> float:
        return self.scale * self.shape_seconds(n)

    def optimistic(self, n: int) -> float:
        """What planning reads at ``n``: the estimate, ``uncertainty`` less outside the corrected sizes' span,
        but above the span never less than its largest size's estimate (a larger stream never costs less:
        read cheaper than a plain decode its steps corrected, a verify would look free and be chosen at
        every size not corrected yet)."""
        seconds = self._optimistic_at.get(n)
        if seconds is None:  # (the speed factor multiplies every size alike, so the table's part is kept)
            lo, hi = self._corrected_span
            seconds = self.shape_seconds(n)
            if not lo <= n <= hi:
                seconds *= 1.0 - self.uncertainty
                if n > hi >= lo:
                    seconds = max(seconds, self.shape_seconds(hi))
            self._optimistic_at[n] = seconds
        return self.scale * seconds

    def shape_seconds(self, n: int) -> float:
        """The corrected shape at ``n`` (interpolated; beyond the table, its last segment's slope)."""
        seconds = self._shape_at.get(n)
        if seconds is None:
            seconds = self._shape_at[n] = _interpolate(*self._table, n)
        return seconds

    def measured_seconds(self, n: int) -> float:
        """The shape at ``n`` as measured at start-up."""
        return _interpolate(self.sizes, self.shape, n)

    def observe(self, n: int, seconds: float) -> None:
        """Fold a step of ``n`` stream tokens that took ``seconds`` into the speed factor and ``n``'s correction."""
        expected = self.measured_seconds(n) if n >= 1 else 0.0
        if expected <= 0 or seconds <= 0:
            return
        self._ratios.append(seconds / expected)
        self.scale = median(self._ratios)
        relative = self._relative.setdefault(n, deque(maxlen=self.window))
        relative.append(seconds / expected / self.scale)
        if len(relative) >= self.min_observations:
            correction, now = median(relative), self.corrections.get(n)
            if now is None or abs(correction - now) > self.resolution * now:
                self.corrections[n] = correction
                self._table = self._corrected_table()
                self._corrected_span = (min(self.corrections), max(self.corrections))
                self._shape_at.clear()
                self._optimistic_at.clear()

    def _corrected_table(self) -> tuple[list[int], list[float]]:
        """The measured shape times the corrections, on the measured and the corrected sizes, non-decreasing."""
        observed = sorted(self.corrections)
        factors = [self.corrections[n] for n in observed]
        sizes = sorted(set(self.sizes) | set(observed))
        return sizes, non_decreasing([self.measured_seconds(n) * _interpolate(observed, factors, n, extend=False)
                                      for n in sizes])

    def as_dict(self) -> dict[int, float]:
        """The current estimate at each measured size."""
        return {n: self(n) for n in self.sizes}

    def save(self, path) -> None:
        """Write the measured shape as JSON (atomically)."""
        write_json(path, {str(n): s for n, s in zip(self.sizes, self.shape)})

    @classmethod
    def load(cls, path) -> "ForwardCost | None":
        """A table :meth:`save` wrote, or None (missing or unreadable)."""
        data = read_json(path)
        try:
            return cls({int(n): float(s) for n, s in data.items()})
        except (ValueError, TypeError, AttributeError):
            return None


def _interpolate(sizes: Sequence[int], values: Sequence[float], n: int, extend: bool = True) -> float:
    """A piecewise-linear table at ``n``: below it, its first value; beyond it, its last segment's slope
    (a lone point: proportional to the size), or with ``extend`` off its last value."""
    i = bisect_left(sizes, n)
    if i < len(sizes) and sizes[i] == n:
        return values[i]
    if i == 0:
        return values[0]
    if i == len(sizes):
        if not extend:
            return values[-1]
        if len(sizes) == 1:
            return values[-1] * n / sizes[-1]
        slope = (values[-1] - values[-2]) / (sizes[-1] - sizes[-2])
        return values[-1] + slope * (n - sizes[-1])
    lo, hi = sizes[i - 1], sizes[i]
    return values[i - 1] + (values[i] - values[i - 1]) * (n - lo) / (hi - lo)


def non_decreasing(values: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators)."""
    pools: list[list[float]] = []  # [sum, count] of each pool, their means increasing
    for v in values:
        pools.append([v, 1])
        while len(pools) > 1 and pools[-2][0] * pools[-1][1] > pools[-1][0] * pools[-2][1]:
            total, count = pools.pop()
            pools[-1][0] += total
            pools[-1][1] += count
    return [total / count for total, count in pools for _ in range(int(count))]


def measure_forward_cost(run: Callable[[int], None], sizes: Sequence[int], repeats: int = 7) -> ForwardCost:
    """Time ``run(n)`` (one target forward of ``n`` stream tokens) for each size: one warm-up call each,
    then ``repeats`` rounds over all the sizes, keeping each size's best. Rounds, not one size's repeats
    in a row: a slow spell of the machine then slows a round, not the sizes measured during it, which
    would bend the shape for good (:class:`ForwardCost` learns only the overall speed). Seven rounds,
    not three: three read 3 and 4 tokens of one static graph 14% and 20% dearer than 2 on one build,
    and in a simulation of slow spells (``benchmarks/simulate_cost_timing.py``: 30% of the time 1.4x
    slow, 3% timing noise) their shape was 27% off in one build of ten, seven rounds' 3%. The median
    ratio of each size to a 1-token forward run just before it did worse than seven rounds' best in
    every spell model simulated: both of its timings carry noise."""
    for n in sizes:
        run(n)
    best = dict.fromkeys(sizes, float("inf"))
    for _ in range(repeats):
        for n in sizes:
            t0 = time.perf_counter()
            run(n)
            best[n] = min(best[n], time.perf_counter() - t0)
    return ForwardCost(best)


#: stream sizes up to this are each measured (see cost_sizes)
ONE_BY_ONE = 12


def cost_sizes(max_stream: int, buckets: Sequence[int] = ()) -> list[int]:
    """Stream sizes worth measuring up to ``max_stream``: each up to :data:`ONE_BY_ONE`, each bucket and
    the size after it (where the cost jumps), then a geometric grid. Small sizes one by one, because
    the CPU linears' cost steps at their register tiles' edges (the panel kernel's 6 rows with
    AVX-512; on an Intel Xeon, decode-shaped steps of 4 sequences: 26.6 ms at 4 tokens, 27.7 at 5,
    28.8 at 6, 31.8 at 7): a line from 4 to 7 read 6 tokens 13% dearer than 4 where they are 8%, and
    at batch 4 the controller weighs exactly those one- and two-token additions."""
    sizes = set(range(1, min(max_stream, ONE_BY_ONE) + 1))
    for b in buckets:
        sizes.update((b, b + 1))
    n = ONE_BY_ONE
    while n < max_stream:
        n = int(n * 1.5) + 1
        sizes.add(min(n, max_stream))
    sizes.add(max_stream)
    return sorted(s for s in sizes if 1 <= s <= max_stream)
