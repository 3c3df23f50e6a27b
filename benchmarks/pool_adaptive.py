"""Pool several ``bench_adaptive.py --json`` runs of the same workload into one verdict.

    python benchmarks/pool_adaptive.py run1.json run2.json [...]

One run's three rounds give each class 24 pairs (unit, round) of adaptive against a fixed setting,
and its interval mostly sees the noise within that run; separate runs (another hour, another engine
build, its cost table measured again) add what differs between runs. The runs' rounds are pooled per
unit: the best fixed setting of a class is the one with the least class time (each unit's fastest
run over every round), and adaptive's paired speed-up over it is the geometric mean over all pairs,
with a 90% bootstrap interval; "held out" chooses that setting without the round it is compared in.
Pool only runs of the same code: the JSON does not say which commit made it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_adaptive import fmt_interval, geometric_mean_interval, held_out_best_speedup  # noqa: E402
from common import format_table  # noqa: E402


def pooled_seconds(reports: list[dict]) -> dict[str, dict[str, list[list[float]]]]:
    """``class -> setting -> unit -> seconds of each round``, every report's rounds one after another."""
    first = reports[0]
    for r in reports[1:]:
        for key in ("prompt_set", "new_tokens", "proposers", "ks", "device"):
            mine, theirs = (report["config"].get(key, "cpu") for report in (r, first))  # (older runs: CPU)
            if mine != theirs:
                raise ValueError(f"runs differ in {key}: {theirs} vs {mine}")
        if r["classes"] != first["classes"] or any(set(r["seconds"][c]) != set(first["seconds"][c])
                                                   for c in first["classes"]):
            raise ValueError("runs differ in their classes or settings")
    return {c: {label: [sum((r["seconds"][c][label][u] for r in reports), []) for u in range(len(units))]
                for label, units in first["seconds"][c].items()} for c in first["classes"]}


def paired(seconds: dict[str, list[list[float]]], fast: str, slow: str) -> tuple[float, float, float]:
    return geometric_mean_interval([math.log(s / f) for fu, su in zip(seconds[fast], seconds[slow])
                                    for f, s in zip(fu, su)])


def class_time(units: list[list[float]]) -> float:
    return sum(min(rounds) for rounds in units)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", help="bench_adaptive.py --json files of the same workload")
    args = parser.parse_args(argv)
    reports = [json.loads(Path(path).read_text()) for path in args.reports]
    pooled = pooled_seconds(reports)
    rounds = sum(r["config"]["repeats"] for r in reports)
    rows, mix = [], {}
    for c, seconds in pooled.items():
        adaptive = [label for label in seconds if label.endswith(" adaptive")]
        fixed = [label for label in seconds if not label.endswith(" adaptive")]
        for label in seconds:
            mix[label] = mix.get(label, 0.0) + class_time(seconds[label])
        best = min(fixed, key=lambda label: class_time(seconds[label]))
        for a in adaptive:
            rows.append([a, c, best, fmt_interval(paired(seconds, a, best)),
                         fmt_interval(held_out_best_speedup(seconds, a, fixed)),
                         fmt_interval(paired(seconds, a, "none"))])
    best_mix = min((label for label in mix if not label.endswith(" adaptive")), key=mix.get)
    print(f"# {len(reports)} runs pooled, {rounds} rounds; CPUs: " + "; ".join(sorted({r['cpu'] for r in reports})))
    print(format_table(["setting", "class", "best fixed (pooled)", "vs best fixed", "held out", "vs none"], rows,
                       right={3, 4, 5}))
    for a in (label for label in mix if label.endswith(" adaptive")):
        print(f"mix (class times, each unit's fastest run): {a} {mix[best_mix] / mix[a]:.3f}x the best fixed "
              f"({best_mix}), {mix['none'] / mix[a]:.3f}x none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
