"""What a step's tokens are worth when the batch drains: the seconds they cut from finishing it.

When no request waits and a step has no prefill, its decodes are all the work left, and the
controller (``runtime/controller.py``) values a plan by how much sooner the batch ends. ``costs[j]`` is
a plain decode step of ``j`` sequences (``costs[0] = 0``), from the controller's forward cost.
"""
from __future__ import annotations

from typing import Sequence


def finish_seconds(left: Sequence[float], costs: Sequence[float]) -> float:
    """Seconds plain decoding takes to give each sequence its ``left`` tokens: ``sum_j (r_(j) - r_(j-1)) *
    c(n - j + 1)`` over ``left`` sorted ascending (the batch shrinks as sequences end)."""
    total, before, n = 0.0, 0.0, len(left)
    for j, x in enumerate(sorted(left)):
        if x > before:  # (a sequence past its end needs nothing)
            total, before = total + (x - before) * costs[n - j], x
    return total


def expected_saving(remaining: Sequence[int], gains: Sequence[Sequence[float]], costs: Sequence[float]) -> float:
    """The seconds a draining step cuts from finishing the batch, over its outcomes rather than at each
    sequence's expected tokens.

    ``gains[i]``: sequence i's drafts' gains, so it emits ``1 + x`` tokens with ``P(x >= j) = gains[i][j - 1]``;
    sequences are taken as independent. The batch is done when its slowest sequence is, so reading expected
    tokens overstates a plan that drafts for all of them: four sequences each expected to gain 2.8 tokens
    finish no sooner when one of them gains none. Plain decoding takes ``T(r) = sum over levels l >= 0 of
    c(N(l))`` seconds, with ``N(l)`` the sequences with more than ``l`` tokens left; after the step this sums
    ``E[c(N(l))]``: exactly (a Poisson-binomial count) at the levels where some sequence may or may not be
    done, and as ``c(N)`` times their number over the stretches of levels where none is in doubt."""
    n = len(remaining)
    first_doubt = [r - len(g) - 1 for r, g in zip(remaining, gains)]  # levels first_doubt..r-2 are in doubt

    def running(i: int, level: int) -> float:  # P(sequence i has more than `level` tokens left after the step)
        m = remaining[i] - level  # it stays running unless it emits at least m tokens
        return 0.0 if m <= 1 else 1.0 - (gains[i][m - 2] if m - 2 < len(gains[i]) else 0.0)

    edges = sorted({0} | {max(0, d) for d in first_doubt} | {max(0, r - 1) for r in remaining})
    after = 0.0
    for start, end in zip(edges, edges[1:]):
        if not any(d <= start <= r - 2 for d, r in zip(first_doubt, remaining)):  # nothing in doubt here
            count = sum(start < d for d in first_doubt)  # surely running: before their levels in doubt
            after += (end - start) * costs[count]
            continue
        for level in range(start, end):
            dist = [1.0]  # P(N = j) over the sequences taken so far
            for i in range(n):
                p = running(i, level)
                dist = [a * (1 - p) + b * p for a, b in zip(dist + [0.0], [0.0] + dist)]
            after += sum(q * costs[j] for j, q in enumerate(dist) if j and q)
    return finish_seconds(remaining, costs) - after
