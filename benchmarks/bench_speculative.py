"""Speculative decoding benchmark: specgraph's proposers against plain decoding and HF prompt lookup.

    python benchmarks/bench_speculative.py                   # full run (~35 minutes on 2 idle CPU cores)
    python benchmarks/bench_speculative.py --quick           # smoke test: 2 prompts, 24 tokens, k in {2, 4}
    python benchmarks/bench_speculative.py --layer-skip 12 --json spec.json

Everything is measured in one process, one run, and printed as one table plus labelled lines:

1. Throughput at batch 1 (every prompt alone), ``--new-tokens`` tokens per prompt (EOS ignored
   everywhere, so every run makes exactly N tokens), for
     - ``none``           specgraph Engine without speculation,
     - ``ngram``          specgraph prompt-lookup drafting (k = 2, 4, 6),
     - ``layer_skip:K``   specgraph self-drafting with the target's first K layers (k = 2, 4, 6),
     - ``eagle``, ``medusa``  specgraph's learned heads (``--heads``: the shipped ones by default)
                          drafting chains (k = 2, 4, 6) and, as ``eagle-tree`` / ``medusa-tree``,
                          the head kind's default token tree,
     - ``hf-eager``       ``model.generate`` (HF dynamic cache),
     - ``hf-pld``         ``model.generate(prompt_lookup_num_tokens=k)`` (HF prompt lookup decoding),
   at temperature 0 (greedy) and 0.8 (seeded sampling; top-k/top-p off in both libraries). HF
   rows at 0.8 are plain sampling only: hf-pld is run greedy only (transformers 5.x does accept
   ``do_sample=True`` with prompt lookup, verifying by sampling each position from the target and
   keeping matching candidates; that variant is not measured here).
   One Engine is compiled per proposer; k is changed between calls via ``engine.num_draft_tokens``.
   All (mode, k, temperature) cells run once per prompt, interleaved, the order rotating from
   prompt to prompt, so load swings on a shared machine hit every mode (``--repeats R``: R rounds,
   the fastest run of each (row, prompt) is used). Every run records the CPU that *other*
   processes used meanwhile (``/proc/stat``); pairs measured while that exceeded 0.25 core are
   re-run after waiting for a quiet machine (``--retry-busy``), and rows still resting on such
   runs are marked ``!``. (With 2 torch threads on 2 cores, one busy core slows everything 10x+:
   OpenMP threads spin-wait for a descheduled peer; ``OMP_WAIT_POLICY=PASSIVE`` avoids that.)
   tok/s = new tokens /
   wall time of the generate calls, summed per prompt group (code, chat); speed-ups are against
   ``none`` at the same temperature and group.
2. Lossless check: greedy tokens of every speculative mode against ``none`` and ``hf-eager``.
3. Verification cost curve: ms of one target forward over k tokens (k = 1..16) at context 256,
   specgraph's compiled program and HF eager (DynamicCache, cropped after every forward),
   best of several interleaved repetitions. A speculative step with k drafts verifies k + 1
   tokens, so it beats plain decoding only if it emits more than cost(k + 1) / cost(1) tokens
   per forward (plus the drafting cost).

mean_accepted_tokens = tokens emitted per sequence per verify forward (accepted drafts + 1),
acceptance_rate = accepted drafts / proposed drafts, both summed over all prompts of the row
(per group in the JSON). For hf-pld they are computed from HF's prompt-lookup candidate
generator (wrapped in this process to count its calls and candidates): tokens per target forward
= N / forwards (the first forward is the prefill, which already verifies candidates found in the
prompt), accepted = N - forwards.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # prompts.py, common.py

import torch  # noqa: E402
import transformers  # noqa: E402

from common import chat_prompt_ids, first_mismatch, fmt, format_table, load_average, log, print_report, quiet_torch  # noqa: E402
from prompts import HELDOUT_CODE_PROMPTS, HELDOUT_CHAT_PROMPTS, PROMPTS, WARMUP_PROMPT  # noqa: E402
from spec_runs import CpuMeter, PldCounter, aggregate, hf_run, sg_run, verify_curve  # noqa: E402

HELDOUT_PROMPTS = [("code", p) for p in HELDOUT_CODE_PROMPTS] + [("chat", p) for p in HELDOUT_CHAT_PROMPTS]

GREEDY, SAMPLED = 0.0, 0.8
VERIFY_CONTEXT = 256
BUSY_CORES = 0.25  # a run during which other processes used more CPU than this is "busy" (suspect)


# ============================================================================ arguments
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="specgraph.load_model name or path")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens per prompt (default 128; --quick 24)")
    p.add_argument("--layer-skip", type=int, default=8, metavar="K",
                   help="layers of the layer_skip drafter (default 8; 0 leaves its rows out)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 2 prompts (1 code, 1 chat), 24 tokens, k in {2,4}, verify curve k in {1,2,4,8}")
    p.add_argument("--verify-reps", type=int, default=None,
                   help="timed repetitions of the verification curve (default 10; --quick 5); best reported")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature 0.8 rows)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every (cell, prompt) R times, all interleaved; the fastest run of each is used")
    p.add_argument("--retry-busy", type=int, default=2, metavar="ROUNDS",
                   help="rounds of re-running (row, prompt) pairs whose every run was taken while other processes "
                        f"used > {BUSY_CORES} core (default 2; 0: off)")
    p.add_argument("--heads", default="eagle,medusa", metavar="SPECS",
                   help="comma-separated learned-head draft specs (default 'eagle,medusa': the shipped heads; "
                        "'eagle:PATH' for another; '' leaves their rows out)")
    p.add_argument("--prompt-set", default="tuning", choices=("tuning", "heldout"),
                   help="PROMPTS (what the defaults were tuned on) or the HELDOUT ones (never tuned on)")
    p.add_argument("--json", default=None, metavar="PATH", help="also save the results as JSON")
    a = p.parse_args(argv)
    a.new_tokens = a.new_tokens or (24 if a.quick else 128)
    a.ks = [2, 4] if a.quick else [2, 4, 6]
    a.heads = [h for h in a.heads.split(",") if h]
    a.verify_ks = [1, 2, 4, 8] if a.quick else list(range(1, 17))
    a.verify_reps = a.verify_reps or (5 if a.quick else 10)
    chosen = list(PROMPTS) if a.prompt_set == "tuning" else HELDOUT_PROMPTS
    a.prompts = [chosen[0], next(p for p in chosen if p[0] == "chat")] if a.quick else chosen  # quick: 1 code, 1 chat
    if a.new_tokens < 2:
        p.error("--new-tokens must be >= 2")
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    if a.layer_skip < 0:
        p.error("--layer-skip must be >= 0 (0 leaves the layer_skip rows out)")
    return a


# ============================================================================ the cells
def make_cells(args) -> list[dict]:
    """Every (mode, k, temperature) row of the table, in table order."""
    ls = (f"layer_skip:{args.layer_skip}",) if args.layer_skip else ()
    cells = []
    for temp in (GREEDY, SAMPLED):
        cells.append(dict(mode="none", kind="sg", engine="none", k=None, temp=temp))
        heads = tuple(h.partition(":")[0] for h in args.heads)
        for proposer in ("ngram",) + ls + heads:
            for k in args.ks:
                cells.append(dict(mode=proposer, kind="sg", engine=proposer, k=k, temp=temp))
        for head in heads:  # each head kind's own default tree
            cells.append(dict(mode=f"{head}-tree", kind="sg", engine=head, k=None, temp=temp, tree="default"))
        cells.append(dict(mode="hf-eager", kind="hf", engine=None, k=None, temp=temp))
        if temp == GREEDY:  # hf-pld: greedy only (see the module docstring)
            for k in args.ks:
                cells.append(dict(mode="hf-pld", kind="hf", engine=None, k=k, temp=temp))
    for c in cells:
        c.setdefault("tree", None)
        c["key"] = (c["mode"], c["k"], c["temp"])
        c["runs"] = []  # every timed run: dict(prompt, group, rep, elapsed_s, tokens, draft, accepted, steps, ...)
    return cells


def draft_costs(cells: list[dict]) -> list[str]:
    """Per drafting row (greedy): seconds spent drafting per verify step, as a fraction of one target forward."""
    lines = []
    for c in cells:
        runs = [r for r in c["runs"] if r.get("steps")]
        if c["kind"] != "sg" or c["temp"] != GREEDY or not runs:  # (HF's prompt lookup times no drafting)
            continue
        draft = sum(r["draft_s"] for r in runs) / sum(r["steps"] for r in runs)
        forward = sum(r["forward_s"] for r in runs) / sum(r["forwards"] for r in runs)
        lines.append(f"  drafting cost {c['mode']} k={c['k'] or c['tree']}: {draft * 1e3:.2f} ms per verify step "
                     f"= {draft / forward:.3f} of a target forward ({forward * 1e3:.1f} ms)")
    return lines


# ============================================================================== main
def main(argv=None) -> int:
    args = parse_args(argv)
    quiet_torch(args.threads)
    import specgraph
    from specgraph.runtime.proposers import kind_of

    t_start = time.perf_counter()
    cells = make_cells(args)
    ls_name = f"layer_skip:{args.layer_skip}"
    n = args.new_tokens
    report: dict = dict(config={k: v for k, v in vars(args).items() if k != "prompts"},
                        env=dict(torch=torch.__version__, transformers=transformers.__version__,
                                 python=platform.python_version(), cpu=platform.processor() or platform.machine(),
                                 threads=torch.get_num_threads(), load_average_start=load_average(),
                                 omp_wait_policy=os.environ.get("OMP_WAIT_POLICY")))
    log(f"threads {torch.get_num_threads()}, {len(args.prompts)} prompts x {n} tokens, k {args.ks}, "
        f"{len(cells)} (mode, k, temperature) cells per prompt, layer_skip K={args.layer_skip}")

    meter = CpuMeter()
    a = meter.snap()
    time.sleep(2.0)
    idle_other = meter.other_cores(a, meter.snap())
    report["other_cpu_cores_at_start"] = idle_other
    ncpu = os.cpu_count() or 1
    if idle_other > 0.25:
        fit = max(1, ncpu - round(idle_other))
        log(f"WARNING: other processes are using {idle_other:.2f} of {ncpu} cores right now: timings will be slow "
            f"and noisy" + (f" (with {args.threads} torch threads on fewer free cores, OpenMP threads spin-wait for "
                            f"a descheduled peer on every op: 10x+ slower; consider --threads {fit}, or "
                            f"OMP_WAIT_POLICY=PASSIVE in the environment)" if fit < args.threads else ""))
    log(f"loading {args.model}")
    model, tok = specgraph.load_model(args.model)
    model.eval()
    num_layers = model.config.num_hidden_layers
    if args.layer_skip >= num_layers:
        raise SystemExit(f"--layer-skip {args.layer_skip} must be < the model's {num_layers} layers")
    vocab = model.config.vocab_size
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    prompt_ids = [chat_prompt_ids(tok, text) for _, text in args.prompts]
    groups = [g for g, _ in args.prompts]
    warm_ids = chat_prompt_ids(tok, WARMUP_PROMPT)
    pld = PldCounter()

    # -------------------------------------------------------- calibration + estimate
    hf_run(model, warm_ids, 4, GREEDY, None, 0, pad, pld)  # first call (allocator, kernels)
    cal = hf_run(model, warm_ids, 16, GREEDY, None, 0, pad, pld)
    hf_rate = 16 / cal["elapsed_s"]
    gen_tokens = len(prompt_ids) * n * len(cells) * args.repeats
    # cells at the hf-eager rate measured now, layer_skip ones ~2.2x slower (k drafter forwards per step
    # when drafts are rarely accepted, as measured on this model); ngram and none ~1x
    slow = sum(2.2 if c["engine"] == ls_name else 1.0 for c in cells) / len(cells)
    est_gen = gen_tokens * slow / hf_rate
    est_compile = 70.0  # three Engines (~15-25 s each on 2 cores), layer_skip compiles a second program
    est_warm = len(cells) * (8 * slow / hf_rate + 0.5)
    est_verify = (args.verify_reps + 2) * 2 * sum(1 + 0.15 * (k - 1) for k in args.verify_ks) / hf_rate
    estimate = est_compile + est_gen + est_warm + est_verify + 10
    log(f"ESTIMATED DURATION ~{estimate / 60:.1f} min (compile ~{est_compile / 60:.0f} min, "
        f"{gen_tokens} generated tokens at the hf-eager rate measured now, {hf_rate:.1f} tok/s: "
        f"~{est_gen / 60:.1f} min; verification curve ~{est_verify / 60:.1f} min)")
    report["estimated_duration_s"] = estimate

    # ------------------------------------------------------------------- engines
    longest = max(map(len, prompt_ids + [warm_ids])) + n + max(args.ks) + 1
    need = max(longest, VERIFY_CONTEXT + max(args.verify_ks))
    num_blocks = math.ceil(need / 16) + 8
    engines, compile_s = {}, {}
    drafts = (("none", None), ("ngram", "ngram")) + (((ls_name, ls_name),) if args.layer_skip else ()) \
        + tuple((h.partition(":")[0], h) for h in args.heads)
    for name, draft in drafts:
        log(f"compiling Engine draft={draft}")
        t0 = time.perf_counter()
        kind = kind_of(draft)  # (a learned head's tree given: no build-time shape choice, rows set each shape)
        engines[name] = specgraph.Engine(model, tokenizer=tok, page_size=16, prefix_caching=False,
                                         num_blocks=num_blocks, draft=draft, num_draft_tokens=args.ks[0],
                                         adaptive=False if draft else None,  # rows are fixed k
                                         draft_tree=kind.default_tree if kind is not None else None)
        compile_s[name] = time.perf_counter() - t0
        log(f"  built in {compile_s[name]:.1f} s")
    report["engine_build_s"] = compile_s
    tree_names = {name: e.default_tree for name, e in engines.items() if e.default_tree}
    proposer_names = {name: e.stats.get("proposer") for name, e in engines.items()}

    def run_cell(c, ids):
        gc.collect()
        a = meter.snap()
        if c["kind"] == "sg":
            run = sg_run(engines[c["engine"]], ids, n, c["temp"], c["k"], args.seed, c["tree"])
        else:
            run = hf_run(model, ids, n, c["temp"], c["k"], args.seed, pad, pld)
        run["other_cpu_cores"] = meter.other_cores(a, meter.snap())
        return run

    # ------------------------------------------------------------------- warm-up
    for c in cells:  # every engine at every k and temperature, every HF path (never on a timed prompt)
        log(f"warm-up {c['mode']} k={c['k']} t={c['temp']}")
        if c["kind"] == "sg":
            sg_run(engines[c["engine"]], warm_ids, 8, c["temp"], c["k"], args.seed, c["tree"])
        else:
            hf_run(model, warm_ids, 8, c["temp"], c["k"], args.seed, pad, pld)

    # ------------------------------------------------------------------ throughput
    t_tp = time.perf_counter()
    turn = 0
    for r in range(args.repeats):
        for i, ids in enumerate(prompt_ids):
            shift = (turn * 7) % len(cells)
            order = cells[shift:] + cells[:shift]
            if turn % 2:
                order = order[::-1]
            turn += 1
            for c in order:
                run = run_cell(c, ids)
                run.update(prompt=i, group=groups[i], rep=r)
                c["runs"].append(run)
                extra = ""
                if "draft" in run:
                    extra = (f", accepted {run['accepted']}/{run['draft']} drafts, "
                             f"{run['emitted'] / max(run['steps'], 1):.2f} tok/verify")
                log(f"rep {r} prompt {i} ({groups[i]}, {len(ids)} tok) {c['mode']} k={c['k']} t={c['temp']}: "
                    f"{n / run['elapsed_s']:.1f} tok/s{extra}; other processes {run['other_cpu_cores']:.2f} cores")

    def clean(run):
        return run["other_cpu_cores"] <= BUSY_CORES

    # re-run the (cell, prompt) pairs that have no clean run yet, after waiting (up to 60 s) for a quiet machine
    retried = 0
    for rnd in range(args.retry_busy):
        todo = [(c, i) for i in range(len(prompt_ids)) for c in cells
                if not any(clean(r) for r in c["runs"] if r["prompt"] == i)]
        if not todo:
            break
        log(f"retry round {rnd + 1}: {len(todo)} (row, prompt) pairs were measured while other processes were busy")
        meter.wait_quiet(BUSY_CORES)
        if rnd % 2 == 0:
            todo = todo[::-1]
        for c, i in todo:
            run = run_cell(c, prompt_ids[i])
            run.update(prompt=i, group=groups[i], rep=-1 - rnd)
            c["runs"].append(run)
            retried += 1
            log(f"retry {rnd + 1} prompt {i} {c['mode']} k={c['k']} t={c['temp']}: {n / run['elapsed_s']:.1f} tok/s; "
                f"other processes {run['other_cpu_cores']:.2f} cores")
    report["throughput_wall_s"] = time.perf_counter() - t_tp
    for c in cells:  # per (cell, prompt): the fastest clean run (the fastest of all if none is clean)
        best = {}
        for i in range(len(prompt_ids)):
            mine = [r for r in c["runs"] if r["prompt"] == i]
            pool = [r for r in mine if clean(r)] or mine
            best[i] = min(pool, key=lambda r: r["elapsed_s"])
        c["all_runs"], c["runs"] = c["runs"], [best[i] for i in sorted(best)]
        c["first_runs"] = {run["prompt"]: run for run in c["all_runs"] if run["rep"] == 0}

    # ----------------------------------------------------------- verification curve
    log(f"verification cost curve, k {args.verify_ks}, context {VERIFY_CONTEXT}, {args.verify_reps} reps")
    if meter.wait_quiet(BUSY_CORES, max_s=30.0, step_s=2.0) > BUSY_CORES:
        log("other processes are busy; measuring the curve anyway (best-of-reps)")
    a = meter.snap()
    curve = verify_curve(model, engines["none"], vocab, args.verify_ks, args.verify_reps, VERIFY_CONTEXT)
    curve_other = meter.other_cores(a, meter.snap())
    report["env"]["load_average_end"] = load_average()

    # ================================================================== report
    by_key = {c["key"]: c for c in cells}
    group_names = ["code", "chat"]
    rows, jrows = [], []
    for c in cells:
        agg = {g: aggregate([r for r in c["runs"] if r["group"] == g]) for g in group_names}
        allg = aggregate(c["runs"])
        base = by_key[("none", None, c["temp"])]
        base_agg = {g: aggregate([r for r in base["runs"] if r["group"] == g]) for g in group_names}
        speed = {g: agg[g]["tok_s"] / base_agg[g]["tok_s"] if agg[g]["new_tokens"] else None for g in group_names}
        mat = allg.get("mean_accepted_tokens")
        acc = allg.get("acceptance_rate")
        star = "*" if c["mode"] == "hf-pld" else ""
        mark = {g: "!" if any(not clean(r) for r in c["runs"] + base["runs"] if r["group"] == g) else ""
                for g in group_names}
        rows.append([c["mode"], str(c["k"]) if c["k"] else tree_names.get(c["engine"], "-") if c["tree"] else "-",
                     f"{c['temp']:g}",
                     fmt(agg["code"]["tok_s"] if agg["code"]["new_tokens"] else None) + mark["code"],
                     fmt(agg["chat"]["tok_s"] if agg["chat"]["new_tokens"] else None) + mark["chat"],
                     fmt(mat) + star if mat is not None else "-", fmt(acc, ".3f") + star if acc is not None else "-",
                     fmt(speed["code"]) + ("x" if speed["code"] else ""),
                     fmt(speed["chat"]) + ("x" if speed["chat"] else "")])
        jrows.append(dict(mode=c["mode"], k=c["k"], temperature=c["temp"], all=allg, code=agg["code"],
                          chat=agg["chat"], speedup_vs_none=speed,
                          runs=c["all_runs"]))
    report["throughput"] = jrows

    # lossless checks (greedy)
    ref_none = {p: r["tokens"] for p, r in by_key[("none", None, GREEDY)]["first_runs"].items()}
    ref_hf = {p: r["tokens"] for p, r in by_key[("hf-eager", None, GREEDY)]["first_runs"].items()}
    checks, check_lines = [], []

    def check(label, c, refs):
        parts, res = [], dict(label=label)
        for ref_name, ref in refs:
            mm = {}
            for r in c["all_runs"]:  # every repeat must match (the reference: its first repeat)
                m = first_mismatch(r["tokens"], ref[r["prompt"]])
                if mm.get(r["prompt"]) is None:
                    mm[r["prompt"]] = m
            same = sum(v is None for v in mm.values())
            bad = ", ".join(f"p{p}@{v}" for p, v in mm.items() if v is not None)
            parts.append(f"{same}/{len(mm)} == {ref_name}" + (f" (first differing token: {bad})" if bad else ""))
            res[ref_name] = dict(identical=same, total=len(mm), first_mismatch=mm)
        checks.append(res)
        check_lines.append(f"  {label:<22} " + "; ".join(parts))
        return all(v["identical"] == v["total"] for k, v in res.items() if k != "label")

    lossless_none = lossless_hf = True
    for c in cells:
        if c["temp"] != GREEDY or c["mode"] in ("none", "hf-eager"):
            continue
        if c["kind"] == "sg":
            ok = check(f"{c['mode']} k={c['k']}", c, [("none", ref_none), ("hf-eager", ref_hf)])
            lossless_none &= checks[-1]["none"]["identical"] == checks[-1]["none"]["total"]
            lossless_hf &= ok
        else:
            check(f"{c['mode']} k={c['k']}", c, [("hf-eager", ref_hf)])
    check("none (no speculation)", by_key[("none", None, GREEDY)], [("hf-eager", ref_hf)])
    report["greedy_checks"] = checks

    # ------------------------------------------------------------------ print
    out = ["== specgraph speculative decoding benchmark =="]
    nparams = sum(p.numel() for p in model.parameters())
    out.append(f"model: {args.model} ({nparams / 1e6:.1f}M params, {num_layers} layers, "
               f"{str(next(model.parameters()).dtype).replace('torch.', '')}); threads {torch.get_num_threads()} "
               f"(torch {torch.__version__}, transformers {transformers.__version__})")
    out.append(f"load average start {report['env']['load_average_start']}, end {report['env']['load_average_end']}; "
               f"other processes at start {idle_other:.2f} cores; "
               f"wall {(time.perf_counter() - t_start) / 60:.1f} min (estimated {estimate / 60:.1f} min)")
    ncode, nchat = groups.count("code"), groups.count("chat")
    out.append(f"prompts: {len(prompt_ids)} at batch 1 ({ncode} code, {nchat} chat; "
               f"{min(map(len, prompt_ids))}-{max(map(len, prompt_ids))} tokens, chat template), {n} new tokens "
               f"each, EOS ignored; temperature 0.8: seed {args.seed}, top-k/top-p off")
    out.append("engine build (compile) s: " + ", ".join(f"{k} {v:.1f}" for k, v in compile_s.items())
               + f"; proposers: {', '.join(f'{k}={v}' for k, v in proposer_names.items() if v)}")
    out.append("")
    out.append(format_table(["mode", "k", "temp", "code tok/s", "chat tok/s", "mean_accepted_tokens",
                             "acceptance_rate", "speed-up code", "speed-up chat"], rows, right=set(range(1, 9))))
    out.append("  tok/s = new tokens / wall time of the generate calls, summed over the group's prompts; "
               "speed-ups vs `none` (specgraph, no speculation) at the same temperature")
    out.append("  mean_accepted_tokens = tokens emitted per sequence per verify forward (accepted drafts + 1); "
               "acceptance_rate = accepted / proposed drafts; both over all prompts")
    cost_lines = draft_costs(cells)
    out.extend(cost_lines)
    report["draft_cost"] = cost_lines
    out.append("  * hf-pld: from HF's prompt-lookup candidate generator: tokens per target forward = N / forwards "
               "(the prefill forward included), accepted = N - forwards")
    out.append("  hf-pld (model.generate(prompt_lookup_num_tokens=k)) is run greedy only; the temperature-0.8 HF row "
               f"is plain do_sample=True sampling (transformers {transformers.__version__} also accepts do_sample=True "
               "with prompt lookup; not measured here)")
    out.append("  temperature 0.8: rejection sampling keeps the output distribution, not the token sequence, "
               "so sampled outputs differ between rows")
    others = [r["other_cpu_cores"] for c in cells for r in c["all_runs"]]
    busy = sum(o > BUSY_CORES for o in others)
    used_busy = sum(not clean(r) for c in cells for r in c["runs"])
    out.append(f"  CPU used by other processes during the timed runs: mean {sum(others) / len(others):.2f} cores, "
               f"max {max(others):.2f}; {busy}/{len(others)} runs above {BUSY_CORES} core, {retried} of them "
               f"re-run; used in the table: {used_busy} busy (row, prompt) runs"
               + ("; '!' marks a group whose runs (or its `none` baseline's) include busy ones: suspect, "
                  "rerun on a quiet machine" if used_busy else ""))
    out.append(f"  each (row, prompt) uses its fastest run taken while other processes used <= {BUSY_CORES} core "
               f"({args.repeats} interleaved repeat(s) + re-runs of busy ones)")
    report["other_cpu_cores"] = dict(mean=sum(others) / len(others), max=max(others), busy_runs=busy,
                                     retried=retried, busy_runs_in_table=used_busy)
    out.append("")
    out.append("greedy lossless check (token for token, per prompt):")
    out.extend(check_lines)
    out.append(f"  => every specgraph speculative mode == none: {'yes' if lossless_none else 'NO'}; "
               f"== hf-eager: {'yes' if lossless_hf else 'NO'}")

    out.append("")
    out.append(f"verification cost: one target forward over k tokens at context {VERIFY_CONTEXT} "
               f"(best of {args.verify_reps}, interleaved; other processes used {curve_other:.2f} cores meanwhile)")
    sg_c, hf_c = curve["specgraph"], curve["hf-eager"]
    k0 = args.verify_ks[0]
    crows = [[str(k), fmt(sg_c["best_ms"][k]), fmt(sg_c["ratio"][k]) + "x", fmt(hf_c["best_ms"][k]),
              fmt(hf_c["ratio"][k]) + "x"] for k in args.verify_ks]
    out.append(format_table(["k", "specgraph ms", f"vs k={k0}", "hf-eager ms", f"vs k={k0}"], crows))
    if k0 == 1:
        be = [f"k={k}: {sg_c['ratio'][k + 1]:.2f}" if k + 1 in sg_c["ratio"] else f"k={k}: (k={k + 1} not on the curve)"
              for k in args.ks]
        out.append("  k drafts => a (k+1)-token verify forward; break-even mean_accepted_tokens (specgraph, drafting "
                   "cost not counted) = cost(k+1)/cost(1): " + ", ".join(be))
    report["verify_curve"] = {m: {key: {str(k): v for k, v in d.items()} for key, d in c.items()}
                              for m, c in curve.items()}
    report["verify_curve"]["other_cpu_cores"] = curve_other

    print_report(out, report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
