"""A learned head's weight storage: float against int8 (or any ``draft_weight_dtype``), in one run.

    .venv/bin/python benchmarks/bench_head_dtype.py [--head eagle] [--dtypes auto,int8] [--new-tokens 96]

One engine drafts with the head; its proposer's head is swapped between stored copies (float, then each
scheme) prompt by prompt, beside an engine without speculation, so every setting meets the same load.
Prefix caching is off (a head's K/V lives in the blocks: a cached block must not carry another copy's).
Prints, per shape (the head's default tree and chains of 2) and prompt class (held-out code and chat
prompts, chat template, greedy, batch 1, ``adaptive=False``): tok/s against no speculation, tokens per
target forward, and the drafting seconds per verify step; and whether greedy tokens equal no speculation's.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from statistics import mean

sys.path.insert(0, os.path.dirname(__file__))

import specgraph  # noqa: E402
from common import chat_prompt_ids, cpu_description, format_table, quiet_torch  # noqa: E402
from prompts import HELDOUT_CHAT_PROMPTS, HELDOUT_CODE_PROMPTS  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", default="eagle", help="a learned draft spec: eagle, medusa, eagle:PATH, ...")
    parser.add_argument("--dtypes", default="auto,int8", help="head storages to compare (auto: float)")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts per class")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    quiet_torch(args.threads)
    print(cpu_description(), flush=True)
    model, tok = specgraph.load_model()
    from specgraph.runtime.proposers import kind_of

    spec = specgraph.Engine(model, tokenizer=tok, draft=args.head, adaptive=False, prefix_caching=False,
                            draft_weight_dtype="auto",  # the kind's tree given: its rows set each shape
                            draft_tree=kind_of(args.head).default_tree)
    plain = specgraph.Engine(model, tokenizer=tok, prefix_caching=False)
    heads = {}
    for dtype in args.dtypes.split(","):
        head = copy.deepcopy(spec.proposer.head)
        heads[dtype] = head if dtype == "auto" else head.quantize(dtype)

    classes = {"code": [chat_prompt_ids(tok, p) for p in HELDOUT_CODE_PROMPTS[:args.prompts]],
               "chat": [chat_prompt_ids(tok, p) for p in HELDOUT_CHAT_PROMPTS[:args.prompts]]}
    for engine in (spec, plain):  # warm-up
        engine.generate(classes["code"][0], max_new_tokens=8)
    rows, identical = [], True
    for shape in (spec.default_tree, None):
        spec.draft_tree = shape
        if shape is None:
            spec.num_draft_tokens = 2
        name = shape or "chain 2"
        for cls, prompts in classes.items():
            runs: dict[str, list[tuple[float, float, float]]] = {}
            for prompt in prompts:
                plain.reset_stats()
                want = plain.generate(prompt, max_new_tokens=args.new_tokens, ignore_eos=True)[0].token_ids
                none_tps = plain.stats["tokens_per_second"]
                for dtype, head in heads.items():
                    spec.proposer.head = head
                    spec.reset_stats()
                    got = spec.generate(prompt, max_new_tokens=args.new_tokens, ignore_eos=True)[0].token_ids
                    identical &= got == want
                    s = spec.stats
                    runs.setdefault(dtype, []).append((s["tokens_per_second"] / none_tps, s["mean_accepted_tokens"],
                                                       s["draft_s"] / max(s["verify_steps"], 1)))
            for dtype, r in runs.items():
                rows.append([name, cls, "float" if dtype == "auto" else dtype, f"{mean(x[0] for x in r):.2f}x",
                             f"{mean(x[1] for x in r):.2f}", f"{mean(x[2] for x in r) * 1e3:.1f}"])
    print(format_table(["shape", "prompts", "head", "tok/s vs none", "tokens/forward", "draft ms/verify"], rows,
                       right={3, 4, 5}))
    print(f"greedy tokens identical to no speculation: {identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
