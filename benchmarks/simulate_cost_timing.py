"""How well two timing rules recover a forward-cost shape on a machine with slow spells (no model).

    python benchmarks/simulate_cost_timing.py

The engine times the target's forward at each stream size when it is built, and the controller
keeps only that shape (it learns the overall speed as it runs), so an error in the shape lasts.
This simulates a shared VM: a two-state chain (slow with probability ``p_slow`` after each switch,
a switch every ``mean_len`` forwards on average, slow forwards ``factor`` times longer) plus
one-sided timing noise (exponential, mean ``jitter``), and compares, over 400 builds per model:

  - ``best of R``: R interleaved rounds over all sizes, each size's fastest run
    (``runtime.forward_cost.measure_forward_cost``, R = 7; 3 before),
  - ``paired median of R``: per round, each size right after a 1-token forward; the median of
    the ratios.

Printed: the median and 90th percentile over builds of the largest relative error of the shape
(cost at n over cost at 1).
"""
from __future__ import annotations

import random
from statistics import median

TRUE = {1: 1.0, 2: 1.13, 3: 1.13, 4: 1.13, 5: 1.5, 7: 1.6, 11: 1.8, 17: 2.2}  # a 1-4 bucketed shape
SIZES = sorted(TRUE)
MODELS = [(0.3, 5, 1.4, 0.03), (0.3, 20, 1.4, 0.03), (0.3, 60, 1.4, 0.03), (0.5, 3, 1.3, 0.05), (0.2, 2, 1.5, 0.08)]


def machine(seed: int, p_slow: float, mean_len: float, factor: float, jitter: float):
    rng, state = random.Random(seed), {"slow": False}

    def run(n: int) -> float:
        if rng.random() < 1.0 / mean_len:
            state["slow"] = rng.random() < p_slow
        return TRUE[n] * (factor if state["slow"] else 1.0) * (1 + rng.expovariate(1 / jitter))
    return run


def best_of_rounds(run, rounds: int) -> dict[int, float]:
    for n in SIZES:  # warm-up
        run(n)
    best = dict.fromkeys(SIZES, float("inf"))
    for _ in range(rounds):
        for n in SIZES:
            best[n] = min(best[n], run(n))
    return best


def paired_median(run, rounds: int) -> dict[int, float]:
    for n in SIZES:
        run(n)
    ratios, ones = {n: [] for n in SIZES}, []
    for r in range(rounds):
        for n in (SIZES if r % 2 == 0 else SIZES[::-1]):
            one = run(1)
            ones.append(one)
            ratios[n].append(1.0 if n == 1 else run(n) / one)
    return {n: median(ones) * median(ratios[n]) for n in SIZES}


def shape_error(est: dict[int, float]) -> float:
    return max(abs(est[n] / est[1] / TRUE[n] - 1) for n in SIZES)


def main() -> None:
    rules = [("best of 3", best_of_rounds, 3), ("best of 7", best_of_rounds, 7),
             ("paired median of 5", paired_median, 5), ("paired median of 7", paired_median, 7)]
    print("p_slow  mean_len  factor  jitter  " + "  ".join(f"{name:>22}" for name, *_ in rules))
    for p_slow, mean_len, factor, jitter in MODELS:
        cells = []
        for name, rule, rounds in rules:
            errs = sorted(shape_error(rule(machine(s, p_slow, mean_len, factor, jitter), rounds)) for s in range(400))
            cells.append(f"{median(errs):.1%} / p90 {errs[int(0.9 * len(errs))]:.1%}")
        print(f"{p_slow:6}  {mean_len:8}  {factor:6}  {jitter:6}  " + "  ".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
