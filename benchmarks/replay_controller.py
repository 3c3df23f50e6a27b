"""Replay recorded generations through the speculation controller under a fixed cost model: a
noise-free comparison of its decisions with fixed draft lengths (n-gram drafts).

    python benchmarks/replay_controller.py --record /tmp/records.json   # generate once (about 10 minutes)
    python benchmarks/replay_controller.py --replay /tmp/records.json --costs "1:22.6,4:28.5,8:32,16:48,32:61"

Wall-clock benchmarks on a shared 2-core VM swing 5-10% between rounds, more than most controller
changes move; this isolates the decisions. ``--record`` generates ``--new-tokens`` tokens (EOS
suppressed) for the tuning prompts plus ``REPLAY_*_PROMPTS`` (never the held-out ones), greedy and at
temperature 0.8. ``--replay`` runs each class (code/chat x batch 1/4 x greedy/t0.8) under: no
speculation, fixed k, and the real :class:`SpeculationController` fed the same plan / shadow /
observe calls as ``runtime/drafting.py``, with a true cost per stream size (``--costs``: ms at each
bucket's largest size, steps in between). The machine's speed drifts as a shared VM's does: slow
periods (``--slow``: the share of steps in them, ``--slow-factor`` their cost, ``--period`` their mean
length in steps) cost every policy real time; the controller's build-time table is measured with
noise (``--table-noise``), and the costs it observes carry log-normal noise and occasional pauses. A draft's accepted prefix is its match with the recorded tokens: exactly what
greedy verification keeps, and under sampling a one-hot draft token matches with the target's
probability of it, as rejection sampling accepts it. Printed: tokens per modelled second.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import chat_prompt_ids, fmt, format_table  # noqa: E402
from prompts import CHAT_PROMPTS, CODE_PROMPTS, REPLAY_CHAT_PROMPTS, REPLAY_CODE_PROMPTS  # noqa: E402


def record(path: str, new_tokens: int) -> None:
    import torch

    import specgraph

    torch.set_num_threads(2)
    model, tok = specgraph.load_model("smollm2-135m-instruct")
    model.eval()
    out = []
    for group, texts in (("code", CODE_PROMPTS + REPLAY_CODE_PROMPTS), ("chat", CHAT_PROMPTS + REPLAY_CHAT_PROMPTS)):
        for text in texts:
            ids = chat_prompt_ids(tok, text)
            for temp in (0.0, 0.8):
                torch.manual_seed(0)
                sampling = dict(do_sample=True, temperature=temp, top_k=0, top_p=1.0) if temp else dict(do_sample=False)
                with torch.no_grad():
                    g = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                       pad_token_id=tok.eos_token_id, **sampling)
                out.append({"group": group, "temp": temp, "prompt": ids, "output": g[0, len(ids):].tolist()})
                print(f"recorded {group} t{temp}: {len(out)}", flush=True)
    Path(path).write_text(json.dumps(out))


def step_cost(buckets: dict[int, float], n: int) -> float:
    """Seconds of a forward of ``n`` stream tokens: the cost of the smallest bucket that holds it."""
    for size in sorted(buckets):
        if n <= size:
            return buckets[size]
    return buckets[max(buckets)] * n / max(buckets)


class Machine:
    """A VM's speed over steps: normal, or slow by ``factor`` for periods of ``period`` steps on average,
    ``share`` of the steps in all (a two-state Markov chain, seeded)."""

    def __init__(self, share: float, factor: float, period: float, seed: int):
        self.rng, self.factor, self.slow = random.Random(seed), factor, False
        self.leave = 1.0 / max(period, 1.0)
        self.enter = self.leave * share / (1.0 - share) if 0 < share < 1 else 0.0

    def step(self) -> float:
        if self.rng.random() < (self.leave if self.slow else self.enter):
            self.slow = not self.slow
        return self.factor if self.slow else 1.0


def replay(records: list[dict], batch: int, policy, buckets: dict[int, float], max_drafts: int, new_tokens: int,
           drain: bool, noise: float, pauses: float, slow: float = 0.0, slow_factor: float = 1.0,
           period: float = 60.0, table_noise: float = 0.0, seed: int = 0) -> float:
    """Tokens per modelled second of one class under ``policy`` ("none", a fixed k, or "adaptive")."""
    from specgraph.runtime.controller import ForwardCost, SpeculationController, cost_sizes
    from specgraph.runtime.proposers.ngram import NgramProposer

    rng, ngram = random.Random(seed), NgramProposer()
    machine = Machine(slow, slow_factor, period, seed + 1)
    seconds = tokens = 0.0
    for start in range(0, len(records), batch):
        ctl = None
        if policy == "adaptive":  # measured at build (with noise, at that moment's speed), then learned from steps
            sizes = cost_sizes(batch * (1 + max_drafts), sorted(buckets))
            table = {n: step_cost(buckets, n) * machine.step() * math.exp(rng.gauss(0.0, table_noise)) for n in sizes}
            ctl = SpeculationController(max_drafts, ForwardCost(table))
        seqs = [{"id": i, "ids": list(r["prompt"]), "truth": r["output"][:new_tokens], "n": 0}
                for i, r in enumerate(records[start:start + batch])]
        while live := [s for s in seqs if s["n"] < new_tokens]:
            caps = [min(max_drafts, new_tokens - s["n"] - 1) for s in live]
            drafts = {}
            if policy == "adaptive":  # runtime/drafting.py's calls, in its order
                ids = [s["id"] for s in live]
                remaining = [new_tokens - s["n"] for s in live] if drain else None
                ks = ctl.plan(ids, caps, 0, probe=False, remaining=remaining)
                for s, k, cap in zip(live, ks, caps):
                    if k > 0:
                        drafts[s["id"]] = ngram.lookup(s["ids"], k)
                    elif cap > 0 and ctl.wants_shadow(s["id"]):
                        ctl.shadow(s["id"], len(s["ids"]), ngram.lookup(s["ids"], cap))
                got = [len(drafts.get(i, [])) for i in ids]
                keep = ctl.plan(ids, got, 0, drafting_cost=False, floors=[0] * len(ids), remaining=remaining)
                drafts = {i: drafts[i][:k] for i, k in zip(ids, keep) if i in drafts}
            elif policy != "none":
                drafts = {s["id"]: ngram.lookup(s["ids"], min(policy, cap)) for s, cap in zip(live, caps)}
            stream = 0
            for s in live:
                d, truth = drafts.get(s["id"], []), s["truth"][s["n"]:]
                accepted = 0
                while accepted < min(len(d), len(truth) - 1) and d[accepted] == truth[accepted]:
                    accepted += 1
                s["ids"] += truth[:accepted + 1]
                s["n"] += accepted + 1
                stream += 1 + len(d)
                if ctl is not None:
                    ctl.observe_decode(s["id"], len(d), accepted)
                    if ctl.has_shadow(s["id"]):
                        ctl.score_shadow(s["id"], s["ids"])
            cost = step_cost(buckets, stream) * machine.step()
            seconds += cost
            if ctl is not None:
                seen = cost * math.exp(rng.gauss(0.0, noise)) * (2.5 if rng.random() < pauses else 1.0)
                ctl.observe_forward(stream, seen)
        tokens += sum(s["n"] for s in seqs)
    return tokens / seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--record", metavar="PATH")
    p.add_argument("--replay", metavar="PATH")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--costs", default="1:22.6,4:28.5,8:32,16:48,32:61", help="bucket:ms,... (a forward's cost)")
    p.add_argument("--ks", default="2,4,6")
    p.add_argument("--noise", type=float, default=0.1, help="log-normal sigma of the observed costs")
    p.add_argument("--pauses", type=float, default=0.05, help="share of observed steps 2.5x slow")
    p.add_argument("--slow", type=float, default=0.3, help="share of steps in slow periods")
    p.add_argument("--slow-factor", type=float, default=1.4, help="a slow period's cost, times normal")
    p.add_argument("--period", type=float, default=60, help="mean length of a slow period, in steps")
    p.add_argument("--table-noise", type=float, default=0.03,
                   help="log-normal sigma of the build-time table (best of 3 rounds)")
    p.add_argument("--seeds", type=int, default=5, help="noise seeds per cell (the rate is their mean)")
    args = p.parse_args(argv)
    if args.record:
        record(args.record, max(args.new_tokens, 128))
    if not args.replay:
        return 0
    records = json.loads(Path(args.replay).read_text())
    buckets = {int(b): float(ms) / 1000 for b, ms in (x.split(":") for x in args.costs.split(","))}
    ks = [int(k) for k in args.ks.split(",")]
    columns = ["none"] + [f"k={k}" for k in ks] + ["adaptive (throughput)", "adaptive"]
    rows = []
    for group in ("code", "chat"):
        for batch in (1, 4):
            for temp in (0.0, 0.8):
                recs = [r for r in records if r["group"] == group and r["temp"] == temp]
                common = dict(buckets=buckets, max_drafts=max(ks), new_tokens=args.new_tokens, noise=args.noise,
                              pauses=args.pauses, slow=args.slow, slow_factor=args.slow_factor, period=args.period,
                              table_noise=args.table_noise)

                def rate(policy, drain=False):
                    return sum(replay(recs, batch, policy, drain=drain, seed=s, **common)
                               for s in range(args.seeds)) / args.seeds

                rates = [rate("none")] + [rate(k) for k in ks] + [rate("adaptive", d) for d in (False, True)]
                best = max(rates[:-2])
                rows.append([f"{group} b{batch} t{temp}"] + [fmt(r) for r in rates]
                            + [fmt(rates[-1] / best, ".3f"), fmt(rates[-1] / rates[0], ".3f")])
    print(f"# replay: costs {args.costs} ms, noise {args.noise}, pauses {args.pauses}, slow {args.slow} "
          f"x{args.slow_factor} for ~{args.period} steps, table noise {args.table_noise}, {args.new_tokens} tokens, {args.seeds} seeds")
    print(format_table(["class"] + columns + ["vs best fixed", "vs none"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
