"""hidden_states: the program also returns the last hidden state of every token of the step.

Invariant: the logits (and every other output) are unchanged; one output is appended: the LM head's
input (the final hidden state, after the model's final norm) of all the stream's tokens,
``[1, N, hidden]``, whichever rows get logits (it is computed anyway: the LM head reads its
selected rows). A draft head needs the features of every prompt token, while only the last one
needs logits. Found by structure (the input of the linear layer that makes the logits), not
by hooks into one library's modules, so any decoder the compiler accepts has it: the features a
draft head (EAGLE) drafts from. Runs only with ``options.hidden_states``.

Before / after::

    logits = aten.linear(aten.index_select(h, 1, logits_indices), lm_head)
    return (logits, ...)
    ->
    logits = aten.linear(aten.index_select(h, 1, logits_indices), lm_head)
    return (logits, ..., h)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..compiler.analysis import output_nodes
from ..compiler.passes import PassContext, PassResult

aten = torch.ops.aten


def hidden_states(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    if not ctx.options.hidden_states:
        return PassResult(modified=False)
    logits = ctx.analysis.logits
    if logits.op != "call_function" or logits.target != aten.linear.default or not ctx.selects_logits:
        raise ValueError(f"hidden_states: the logits come from {logits.target}, not an LM head linear over the "
                         f"selected rows; this model's last hidden state cannot be found by structure")
    leaves = output_nodes(gm.graph)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    picked = logits.args[0]  # index_select(h, 1, logits_indices), select_logits' node
    output.args = (tuple(leaves) + (picked.args[0],),)  # flat: the logits keep their index
    ctx.hidden_index = len(leaves)
    return PassResult(matched=1)
