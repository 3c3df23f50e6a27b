"""tree_mask: every attention site takes the step's token-tree mask, so one forward verifies a tree.

Invariant: with every row of ``tree_mask`` all ones (a chain, a decode or a prefill chunk) the
outputs are unchanged; a tree's rows let each of its tokens see the committed keys and its own
ancestors only (the rule: ``kernels/tree_mask.py``). Runs only when ``options.tree_nodes > 0``:
without trees the program is the same as before.

Before / after::

    o = specgraph.paged_attention(q, kc, vc, block_tables, seq_lens, qsl, positions, scale, *variant)
    ->
    tree_mask: "i32[N, W]"                                   # new input, W = ceil(tree_nodes / 32)
    o = specgraph.paged_attention(q, kc, vc, block_tables, seq_lens, qsl, positions, scale, *variant, tree_mask)
(and the same for ``paged_attention_fp8`` / ``_int4`` / ``_mixed``.)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..compiler.passes import PassContext, PassResult
from ..compiler.signature import Role
from ..kernels.tree_mask import causal_rows, mask_words
from .graph_utils import refresh_meta

specgraph = torch.ops.specgraph
ATTENTION_OPS = (specgraph.paged_attention.default, specgraph.paged_attention_fp8.default,
                 specgraph.paged_attention_int4.default, specgraph.paged_attention_mixed.default)


def tree_mask(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    if ctx.options.tree_nodes <= 0:
        return PassResult(modified=False)
    words = mask_words(ctx.options.tree_nodes)
    sig = ctx.signature
    positions = sig.input(gm, Role.POSITIONS).meta["val"]
    with gm.meta["fake_mode"]:
        fake = positions.new_empty((positions.shape[0], words), dtype=torch.int32)
    mask = sig.add(gm, "tree_mask", fake, Role.TREE_MASK)
    sites = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ATTENTION_OPS]
    if not sites:
        raise ValueError("tree_mask: the program has no paged attention site to mask")
    for node in sites:  # positional, as every lowering calls the op's implementations
        names = [a.name for a in node.target._schema.arguments]
        args = list(node.args) + [node.kwargs.get(a.name, a.default_value)
                                  for a in node.target._schema.arguments[len(node.args):names.index("tree_mask")]]
        node.args, node.kwargs = (*args, mask), {}
    if "positions" in ctx.sample_inputs:
        ctx.sample_inputs["tree_mask"] = causal_rows(int(ctx.sample_inputs["positions"].numel()), words)
    refresh_meta(gm)
    return PassResult(matched=len(sites))
