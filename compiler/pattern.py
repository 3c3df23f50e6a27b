"""Pattern rewriting: find a subgraph written as a torch function and replace it with another.

Both functions are traced to the same normalized ATen level as captured graphs, so a pattern
written with ``torch``/``F`` calls matches what capture produced. Example::

    def pattern(x):
        return torch.nn.functional.silu(x) * 1.0
    def replacement(x):
        return torch.nn.functional.silu(x)
    n = rewrite(gm, pattern, replacement, [torch.randn(4, 8)])
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.subgraph_rewriter import replace_pattern_with_filters


def trace_aten(fn: Callable, example_inputs: Sequence[torch.Tensor]) -> fx.GraphModule:
    """Trace ``fn`` to the normalized ATen level used by the compiler."""
    with torch.no_grad():
        return make_fx(fn, pre_dispatch=True)(*example_inputs)


def rewrite(gm: fx.GraphModule, pattern: Callable, replacement: Callable, example_inputs: Sequence[torch.Tensor],
            match_filter: Callable | None = None) -> int:
    """Replace every match of ``pattern`` in ``gm`` by ``replacement``; returns the number of matches.

    ``match_filter(match, original_graph, pattern_graph) -> bool`` can reject a match (for example
    when a constant must have a given value for the rewrite to be legal).
    """
    pat = trace_aten(pattern, example_inputs)
    rep = trace_aten(replacement, example_inputs)
    matches = replace_pattern_with_filters(gm, pat, rep, match_filters=[match_filter] if match_filter else None)
    gm.recompile()
    return len(matches)
