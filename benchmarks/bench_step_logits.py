"""Host time to turn one step's logits into tokens: every row brought whole and decided row by row (the path
before runtime/step_logits.py), against step_logits (tokens picked where the logits are: NumPy's argmax on the
CPU, a sampled row drawn only when verification reaches it).

    .venv/bin/python benchmarks/bench_step_logits.py [--batch 4] [--vocab 49152] [--ks 0,2,4] [--device cpu]

Each sequence of the batch verifies ``k`` drafts that the target rejects at the first (the common case on chat);
``k = 0`` is a plain decode step. Prints the median microseconds per step of each path, greedy and sampled.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from common import cpu_description, format_table  # noqa: E402
from specgraph.runtime.proposers.base import Draft  # noqa: E402
from specgraph.runtime.rejection import accept_matching, verify_greedy, verify_sampling  # noqa: E402
from specgraph.runtime.sampling import PositionNoise, SamplingParams, probabilities, sample  # noqa: E402
from specgraph.runtime.step_logits import RowsWanted, host_rows  # noqa: E402


def median_us(run, repeats: int, sync) -> float:
    run()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2's by default")
    parser.add_argument("--ks", default="0,2,4", help="drafts verified per sequence (0: a plain decode step)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"# bench_step_logits: {cpu_description()}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"device {device}; batch {args.batch}, vocab {args.vocab}", flush=True)
    g = torch.Generator().manual_seed(0)
    noise, position = PositionNoise(1), 5
    rows_out = []
    for temperature in (0.0, 0.8):
        params = SamplingParams(temperature=temperature)
        for k in (int(x) for x in args.ks.split(",")):
            n = k + 1
            logits = (torch.randn(args.batch * n, args.vocab, generator=g) * 3).to(device)
            drafts = [Draft(torch.randint(args.vocab, (k,), generator=g).tolist()) for _ in range(args.batch)]

            def whole_rows():  # every row to the host, then each decided there
                on_host, out = logits.cpu(), []
                for i, d in enumerate(drafts):
                    mine = on_host[i * n:(i + 1) * n]
                    if k == 0:
                        out.append([sample(mine[0], params, noise, position)])
                    elif params.greedy:
                        out.append(verify_greedy(d.token_ids, mine))
                    else:
                        out.append(verify_sampling(d.token_ids, None, probabilities(mine, params),
                                                   noise.draws(position, n), noise.coins(position, k)))
                return out

            def tokens_only():
                wanted = [RowsWanted(n, params, [] if params.greedy else noise.draws(position, n))
                          for _ in drafts]
                return [accept_matching(d.token_ids, t.token) for t, d in zip(host_rows(logits, wanted), drafts)]

            if params.greedy or device.type == "cpu":  # (a draw on a device may round differently, that rarely)
                assert whole_rows() == tokens_only(), "the two paths disagree"
            before, after = median_us(whole_rows, args.repeats, sync), median_us(tokens_only, args.repeats, sync)
            rows_out.append(["greedy" if params.greedy else f"t{temperature}", str(k), f"{before:.0f}", f"{after:.0f}",
                             f"{before / after:.1f}x"])
    print(format_table(["sampling", "k", "whole rows (us)", "step_logits (us)", "faster"], rows_out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
