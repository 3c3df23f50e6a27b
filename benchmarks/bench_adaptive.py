"""Adaptive speculation against fixed settings on a mixed workload, in one run.

    python benchmarks/bench_adaptive.py                       # held-out prompts, ngram and layer_skip:8, 3 rounds
    python benchmarks/bench_adaptive.py --proposers ngram --repeats 3   # the latest RESULTS.md run (29 minutes)
    python benchmarks/bench_adaptive.py --prompt-set tuning   # the prompts the controller was checked on
    python benchmarks/bench_adaptive.py --quick               # smoke test: 24 tokens, ngram only, k in {2, 4}
    python benchmarks/bench_adaptive.py --device cuda --proposers ngram --ks 2,4 --profile   # run V (H100)
    python benchmarks/bench_adaptive.py ... --time-budget 480 --json r.json   # within a lease; a report per round

Classes: {code, chat} x {batch 1, batch 4} x {greedy, temperature 0.8}; every class runs 4
prompts (batch 1: one after another; batch 4: one ``generate`` of all 4), ``--new-tokens`` each
with EOS ignored, so every setting makes the same number of tokens. Each generate call (a unit)
runs under every setting back to back, the order rotating from unit to unit, for ``--repeats``
rounds; a batch-4 class (one unit) runs its unit 4 times per round, so every class has as many
runs. A class's time sums each unit's fastest run. Beside that, adaptive is compared with each
fixed setting pair by pair (the two runs of one unit in one round ran back to back): the
geometric mean of their ratios with a 90% bootstrap interval over the pairs, so a verdict can be
told from noise. Settings:
  - ``none``                 no speculation, on an Engine built without a draft,
  - ``P off``                proposer P's Engine with every request's drafts capped at 0: the same
                             engine as P's other rows (step plan, compiled step sizes, cost table
                             measured at its build), so adaptive's ratio to it isolates its decisions
                             from the differences between two separately built engines,
  - ``P k=K``                proposer P drafting K tokens every step (``adaptive=False``),
  - ``P tree T``             proposer P verifying its default tree T every step (kinds with one: eagle,
                             medusa; ``adaptive=False``),
  - ``P adaptive``           the controller choosing 0..max(K) per sequence and step, or, for a kind
                             with a default tree, each step the tree, a chain within its depth or none.
One Engine per proposer (its controller measured when it was built); fixed rows switch the
same Engine's ``adaptive`` off. Settings run interleaved within each class, the order rotating
between units. Before the timed runs, each proposer's engine serves the ``REPLAY_*`` prompts
(code and chat, greedy and sampled) with its controller on, and every run starts from the
engine-wide estimates that left (a served engine's state: what the proposer's drafts of each
evidence class are worth on this model), never from another timed run; the cost table is kept.

Every setting runs a unit with the same seed, and the target draws each sampled position's token
from that position's own uniform, so with n-gram drafts every setting emits the same tokens as
``none``, sampled or greedy (a draft model's sampled drafts change the text, never its
distribution): a class's settings are timed on the same text, and what differs is the forwards
per token and their cost. Every run is checked, not only the fastest, and a difference is located
(unit, run, sequence, token). A verify step runs another compiled step than a plain decode, so a
uniform within rounding of a token's CDF boundary could pick the neighbouring token.

Printed: tok/s per class and over the whole mix (tokens / seconds, summed), the best fixed
setting per class, adaptive's ratio to it and to ``none``, whether tokens equal ``none``'s, and
the controller's decisions (share of decode steps speculated, mean draft length, tokens per
target forward).
"""
from __future__ import annotations

import argparse
import gc
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (chat_prompt_ids, cpu_description, elapsed, fmt, format_table, load_average, log,  # noqa: E402
                    print_report, quiet_torch, write_json)
from prompts import (CHAT_PROMPTS, CODE_PROMPTS, HELDOUT_CHAT_PROMPTS, HELDOUT_CODE_PROMPTS, REPLAY_CHAT_PROMPTS,  # noqa: E402
                     REPLAY_CODE_PROMPTS, WARMUP_PROMPT)

