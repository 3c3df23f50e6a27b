"""Choosing between alternatives timed on a noisy machine, by their same-round ratios.

The build-time choices (the linears' prefetch distances, ``kernels/prefetch.py``; the wide step buckets
kept and the padded sizes of dynamic steps, ``compiler/inductor.py``) time every alternative once per round, back to back, over several
rounds. A candidate wins over a base only where it is faster by a margin in the median of the per-round
ratios and in most rounds, so that neither a load swing lasting longer than a round nor one quiet moment
decides. (Best-of-rounds times did: on an AMD EPYC with AVX2 one build measured 1 row 20.9 ms with no
prefetch and 16.3 at 32 rows ahead, and another padded 3-token steps to 5 after timing them 31.2 and 28.0 ms,
best of 3, where a 3-token step costs no more than a 5-token one.)
"""
from __future__ import annotations

import statistics


def ratios(times: list[float], base: list[float]) -> list[float]:
    """``times[i] / base[i]`` per round (the two timed in the same round)."""
    return [t / b for t, b in zip(times, base)]


def median_ratio(times: list[float], base: list[float]) -> float:
    return statistics.median(ratios(times, base))


def clearly_faster(times: list[float], base: list[float], margin: float, share: float = 0.8) -> bool:
    """Whether ``times`` beat ``base`` by ``margin`` in the median same-round ratio and in at least ``share``
    of the rounds."""
    r = ratios(times, base)
    return statistics.median(r) <= 1 - margin and sum(x < 1 for x in r) >= share * len(r)
