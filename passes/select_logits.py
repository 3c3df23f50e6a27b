"""select_logits: compute the LM head only for the tokens whose logits are needed.

Invariant: with ``logits_indices = arange(N)`` the outputs are unchanged; in general the output
is the original logits at rows ``logits_indices``. A prefill needs one row per sequence, so
the 49k-wide LM head stops costing a matrix product per prompt token.

Before / after::

    logits = aten.linear(h, lm_head)                      # [1, N, V]
    ->
    logits = aten.linear(aten.index_select(h, 1, logits_indices), lm_head)   # [1, M, V]
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..compiler.passes import PassContext, PassResult
from ..compiler.signature import Role
from .graph_utils import refresh_meta

aten = torch.ops.aten


def select_logits(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    logits = ctx.analysis.logits
    if logits.op != "call_function" or logits.target != aten.linear.default:
        return PassResult(modified=False, info={"skipped": f"logits come from {logits.target}, not aten.linear"})
    sig = ctx.signature
    idx = sig.add(gm, "logits_indices", sig.input(gm, Role.POSITIONS).meta["val"].clone(), Role.LOGITS_INDICES)
    hidden = logits.args[0]
    with gm.graph.inserting_before(logits):
        picked = gm.graph.call_function(aten.index_select.default, (hidden, 1, idx))
    logits.update_arg(0, picked)
    ctx.selects_logits = True
    if "positions" in ctx.sample_inputs:
        ctx.sample_inputs["logits_indices"] = torch.arange(ctx.sample_inputs["positions"].numel())
    refresh_meta(gm)
    return PassResult(matched=1)