BATCHES = (1, 4)
TEMPERATURES = (0.0, 0.8)
PROMPTS_PER_CLASS = 4


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=None, help="per prompt (default 64; --quick 24)")
    p.add_argument("--proposers", default=None, help="comma list (default ngram,layer_skip:8; --quick ngram)")
    p.add_argument("--ks", default=None, help="fixed draft lengths (default 2,4,6; --quick 2,4)")
    p.add_argument("--prompt-set", choices=("heldout", "tuning"), default="heldout")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each generate call keeps its fastest")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--profile", action="store_true", help="then cProfile one code prompt per setting (host time)")
    p.add_argument("--device", default="cpu", help="where the model runs (cuda: the inductor lowering's CUDA graphs)")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="start no round that would end past S seconds from the start (a lent GPU's lease; the "
                        "last round's time is the estimate) and report the rounds done; with --json the report "
                        "is also written after every round, so a run stopped from outside leaves one")
    args = p.parse_args(argv)
    args.new_tokens = args.new_tokens or (24 if args.quick else 64)
    args.proposers = (args.proposers or ("ngram" if args.quick else "ngram,layer_skip:8")).split(",")
    args.ks = [int(k) for k in (args.ks or ("2,4" if args.quick else "2,4,6")).split(",")]
    return args


def class_prompts(prompt_set: str) -> dict[str, list[str]]:
    code, chat = (HELDOUT_CODE_PROMPTS, HELDOUT_CHAT_PROMPTS) if prompt_set == "heldout" else (CODE_PROMPTS, CHAT_PROMPTS)
    cycle = lambda xs: [xs[i % len(xs)] for i in range(PROMPTS_PER_CLASS)]  # noqa: E731
    return {"code": cycle(code), "chat": cycle(chat)}


def use_setting(engine, adaptive: bool, k: int, tree: str | None) -> None:
    """Switch a draft engine to a setting: adaptive or fixed, its (largest) draft length and tree."""
    engine.adaptive, engine.num_draft_tokens = adaptive, k
    if engine.default_tree is not None:
        engine.draft_tree = tree


def run_unit(engine, adaptive: bool, k: int, tree: str | None, cap: int | None, prompts: list[list[int]],
             temp: float, n: int, seed: int, served: dict | None = None) -> dict:
    """One ``generate`` call (one prompt at batch 1, all of them at batch 4) under one setting; ``cap``
    bounds every request's drafts per step (0: none). The controller starts from ``served`` (its
    engine-wide estimates after :func:`serve_warm_up`), or from its prior."""
    if engine.proposer is not None:
        use_setting(engine, adaptive, k, tree)
        engine.controller.forget_acceptance(served)  # no run learns from another timed run
    engine.reset_stats()
    gc.collect()
    t0 = time.perf_counter()
    res = engine.generate(prompts, max_new_tokens=n, temperature=temp, seed=seed, ignore_eos=True,
                          num_draft_tokens=cap)
    seconds = time.perf_counter() - t0
    s = engine.stats
    return dict(tokens=sum(len(r.token_ids) for r in res), seconds=seconds, outputs=[r.token_ids for r in res],
                decode_forwards=s.get("decode_forwards", 0), emitted=s.get("decode_emitted", 0),
                speculated=s.get("verify_steps", 0), drafted=s.get("draft_tokens", 0), host_s=s.get("host_s", 0.0),
                forward_s=s.get("forward_s", 0.0))


def serve_warm_up(engine, tok, k: int, tree: str | None, n: int) -> dict:
    """The controller's engine-wide estimates after serving the ``REPLAY_*`` prompts (code and chat, greedy
    and sampled, adaptive): the state a served engine starts a request from. Never a timed prompt."""
    use_setting(engine, True, k, tree)
    engine.controller.forget_acceptance()
    prompts = [chat_prompt_ids(tok, t) for t in REPLAY_CODE_PROMPTS + REPLAY_CHAT_PROMPTS]
    for temp in TEMPERATURES:
        engine.generate(prompts, max_new_tokens=n, temperature=temp, seed=0, ignore_eos=True)
    return engine.controller.engine_wide()


def combine(units: list[list[dict]]) -> dict:
    """A class's figures from its units' fastest runs (``units[u]``: unit u's run in each round)."""
    units = [min(rounds, key=lambda r: r["seconds"]) for rounds in units]
    total = {key: sum(u[key] for u in units) for key in ("tokens", "seconds", "decode_forwards", "emitted",
                                                         "speculated", "drafted", "host_s", "forward_s")}
    forwards, spec = total["decode_forwards"], total["speculated"]
    return dict(tokens=total["tokens"], seconds=total["seconds"], outputs=[o for u in units for o in u["outputs"]],
                speculated=spec / forwards if forwards else 0.0, mean_draft=total["drafted"] / spec if spec else 0.0,
                tokens_per_forward=total["emitted"] / forwards if forwards else 1.0,
                host_share=total["host_s"] / max(total["host_s"] + total["forward_s"], 1e-12))


