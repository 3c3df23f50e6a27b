"""positions: token positions become a program input.

Invariant: with ``positions = arange(T)`` the outputs are unchanged. Every tensor that holds the
token's index in the sequence (an ``arange``, OPT's ``cumsum(mask) * mask - 1``; found by the
analysis's index algebra) feeding rotary angles, learned position embeddings or mask construction
now reads the ``positions`` input, so a token stream can carry tokens of several sequences at any offsets.

Before / after::

    arange = aten.arange(ids_size1)                 # [T]
    emb = aten.embedding(wpe, arange)
    ->
    positions: "i64[T]"                              # new input
    emb = aten.embedding(wpe, positions)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..compiler.passes import PassContext, PassResult
from ..compiler.signature import Role

aten = torch.ops.aten


def positions(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    analysis = ctx.analysis
    ids = analysis.input_ids
    if analysis.seq_len is None:
        raise ValueError("the decoder was captured with a static sequence length; compile with dynamic=True "
                         "or torch._dynamo.mark_dynamic(input_ids, 1)")
    ids_val = ids.meta["val"]
    if ids_val.shape[0] != 1:
        raise ValueError(f"decoder programs run one token stream [1, N]; the capture has batch {ids_val.shape[0]}")
    pos = ctx.signature.add(gm, "positions", ids_val[0].clone(), Role.POSITIONS)
    replaced = 0
    for src in analysis.position_sources:
        dtype = src.meta["val"].dtype
        repl = pos
        with gm.graph.inserting_after(src):
            if dtype != torch.int64:
                repl = gm.graph.call_function(aten.to.dtype, (repl, dtype))
            if src.meta["val"].dim() == 2:  # [1, T]
                repl = gm.graph.call_function(aten.unsqueeze.default, (repl, 0))
        src.replace_all_uses_with(repl)
        gm.graph.erase_node(src)
        replaced += 1
    T = ctx.sample_inputs[ids.name].shape[1] if ids.name in ctx.sample_inputs else None
    if T is not None:
        ctx.sample_inputs["positions"] = torch.arange(T)
    return PassResult(matched=replaced)
