"""benchmarks/bench_adaptive.py: the held-out choice of the best fixed setting (no model)."""
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_adaptive import held_out_best_speedup, paired_speedup, token_mismatches  # noqa: E402


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


def test_pooled_runs_put_each_units_rounds_one_after_another_and_refuse_other_workloads():
    from pool_adaptive import pooled_seconds

    def report(seconds, repeats=2, prompt_set="heldout"):
        return dict(config=dict(prompt_set=prompt_set, new_tokens=64, proposers=["ngram"], ks=[2], repeats=repeats),
                    cpu="cpu", classes=["code b1 greedy"], seconds={"code b1 greedy": seconds})

    a = report({"none": [[2.0, 2.0]], "ngram k=2": [[1.0, 3.0]], "ngram adaptive": [[1.5, 1.5]]})
    b = report({"none": [[2.0, 2.0]], "ngram k=2": [[3.0, 3.0]], "ngram adaptive": [[1.0, 1.0]]})
    pooled = pooled_seconds([a, b])
    assert pooled["code b1 greedy"]["ngram k=2"] == [[1.0, 3.0, 3.0, 3.0]]
    assert pooled["code b1 greedy"]["ngram adaptive"] == [[1.5, 1.5, 1.0, 1.0]]
    with pytest.raises(ValueError, match="prompt_set"):
        pooled_seconds([a, report(b["seconds"]["code b1 greedy"], prompt_set="benchmark")])


def test_the_pooled_verdict_is_printed_per_class_and_over_the_mix(tmp_path, capsys):
    import json

    from pool_adaptive import main

    seconds = {"none": [[2.0, 2.0]], "ngram k=2": [[1.0, 1.0]], "ngram adaptive": [[1.0, 1.0]]}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(dict(config=dict(prompt_set="heldout", new_tokens=64, proposers=["ngram"], ks=[2],
                                                repeats=2), cpu="cpu", classes=["code b1 greedy"],
                                    seconds={"code b1 greedy": seconds})))
    assert main([str(path), str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 runs pooled, 4 rounds" in out and "1.00 [1.00-1.00]" in out and "2.00 [2.00-2.00]" in out
    assert "1.000x the best fixed (ngram k=2), 2.000x none" in out


def test_token_mismatches_are_found_in_every_run_and_located():
    run = lambda *outputs: dict(outputs=[list(o) for o in outputs])  # noqa: E731
    reference = [[run([1, 2, 3], [4, 5]), run([1, 2, 3], [4, 5])], [run([7, 8])]]
    same = [[run([1, 2, 3], [4, 5]), run([1, 2, 3], [4, 5])], [run([7, 8])]]
    assert token_mismatches(same, reference) == []
    differing = [[run([1, 2, 3], [4, 5]), run([1, 2, 3], [4, 6])], [run([9, 8])]]
    assert token_mismatches(differing, reference) == ["unit 0 run 1 sequence 1 token 1", "unit 1 run 0 sequence 0 token 0"]


def test_runs_made_on_different_devices_are_not_pooled():
    """pool_adaptive pools rounds of runs that timed the same work; a GPU run beside a CPU run is refused by
    name (a run from before --device existed counts as a CPU run)."""
    from pool_adaptive import pooled_seconds

    def report(**config):
        base = dict(prompt_set="heldout", new_tokens=64, proposers=["ngram"], ks=[2])
        return dict(config={**base, **config}, classes=["chat b4 greedy"],
                    seconds={"chat b4 greedy": {"none": [[1.0]], "ngram adaptive": [[1.0]]}})

    assert pooled_seconds([report(), report(device="cpu")])["chat b4 greedy"]["none"] == [[1.0, 1.0]]
    with pytest.raises(ValueError, match="device"):
        pooled_seconds([report(), report(device="cuda")])
