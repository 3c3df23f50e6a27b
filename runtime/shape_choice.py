"""The draft shape of fixed speculation (``adaptive=False``) when none is given: measured on this machine.

A learned draft's kind names a default token tree (EAGLE's: ``static:2,1,1``, 7 tokens a verify). Whether
a tree beats a chain depends on what verifying its tokens costs here: on a 2-core CPU a 7-token verify
costs 1.2-1.5x a decode, and chains of 2 won (``bench_trees.py``, held-out code: 1.22x plain decoding
against the tree's 0.98x); where a step's cost barely grows with its tokens, the tree's extra paths
are nearly free. So an engine given a learned draft, no ``draft_tree`` and
``adaptive=False`` times the candidates, the kind's tree and the chains within its depth, replying to four
built-in prompts (two code tasks, two chat questions; tuning material, never a report set), and keeps the
fastest. The figures are kept beside the program's graph-cache entry, for this machine, head and weight
storage, so only the first build pays. With ``adaptive`` (the default) the controller makes this choice
at every step instead, so nothing is measured.
"""
from __future__ import annotations

import hashlib
import time
from typing import Callable

from ..compiler.graph_cache import measurement_path, read_json, write_json
from .token_tree import TreeShape

CALIBRATION_PROMPTS = (
    "Write a Python function `word_counts(text)` that returns a dict mapping each lower-cased word to the "
    "number of times it appears, ignoring punctuation. Add a docstring and one example.",
    "What are three good ways to keep a houseplant healthy through the winter?",
    "Write a JavaScript function that checks whether a string is a palindrome, ignoring case, spaces and "
    "punctuation, with two example calls.",
    "Explain the difference between weather and climate in a short paragraph.",
)


def candidate_shapes(tree: TreeShape, num_draft_tokens: int, branch: bool = False) -> dict[str, tuple[str | None, int]]:
    """The shapes to time, by label: the tree (``draft_tree``, ``num_draft_tokens`` as given) and each chain
    of ``k = 1 .. min(depth, num_draft_tokens)`` drafts (no tree). ``branch``: the proposer adds a lookup
    branch to its trees only (``proposers/lookup_branch.py``), so each chain is also timed as a one-path
    tree, ``static:1,...,1``, which takes the branch beside it."""
    shapes: dict[str, tuple[str | None, int]] = {str(tree): (str(tree), num_draft_tokens)}
    for k in range(1, min(tree.depth, num_draft_tokens) + 1):
        shapes[f"chain {k}"] = (None, k)
        if branch:
            path = "static:" + ",".join(["1"] * k)
            shapes.setdefault(path, (path, num_draft_tokens))
    return shapes


def calibration_prompts(tokenizer) -> list[list[int]] | None:
    """:data:`CALIBRATION_PROMPTS` as user turns under the tokenizer's chat template (None without one)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    out = []
    for text in CALIBRATION_PROMPTS:
        templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True)
        out.append(tokenizer(templated, add_special_tokens=False)["input_ids"])
    return out


def use_shape(engine, shape: tuple[str | None, int]) -> None:
    """Make ``engine`` draft in ``shape`` (a :func:`candidate_shapes` value)."""
    tree, k = shape
    engine.draft_tree = tree
    engine.num_draft_tokens = k


def measure_shapes(engine, shapes: dict[str, tuple[str | None, int]], prompts: list[list[int]],
                   new_tokens: int = 64) -> dict[str, float]:
    """Tokens per second of greedy replies to ``prompts`` (one at a time: batch 1) in each shape, over all the
    prompts; each prompt runs every shape in turn, so a slow moment of the machine is shared out."""
    engine.generate(prompts, max_new_tokens=2)  # prompts prefilled and cached, first-call costs paid
    tokens = dict.fromkeys(shapes, 0)
    seconds = dict.fromkeys(shapes, 0.0)
    for prompt in prompts:
        for label, shape in shapes.items():
            use_shape(engine, shape)
            t0 = time.perf_counter()
            tokens[label] += len(engine.generate([prompt], max_new_tokens=new_tokens, ignore_eos=True)[0].token_ids)
            seconds[label] += time.perf_counter() - t0
    return {label: tokens[label] / seconds[label] for label in shapes}


def choose_shape(engine, shapes: dict[str, tuple[str | None, int]], prompts: list[list[int]], identity: str | None,
                 measure: Callable[..., dict[str, float]] = measure_shapes) -> dict[str, float]:
    """Time ``shapes`` (or read the figures kept for this program, machine and draft ``identity``), make the
    engine draft in the fastest, and return the figures (tokens per second by label)."""
    labels = "_".join(label.replace(" ", "") for label in shapes)
    material = hashlib.blake2b(repr(prompts).encode(), digest_size=4).hexdigest()  # (other prompts: measure again)
    program = engine.program  # (its key names the graph, not how its steps run)
    path = (measurement_path(program.cache_key, f"draft-shape-{identity}-{program.lowering}-{labels}-{material}")
            if identity else None)
    rates = read_json(path) if path is not None else None
    if not (isinstance(rates, dict) and set(rates) == set(shapes)):
        rates = measure(engine, shapes, prompts)
        if path is not None:
            write_json(path, rates)
    use_shape(engine, shapes[max(rates, key=rates.get)])
    engine.reset_stats()
    return rates


def choose_default_shape(engine, tree: TreeShape, num_draft_tokens: int) -> dict[str, float] | None:
    """:func:`choose_shape` over ``tree``'s candidates on the calibration prompts, the figures kept for the
    engine's draft head; None (nothing changed) without a tokenizer that has a chat template."""
    prompts = calibration_prompts(engine.tokenizer)
    if prompts is None:
        return None
    head = getattr(engine.proposer, "head", None)
    identity = head.identity() if head is not None else None
    branch = getattr(engine.proposer, "extra_tree_nodes", 0) > 0  # its trees hold a lookup branch
    if identity is not None and branch:
        identity += f"-{engine.proposer.name}"
    return choose_shape(engine, candidate_shapes(tree, num_draft_tokens, branch), prompts, identity)