def token_mismatches(runs: list[list[dict]], reference: list[list[dict]]) -> list[str]:
    """Where a setting's tokens part from the reference's in the same unit and run: "unit u run i
    sequence j token t" for each run that differs (``runs[u][i]``: unit u's i-th run, as in :func:`combine`)."""
    found = []
    for u, (mine, theirs) in enumerate(zip(runs, reference)):
        for i, (a, b) in enumerate(zip(mine, theirs)):
            for j, (x, y) in enumerate(zip(a["outputs"], b["outputs"])):
                if x != y:
                    t = next((t for t, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
                    found.append(f"unit {u} run {i} sequence {j} token {t}")
    return found


def paired_speedup(fast: list[list[dict]], slow: list[list[dict]], draws: int = 4000) -> tuple[float, float, float]:
    """How much faster setting ``fast`` ran than ``slow`` in one class, from paired runs: every unit ran
    every setting back to back in each round, so the ratio of their seconds in that unit and round
    cancels whatever the machine was doing then. Returns the geometric mean over (unit, round) and
    a 90% bootstrap interval over those pairs."""
    return geometric_mean_interval([math.log(s["seconds"] / f["seconds"])
                                    for fu, su in zip(fast, slow) for f, s in zip(fu, su)], draws)


def geometric_mean_interval(logs: list[float], draws: int = 4000) -> tuple[float, float, float]:
    """The geometric mean of ratios given as logs, and a 90% bootstrap interval over them."""
    rng = random.Random(0)
    means = sorted(sum(rng.choice(logs) for _ in logs) / len(logs) for _ in range(draws))
    return (math.exp(sum(logs) / len(logs)), math.exp(means[int(0.05 * draws)]), math.exp(means[int(0.95 * draws) - 1]))


def seconds_of(runs: dict[str, list[list[dict]]]) -> dict[str, list[list[float]]]:
    """``runs[label][unit][round]`` (run dicts) as seconds."""
    return {label: [[r["seconds"] for r in unit] for unit in units] for label, units in runs.items()}


def held_out_best_speedup(seconds: dict[str, list[list[float]]], adaptive: str, fixed: list[str],
                          draws: int = 4000) -> tuple[float, float, float]:
    """Adaptive's speed over the best fixed setting of a class, that setting chosen without the round it
    is compared in: for each round, the fixed setting with the least class time (each unit's fastest run)
    over the other rounds. Choosing and comparing on the same runs favours whichever fixed setting had the
    luckiest runs (on the three runs in RESULTS.md this moved no class by more than 0.03).
    ``seconds[label][unit][round]``; returns what :func:`paired_speedup` does."""
    rounds = len(seconds[adaptive][0])
    if rounds < 2:
        raise ValueError("choosing on other rounds needs at least two rounds")
    logs = []
    for r in range(rounds):
        def class_time(label: str) -> float:
            return sum(min(t for i, t in enumerate(unit) if i != r) for unit in seconds[label])
        best = min(fixed, key=class_time)
        logs += [math.log(b[r] / a[r]) for a, b in zip(seconds[adaptive], seconds[best])]
    return geometric_mean_interval(logs, draws)


def fmt_interval(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.2f} [{r[1]:.2f}-{r[2]:.2f}]"


def main(argv=None) -> int:
    args = parse_args(argv)
    quiet_torch(args.threads)
    import specgraph

    device = torch.device(args.device)
    machine = cpu_description() + (f"; {torch.cuda.get_device_name(device)}, torch {torch.__version__}"
                                   if device.type == "cuda" else "")
    log(f"{machine}; load {load_average()}; {args.prompt_set} prompts, {args.new_tokens} tokens, "
        f"proposers {args.proposers}, k {args.ks}")
    model, tok = specgraph.load_model(args.model)
    model = model.to(device).eval()
    groups = {g: [chat_prompt_ids(tok, t) for t in texts] for g, texts in class_prompts(args.prompt_set).items()}
    longest = max(len(p) for ps in groups.values() for p in ps) + args.new_tokens + max(args.ks) + 1
    num_blocks = PROMPTS_PER_CLASS * (-(-longest // 16)) + 8
    kmax = max(args.ks)

    engines, build_s = {}, {}
    for name in ["none"] + args.proposers:
        t0 = time.perf_counter()
        log(f"building Engine draft={name}")
        engines[name] = specgraph.Engine(model, tokenizer=tok, page_size=16, prefix_caching=False,
                                         num_blocks=num_blocks, max_num_seqs=PROMPTS_PER_CLASS,
                                         draft=None if name == "none" else name, num_draft_tokens=kmax)
        build_s[name] = time.perf_counter() - t0
    settings = [("none", "none", False, 1, None, None)]  # (label, engine, adaptive, k, tree, cap)
    for p in args.proposers:
        tree = engines[p].default_tree  # the kind's default (eagle, medusa), else None: chains only
        settings += [(f"{p} off", p, False, kmax, None, 0)]
        settings += [(f"{p} k={k}", p, False, k, None, None) for k in args.ks]
        settings += [(f"{p} tree {tree}", p, False, kmax, tree, None)] if tree else []
        settings += [(f"{p} adaptive", p, True, kmax, tree, None)]
    warm = [chat_prompt_ids(tok, WARMUP_PROMPT)]
    for label, name, adaptive, k, tree, cap in settings:  # first calls off the clock (never on a timed prompt)
        run_unit(engines[name], adaptive, k, tree, cap, warm, 0.0, 8, 0)
    served = {p: serve_warm_up(engines[p], tok, kmax, engines[p].default_tree, args.new_tokens) for p in args.proposers}

    classes = [(g, b, t) for g in groups for b in BATCHES for t in TEMPERATURES]
    runs_of: dict[tuple, dict[str, list[list[dict]]]] = {}  # class -> setting -> unit -> its run in each round
    turn, t_start, rounds = 0, time.perf_counter(), 0
    while rounds < args.repeats:
        per_round = (time.perf_counter() - t_start) / rounds if rounds else 0.0
        if args.time_budget and rounds and elapsed() + per_round > args.time_budget:
            log(f"stopping after {rounds} round(s): another ({per_round:.0f} s) would end past the "
                f"{args.time_budget:.0f} s budget")
            break
        for c in classes:
            g, b, t = c
            units = [groups[g][i:i + b] for i in range(0, len(groups[g]), b)]
            # every class gets PROMPTS_PER_CLASS pairs per round: a batch-4 class runs its one unit 4 times
            for u, prompts in [(u, p) for _ in range(PROMPTS_PER_CLASS // len(units)) for u, p in enumerate(units)]:
                shift = turn % len(settings)
                order = settings[shift:] + settings[:shift]
                turn += 1
                for label, name, adaptive, k, tree, cap in (order if turn % 2 else order[::-1]):
                    r = run_unit(engines[name], adaptive, k, tree, cap, prompts, t, args.new_tokens, seed=u,
                                 served=served.get(name))
                    runs_of.setdefault(c, {}).setdefault(label, [[] for _ in units])[u].append(r)
            log(f"round {rounds} {g} b{b} t{t} ({time.perf_counter() - t_start:.0f} s): " + ", ".join(
                f"{label} {combine(runs_of[c][label])['tokens'] / combine(runs_of[c][label])['seconds']:.1f}"
                for label, *_ in settings) + " tok/s so far")
        rounds += 1
        if args.json and rounds < args.repeats:  # what a run stopped from outside leaves
            write_json(args.json, build_report(args, machine, settings, classes, runs_of, engines, build_s,
                                               rounds)[1])
    lines, report = build_report(args, machine, settings, classes, runs_of, engines, build_s, rounds)
    print_report(lines, report, args.json)
    if args.profile:
        profile_host(engines, settings, groups["code"][:1], args.new_tokens, served)
    return 1 if report["token_mismatches"] else 0


def build_report(args, machine: str, settings: list[tuple], classes: list[tuple], runs_of: dict, engines: dict,
                 build_s: dict, rounds: int) -> tuple[list[str], dict]:
    """The printed report's lines and the JSON report, over the ``rounds`` complete rounds in ``runs_of``."""
    results = {c: {label: combine(runs) for label, runs in per.items()} for c, per in runs_of.items()}

    labels = [s[0] for s in settings]
    fixed = [s[0] for s in settings if not s[2]]
    col = lambda c: f"{c[0]} b{c[1]} {'greedy' if c[2] == 0 else f't{c[2]}'}"  # noqa: E731
    rate = lambda r: r["tokens"] / r["seconds"]  # noqa: E731
    rows = []
    for label in labels:
        mix_tokens = sum(results[c][label]["tokens"] for c in classes)
        mix_seconds = sum(results[c][label]["seconds"] for c in classes)
        rows.append([label] + [fmt(rate(results[c][label]), ".1f") for c in classes] + [fmt(mix_tokens / mix_seconds, ".1f")])
    lines = [f"# bench_adaptive: {machine}", f"# {args.prompt_set} prompts, {args.new_tokens} new tokens "
             f"per prompt, {PROMPTS_PER_CLASS} prompts per class, best of {rounds} rounds, torch threads "
             f"{args.threads}, load {load_average()}",
             "", "tok/s per class (code/chat x batch x temperature) and over the whole mix", "",
             format_table(["setting"] + [col(c) for c in classes] + ["mix"], rows, right=set(range(1, len(classes) + 2)))]

    def mix(label):
        return sum(results[c][label]["tokens"] for c in classes) / sum(results[c][label]["seconds"] for c in classes)

    best_mix = max(fixed, key=mix)
    summary, paired = [], []
    for p in args.proposers:
        a = f"{p} adaptive"
        for c in classes:
            best = max(fixed, key=lambda lab: rate(results[c][lab]))
            r = results[c][a]
            summary.append([a, col(c), best, fmt(rate(r) / rate(results[c][best]), ".2f"),
                            fmt(rate(r) / rate(results[c]["none"]), ".2f"),
                            fmt(rate(r) / rate(results[c][f"{p} off"]), ".2f"), f"{r['speculated']:.0%}",
                            fmt(r["mean_draft"], ".2f"), fmt(r["tokens_per_forward"], ".2f")])
            against = {lab: paired_speedup(runs_of[c][a], runs_of[c][lab]) for lab in fixed}  # every proposer's
            worst = min(against, key=lambda lab: against[lab][0])
            held_out = held_out_best_speedup(seconds_of(runs_of[c]), a, fixed) if rounds > 1 else None
            paired.append([a, col(c), fmt_interval(against[best]), fmt_interval(held_out) if held_out else "",
                           f"{worst}: {fmt_interval(against[worst])}",
                           fmt_interval(against["none"]), fmt_interval(against[f"{p} off"])])
        summary.append([a, "mix", best_mix, fmt(mix(a) / mix(best_mix), ".2f"), fmt(mix(a) / mix("none"), ".2f"),
                        fmt(mix(a) / mix(f"{p} off"), ".2f"), "", "", ""])
    lines += ["", "adaptive against the best fixed setting of each class, against none, and against its own "
              "engine with drafts off (each unit's fastest run)", "",
              format_table(["setting", "class", "best fixed", "vs best", "vs none", "vs off", "speculated",
                            "mean k", "tok/forward"], summary, right={3, 4, 5, 6, 7, 8}),
              "", f"paired: adaptive's speed over a fixed setting, the geometric mean over (unit, round) of their "
              f"seconds' ratio in the same unit and round, with a 90% bootstrap interval over those "
              f"{rounds * PROMPTS_PER_CLASS} pairs per class; \"held out\": against the best fixed setting "
              f"chosen on the other rounds", "",
              format_table(["setting", "class", "vs best fixed", "held out", "worst fixed", "vs none", "vs off"],
                           paired, right={2, 3, 5, 6})]
    same_text = [s[0] for s in settings if s[1] in ("none", "ngram")]  # deterministic drafts: sampled text too
    mismatches = [f"{label} on {col(c)} ({where})" for c in classes for label in (labels if c[2] == 0 else same_text)
                  for where in token_mismatches(runs_of[c][label], runs_of[c]["none"])]
    lines += ["", "tokens equal to none's in every run (greedy: every setting; sampled: none and ngram's settings): "
              + ("all" if not mismatches else "NO: " + "; ".join(mismatches))]
    for p in args.proposers:
        cost = engines[p].controller.forward_cost.as_dict()
        lines.append(f"{p}: controller's forward cost (ms by stream size): "
                     + ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in cost.items())
                     + f"; draft {engines[p].controller.draft_seconds_per_position * 1e3:.2f} ms per position")
    lines.append("engine build s: " + ", ".join(f"{k} {v:.0f}" for k, v in build_s.items()))
    lines.append("host share of step time (outside the target's forward), mean over the classes: " + ", ".join(
        f"{label} {sum(results[c][label]['host_share'] for c in classes) / len(classes):.0%}" for label in labels))
    report = dict(config=vars(args), cpu=machine, rounds=rounds, classes=[col(c) for c in classes],
                  results={col(c): {lab: {k: v for k, v in r.items() if k != "outputs"} for lab, r in results[c].items()}
                           for c in classes}, token_mismatches=mismatches,
                  seconds={col(c): seconds_of(per) for c, per in runs_of.items()})
    return lines, report


def profile_host(engines, settings, prompts: list[list[int]], n: int, served: dict, top: int = 15) -> None:
    """Where the host time of one batch-1 greedy ``generate`` goes under each setting (cProfile, by own time;
    the profiler slows Python, so read the shares, not the seconds)."""
    import cProfile
    import io
    import pstats

    for label, name, adaptive, k, tree, cap in settings:
        prof = cProfile.Profile()
        prof.enable()
        run_unit(engines[name], adaptive, k, tree, cap, prompts, 0.0, n, 0, served.get(name))
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
        print(f"\n## host profile: {label}, one code prompt, batch 1, greedy\n{out.getvalue()}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
