"""annotate: run the analysis and record symbolic shapes.

Invariant: the graph is not changed. Afterwards ``ctx.analysis`` holds the
:class:`~specgraph.compiler.analysis.GraphAnalysis` (attention sites, positions, embedding,
logits) and every node's ``meta["sym_shape"]`` holds its shape as sympy expressions
(``(1, s0, 576)``), so later passes and the dumps reason about sizes without guarding on them.
With ``options.self_check`` (or ``weight_calibration``), ``ctx.cache_free_gm`` keeps a copy of the
graph as analysed (weights shared), attention outputs tagged ``meta["attention_site"]``: the
compile-time self-check's reference, and what weight calibration runs.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..compiler.analysis import analyze
from ..compiler.passes import PassContext, PassResult, copy_graph_module
from ..compiler.signature import Role


def _sym(d):
    return d.node.expr if isinstance(d, torch.SymInt) else d


def _declare_captured_inputs(gm: fx.GraphModule, ctx: PassContext) -> None:
    """The capture's own inputs: the token ids, the symbolic length, and values Dynamo lifted out of
    the model (fed their captured value on every call)."""
    analysis = ctx.analysis
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        if node is analysis.input_ids:
            ctx.signature.declare(node, Role.TOKENS)
        elif node is analysis.seq_len:
            ctx.signature.declare(node, Role.LENGTH)
        else:
            ctx.signature.declare(node, Role.STATIC, value=node.meta.get("example"))


def annotate(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            node.meta["sym_shape"] = tuple(_sym(d) for d in val.shape)
        elif isinstance(val, torch.SymInt):
            node.meta["sym_expr"] = val.node.expr
    ctx.analysis = analyze(gm)
    _declare_captured_inputs(gm, ctx)
    sites = ctx.analysis.sites
    for site in sites:
        site.output.meta["attention_site"] = site.layer
    if ctx.options.self_check or ctx.options.weight_calibration:
        ctx.cache_free_gm = copy_graph_module(gm)
        ctx.cache_free_inputs = dict(ctx.sample_inputs)
    return PassResult(modified=False, matched=len(sites), info={"attention_sites": len(sites)})
