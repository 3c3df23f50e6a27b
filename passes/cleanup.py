"""cleanup: remove what the cache passes made dead (causal-mask construction, aranges, repeats).

Invariant: outputs are unchanged; only nodes without users and without side effects go (the
cache writes mutate their inputs, so FX keeps them).
"""
from __future__ import annotations

import torch.fx as fx

from ..compiler.passes import PassContext, PassResult
from .graph_utils import remove_dead_code


def cleanup(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    before = len(gm.graph.nodes)
    remove_dead_code(gm.graph)
    removed = before - len(gm.graph.nodes)
    return PassResult(modified=removed > 0, matched=removed)
