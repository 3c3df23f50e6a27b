"""Replay recorded generations through the speculation controller under a modelled cost: its
decisions against fixed draft lengths (n-gram drafts), with the noise under control.

    python benchmarks/replay_controller.py --record /tmp/records.json   # generate once (about 10 minutes)
    python benchmarks/replay_controller.py --replay /tmp/records.json --costs "1:22.6,4:28.5,8:32,16:48,32:61"

Wall-clock benchmarks on a shared 2-core VM swing 5-10% between rounds, more than most controller
changes move; this isolates the decisions. ``--record`` generates ``--new-tokens`` tokens (EOS
suppressed) for the tuning prompts plus ``REPLAY_*_PROMPTS`` (never the held-out ones), greedy and at
temperature 0.8. ``--replay`` runs each class (code/chat x batch 1/4 x greedy/t0.8) under: no
speculation, fixed k, and the controller, each through the engine's own drafting code
(``runtime/drafting.py``'s Speculation with the n-gram proposer). Only the target is modelled: a
forward costs ``--costs`` (ms at each bucket's largest size, steps in between), and a draft keeps
its match with the recorded tokens: exactly what verification keeps, greedy or sampled (the engine
keeps a deterministic draft while it equals the target's own draw, and a recorded sample stands for
those draws).
The machine's speed drifts as a shared VM's does: slow periods (``--slow``: the share of steps in
them, ``--slow-factor`` their cost, ``--period`` their mean length in steps) cost every policy real
time; the controller's build-time table is measured with noise (``--table-noise``), and the costs
it observes carry log-normal noise and occasional pauses. Printed: tokens per modelled second, the
mean over ``--seeds`` noise seeds.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import chat_prompt_ids, cpu_description, fmt, format_table  # noqa: E402
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
           period: float = 60.0, table_noise: float = 0.0, seed: int = 0, host: list | None = None) -> float:
    """Tokens per modelled second of one class under ``policy`` ("none", a fixed k, or "adaptive").

    The engine's own :class:`~specgraph.runtime.drafting.Speculation` drafts (n-gram lookup, cache slots
    reserved and given back in a real :class:`KVCacheManager`), so the controller sees exactly the calls
    a generation makes; only the target is replaced: a draft keeps its match with the recorded tokens,
    and a forward costs its modelled seconds. One Speculation serves the class's batches, its acceptance
    forgotten before each (as bench_adaptive does), its cost table measured once. ``host``: given a list,
    the real seconds spent in the Speculation's calls (drafting, the controller, its observations) and the
    number of steps are appended to it: that host work is not in the modelled rate, and on a GPU, where a
    step takes 2-4 ms, it is part of the step."""
    from specgraph.runtime.forward_cost import ForwardCost, cost_sizes
    from specgraph.runtime.drafting import Speculation
    from specgraph.runtime.kv_manager import KVCacheManager
    from specgraph.runtime.proposers.ngram import NgramProposer
    from specgraph.runtime.sampling import SamplingParams
    from specgraph.runtime.scheduler import Request, ScheduledChunk

    rng, machine = random.Random(seed), Machine(slow, slow_factor, period, seed + 1)
    page = 16
    kv = KVCacheManager(batch * (-(-(max(len(r["prompt"]) for r in records) + new_tokens) // page) + 2), page,
                        enable_prefix_caching=False)

    def measure():  # at build: the true costs at that moment's speed, with noise
        sizes = cost_sizes(batch * (1 + max_drafts), sorted(buckets))
        speed = machine.step()
        return ForwardCost({n: step_cost(buckets, n) * speed * math.exp(rng.gauss(0.0, table_noise)) for n in sizes})

    spec = None
    if policy != "none":
        spec = Speculation(NgramProposer(), max_drafts if policy == "adaptive" else policy, policy == "adaptive",
                           kv, lambda copies: None, measure)
    seconds = tokens = host_s = 0.0
    steps = 0
    for start in range(0, len(records), batch):
        group = records[start:start + batch]
        requests = [Request(start + i, list(r["prompt"]), new_tokens, SamplingParams(temperature=r["temp"]))
                    for i, r in enumerate(group)]
        truths = {r.request_id: g["output"][:new_tokens] for r, g in zip(requests, group)}
        if spec is not None and spec.ready_controller() is not None:
            spec.controller.forget_acceptance()
        for r in requests:  # prefilled (not modelled): the prompt cached but its last token, fed by step 1
            kv.add_sequence(r.request_id, [])
            kv.allocate(r.request_id, len(r.prompt_ids) - 1)
            r.num_computed = len(r.prompt_ids) - 1
        while live := [r for r in requests if len(r.output_ids) < new_tokens]:
            for r in live:  # the last token is fed this step
                kv.allocate(r.request_id, 1)
            chunks = [ScheduledChunk(r, len(r.all_ids) - 1, 1) for r in live]
            t0 = time.perf_counter()
            drafts = spec.draft(chunks, draining=drain) if spec is not None else {}
            host_s, steps = host_s + time.perf_counter() - t0, steps + 1
            stream = 0
            for r in live:
                d = drafts.get(r.request_id)
                proposed = d.token_ids if d is not None else []
                truth = truths[r.request_id][len(r.output_ids):]
                accepted = 0
                while accepted < min(len(proposed), len(truth) - 1) and proposed[accepted] == truth[accepted]:
                    accepted += 1
                r.output_ids += truth[:accepted + 1]
                r.num_computed = len(r.all_ids) - 1
                kv.truncate(r.request_id, r.num_computed)
                stream += 1 + len(proposed)
                done = len(r.output_ids) >= new_tokens
                if spec is not None:
                    t0 = time.perf_counter()
                    spec.observe_decode(r, d, list(range(1, accepted + 1)))
                    if done:
                        spec.forget(r)
                    host_s += time.perf_counter() - t0
                if done:
                    kv.free(r.request_id)
            cost = step_cost(buckets, stream) * machine.step()
            seconds += cost
            if spec is not None:
                observed = cost * math.exp(rng.gauss(0.0, noise)) * (2.5 if rng.random() < pauses else 1.0)
                t0 = time.perf_counter()
                spec.observe_forward(stream, observed)
                host_s += time.perf_counter() - t0
        tokens += sum(len(r.output_ids) for r in requests)
    if host is not None:
        host.append((host_s, steps))
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
    rows, host_rows = [], []
    for group in ("code", "chat"):
        for batch in (1, 4):
            for temp in (0.0, 0.8):
                recs = [r for r in records if r["group"] == group and r["temp"] == temp]
                common = dict(buckets=buckets, max_drafts=max(ks), new_tokens=args.new_tokens, noise=args.noise,
                              pauses=args.pauses, slow=args.slow, slow_factor=args.slow_factor, period=args.period,
                              table_noise=args.table_noise)

                def rate(policy, drain=False, host=None):
                    return sum(replay(recs, batch, policy, drain=drain, seed=s, host=host, **common)
                               for s in range(args.seeds)) / args.seeds

                host = {k: [] for k in ks + ["adaptive"]}
                rates = ([rate("none")] + [rate(k, host=host[k]) for k in ks]
                         + [rate("adaptive", d, host["adaptive"] if d else None) for d in (False, True)])
                best = max(rates[:-2])
                rows.append([f"{group} b{batch} t{temp}"] + [fmt(r) for r in rates]
                            + [fmt(rates[-1] / best, ".3f"), fmt(rates[-1] / rates[0], ".3f")])
                per_step = {k: 1e6 * min(h / n for h, n in runs) for k, runs in host.items()}  # (the quietest seed)
                host_rows.append([f"{group} b{batch} t{temp}"] + [fmt(per_step[k], ".0f") for k in host])
    print(f"# replay: costs {args.costs} ms, noise {args.noise}, pauses {args.pauses}, slow {args.slow} "
          f"x{args.slow_factor} for ~{args.period} steps, table noise {args.table_noise}, {args.new_tokens} tokens, {args.seeds} seeds")
    print(format_table(["class"] + columns + ["vs best fixed", "vs none"], rows))
    print(f"\nhost us per step in the drafting and controller calls (real time on {cpu_description()}; not in the "
          f"modelled rates above; none: 0; adaptive: the draining value's)")
    print(format_table(["class"] + [f"k={k}" for k in ks] + ["adaptive"], host_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
