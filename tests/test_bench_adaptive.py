"""benchmarks/bench_adaptive.py: the held-out choice of the best fixed setting (no model)."""
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_adaptive import held_out_best_speedup, paired_speedup  # noqa: E402


def test_the_best_fixed_setting_is_chosen_without_the_round_it_is_compared_in():
    """k=2 had one lucky run (round 0): chosen on the same rounds it wins and flatters itself there;
    chosen on the other rounds, round 0 compares adaptive with k=4, and rounds 1-2 with k=2's usual runs."""
    seconds = {"adaptive": [[1.0, 1.0, 1.0]], "k=2": [[0.5, 2.0, 2.0]], "k=4": [[1.2, 1.2, 1.2]]}
    mean, lo, hi = held_out_best_speedup(seconds, "adaptive", ["k=2", "k=4"])
    assert mean == pytest.approx(math.exp((math.log(1.2) + 2 * math.log(2.0)) / 3))
    assert lo <= mean <= hi
    same_rounds = paired_speedup([[{"seconds": s} for s in seconds["adaptive"][0]]],
                                 [[{"seconds": s} for s in seconds["k=2"][0]]])[0]
    assert same_rounds == pytest.approx(math.exp((math.log(0.5) + 2 * math.log(2.0)) / 3))
    assert same_rounds < mean
    with pytest.raises(ValueError, match="two rounds"):
        held_out_best_speedup({"adaptive": [[1.0]], "k=2": [[1.0]]}, "adaptive", ["k=2"])
