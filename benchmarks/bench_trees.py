"""Chain vs token-tree speculation at equal verified-node budget, with n-gram drafts and a model draft.

    python benchmarks/bench_trees.py               # ~15 minutes on 2 cores: 14 prompts, 64 tokens, greedy
    python benchmarks/bench_trees.py --quick       # smoke test: 2 prompts, 24 tokens
    python benchmarks/bench_trees.py --temperatures 0,0.8 --json trees.json

For each proposer (``--drafts``; default ``ngram`` and ``layer_skip:K``, the target's own first K
layers; ``eagle`` / ``medusa`` for the learned heads) one Engine is built with room for the largest tree below; its draft shape changes between
runs (``engine.draft_tree``), so every row runs the same compiled program. Rows, all with
``adaptive=False``:

* ``none``: no speculation (a plain engine);
* ``chain k``: ``num_draft_tokens = k`` for k = 4 and 8;
* ``static:2,1,1,1`` (8 nodes, depth 4: the chain k=4's depth with the chain k=8's budget),
  ``static:3,2,1`` (15 nodes, depth 3), ``dynamic:8`` (8 nodes, EAGLE-2's confidence-ordered tree);
  ``--shapes "chain 3;dynamic:16"`` picks others; ``default`` is the shape an engine built with no
  ``draft_tree`` and ``adaptive=False`` drafts (learned drafts: timed at build, ``runtime/shape_choice.py``).

Every (row, prompt) runs once per round, interleaved, rounds rotating the order (``--repeats``: the
fastest of each). Prompts: the 6 benchmark prompts the project's speculation was developed on and
the 8 held-out ones it never tuned on (``--prompt-set``), reported per group. ``tok/s`` = new tokens / generate wall
time; ``acc/fwd`` = tokens a sequence gained per verify forward (``mean_accepted_tokens``); ``nodes``
= tree nodes (or chain drafts) verified per verify forward. Greedy rows are checked token for token
against ``none`` (lossless).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # prompts.py, common.py


from common import chat_prompt_ids, cpu_description, fmt, format_table, log, print_report, quiet_torch  # noqa: E402
from prompts import HELDOUT_CHAT_PROMPTS, HELDOUT_CODE_PROMPTS, PROMPTS, WARMUP_PROMPT  # noqa: E402

SHAPES = ("chain 4", "chain 8", "static:2,1,1,1", "static:3,2,1", "dynamic:8")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=None, help="per prompt (default 64; --quick 24)")
    p.add_argument("--layer-skip", type=int, default=8, metavar="K", help="layers of the model drafter (default 8)")
    p.add_argument("--drafts", default=None, help="comma-separated draft specs (default: ngram,layer_skip:K)")
    p.add_argument("--shapes", default=";".join(SHAPES),
                   help=f"';'-separated rows: 'chain K' or a draft_tree spec (default {';'.join(SHAPES)})")
    p.add_argument("--prompt-set", default="both", choices=("tuning", "heldout", "both"),
                   help="the benchmark prompts, the held-out ones, or both (default)")
    p.add_argument("--temperatures", default="0", help="comma-separated (default 0: greedy)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None, metavar="PATH")
    a = p.parse_args(argv)
    a.drafts = a.drafts.split(",") if a.drafts else ["ngram", f"layer_skip:{a.layer_skip}"]
    a.shapes = [s.strip() for s in a.shapes.split(";") if s.strip()]
    return a


def prompt_set(tok, quick: bool, which: str = "both") -> list[tuple[str, list[int]]]:
    named = (PROMPTS if which != "heldout" else []) + ([] if which == "tuning" else [
        ("heldout-code", p) for p in HELDOUT_CODE_PROMPTS] + [("heldout-chat", p) for p in HELDOUT_CHAT_PROMPTS])
    if quick:
        named = [named[0], named[-1]]
    return [(group, chat_prompt_ids(tok, text)) for group, text in named]


def run(engine, ids: list[int], n: int, temp: float) -> dict:
    engine.reset_stats()
    t0 = time.perf_counter()
    out = engine.generate([ids], max_new_tokens=n, temperature=temp, seed=1, ignore_eos=True)[0]
    elapsed = time.perf_counter() - t0
    s = engine.stats
    return dict(elapsed_s=elapsed, tokens=list(out.token_ids), steps=s.get("verify_steps", 0),
                nodes=s.get("tree_nodes_verified", 0) or s.get("draft_tokens", 0),
                emitted=s.get("decode_emitted", 0), forwards=s.get("decode_forwards", 0))


def configure(engine, shape: str, default: tuple | None = None) -> None:
    if shape == "default":  # what an engine built with no draft_tree and adaptive=False drafts
        engine.draft_tree, engine.num_draft_tokens = default
    elif shape.startswith("chain"):
        engine.draft_tree = None
        engine.num_draft_tokens = int(shape.split()[1])
    else:
        engine.draft_tree = shape


def main(argv=None) -> int:
    args = parse_args(argv)
    quiet_torch(args.threads)
    import specgraph

    n = args.new_tokens or (24 if args.quick else 64)
    temps = [float(t) for t in args.temperatures.split(",")]
    model, tok = specgraph.load_model(args.model)
    prompts = prompt_set(tok, args.quick, args.prompt_set)
    engines = {"none": specgraph.Engine(model, tokenizer=tok)}
    from specgraph.runtime.token_tree import parse_tree

    from specgraph.runtime.proposers import kind_of
    from specgraph.runtime.shape_choice import choose_default_shape

    kind_trees = {d: kind_of(d).default_tree if kind_of(d) is not None else None for d in args.drafts}
    if "default" in args.shapes and not all(kind_trees.values()):
        raise SystemExit(f"--shapes default: a draft of {args.drafts} has no default tree (eagle and medusa do)")
    trees = [s for s in args.shapes if s != "default" and not s.startswith("chain")]
    trees += [t for t in kind_trees.values() if t and "default" in args.shapes]
    largest = max(trees, key=lambda s: parse_tree(s, 10**6).scratch_nodes)
    defaults = {}
    for draft in args.drafts:
        log(f"building the {draft} engine (room for {largest}, the shape that writes the most nodes)")
        engines[draft] = specgraph.Engine(model, tokenizer=tok, draft=draft, draft_tree=largest, adaptive=False)
        if "default" in args.shapes:  # the choice Engine(draft=..., adaptive=False) makes at build
            rates = choose_default_shape(engines[draft], parse_tree(kind_trees[draft], 10**6),
                                         4)  # (the Engine's default num_draft_tokens)
            defaults[draft] = (engines[draft].draft_tree, engines[draft].num_draft_tokens)
            log(f"{draft}: default shape timed on the calibration prompts, tok/s: "
                + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()))
    warm = chat_prompt_ids(tok, WARMUP_PROMPT)
    rows = [("none", "-")] + [(d, s) for d in engines if d != "none" for s in args.shapes]
    for draft, shape in rows:
        if draft != "none":
            configure(engines[draft], shape, defaults.get(draft))
        engines[draft].generate([warm], max_new_tokens=8, ignore_eos=True)
    results: dict[tuple, dict] = {}
    for rnd in range(args.repeats):
        for i, (group, ids) in enumerate(prompts):
            order = rows[(i + rnd) % len(rows):] + rows[:(i + rnd) % len(rows)]
            for temp in temps:
                for draft, shape in order:
                    if draft != "none":
                        configure(engines[draft], shape, defaults.get(draft))
                    r = run(engines[draft], ids, n, temp)
                    key = (draft, shape, temp, i)
                    if key not in results or r["elapsed_s"] < results[key]["elapsed_s"]:
                        results[key] = dict(r, group=group)
        log(f"round {rnd + 1}/{args.repeats} done")
    lines = [f"bench_trees: {args.model}, {n} new tokens per prompt, {args.threads} threads, batch 1",
             f"CPU: {cpu_description()}", ""]
    groups = sorted({g for g, _ in prompts}, key=lambda g: (g.startswith("heldout"), g))
    report = {"cpu": cpu_description(), "new_tokens": n, "rows": []}
    mismatches = []
    for temp in temps:
        table = []
        for draft, shape in rows:
            cells = [draft, shape]
            for g in groups:
                rs = [results[(draft, shape, temp, i)] for i, (gg, _) in enumerate(prompts) if gg == g]
                base = [results[("none", "-", temp, i)] for i, (gg, _) in enumerate(prompts) if gg == g]
                tps = sum(len(r["tokens"]) for r in rs) / sum(r["elapsed_s"] for r in rs)
                tps0 = sum(len(r["tokens"]) for r in base) / sum(r["elapsed_s"] for r in base)
                steps = sum(r["steps"] for r in rs)
                acc = sum(r["emitted"] for r in rs) / max(1, sum(r["forwards"] for r in rs))
                cells += [fmt(tps, ".1f"), fmt(tps / tps0, ".2f") + "x",
                          fmt(acc if draft != "none" else None), fmt(sum(r["nodes"] for r in rs) / steps if steps else None,
                                                                     ".1f")]
                report["rows"].append(dict(draft=draft, shape=shape, temperature=temp, group=g, tok_s=tps,
                                           speedup=tps / tps0, mean_accepted_tokens=acc))
            table.append(cells)
            if temp == 0.0 and draft != "none":
                for i, _ in enumerate(prompts):
                    if results[(draft, shape, temp, i)]["tokens"] != results[("none", "-", temp, i)]["tokens"]:
                        mismatches.append(f"{draft} {shape} prompt {i}")
        headers = ["draft", "shape"] + [f"{g} {h}" for g in groups for h in ("tok/s", "vs none", "acc/fwd", "nodes")]
        lines += [f"temperature {temp}:", format_table(headers, table, right=set(range(2, len(headers)))), ""]
    report["default_shapes"] = {d: tree or f"chain {k}" for d, (tree, k) in defaults.items()}
    for draft, shape in report["default_shapes"].items():
        lines.append(f"default: {draft} with adaptive=False and no draft_tree drafts {shape} here")
    lines.append("lossless (greedy tokens equal to none): " + ("yes" if not mismatches else "NO: " + ", ".join(mismatches)))
    print_report(lines, report, args.json)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
