"""fuse_linears: linear layers that read the same input become one linear over stacked weights.

Invariant: outputs are unchanged (each output column is still the dot product of the same input
row with the same weight row; only the GEMM's blocking may differ, so up to float rounding).

Why: a decoder layer runs q, k and v projections on one normed input, and gate and up
projections on another. On a CPU decode step (a handful of rows) every GEMM call streams its
weight once and pays a fixed start-up cost; one call over the stacked weight pays it once
(measured on SmolLM2, 2 threads: 3 + 2 calls -> 1 + 1 per layer). On GPUs it is the usual
QKV / gate-up fusion (fewer, larger kernels).

Before / after::

    q = aten.linear(x, wq); k = aten.linear(x, wk); v = aten.linear(x, wv)
    ->
    qkv = aten.linear(x, fused_linear_0)          # fused_linear_0 = cat([wq, wk, wv])
    q, k, v = aten.split_with_sizes(qkv, [dq, dk, dv], -1)

Only linears whose weights (and biases, all or none) are graph constants (``get_attr``) of the
same dtype and device are fused; the stacked weight is a new buffer of the graph module, and the
stacked linear's ``meta["fused_from"]`` lists ``(weight name, rows)`` of its parts in order.
"""
from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx as fx

from ..compiler.passes import PassContext, PassResult
from .graph_utils import attr_value, refresh_meta

aten = torch.ops.aten


def _constant(gm: fx.GraphModule, node) -> torch.Tensor | None:
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    value = attr_value(gm, node.target)
    return value if isinstance(value, torch.Tensor) else None


def _fusable(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op != "call_function" or node.target != aten.linear.default or node.kwargs:
        return False
    w = _constant(gm, node.args[1])
    bias = node.args[2] if len(node.args) > 2 else None
    return w is not None and w.dim() == 2 and (bias is None or _constant(gm, bias) is not None)


def _stack_key(gm: fx.GraphModule, node: fx.Node):
    w = _constant(gm, node.args[1])
    has_bias = len(node.args) > 2 and node.args[2] is not None
    return node.args[0], w.shape[1], w.dtype, w.device, has_bias


def fuse_linears(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    groups: dict[tuple, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if _fusable(gm, node):
            groups[_stack_key(gm, node)].append(node)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    fused = 0
    for key, nodes in groups.items():
        if len(nodes) < 2:
            continue
        has_bias = key[-1]
        weights = [_constant(gm, n.args[1]) for n in nodes]
        name = f"fused_linear_{fused}"
        gm.register_buffer(f"{name}_weight", torch.cat(weights).detach())
        if has_bias:
            gm.register_buffer(f"{name}_bias", torch.cat([_constant(gm, n.args[2]) for n in nodes]).detach())
        first = min(nodes, key=order.__getitem__)
        g = gm.graph
        with g.inserting_before(first):
            w_node = g.get_attr(f"{name}_weight")
            args = (key[0], w_node) + ((g.get_attr(f"{name}_bias"),) if has_bias else ())
            stacked = g.call_function(aten.linear.default, args)
            # which weights the stacked rows came from (calibrated quantization solves each on its own)
            stacked.meta["fused_from"] = [(n.args[1].target, w.shape[0]) for n, w in zip(nodes, weights)]
            parts = g.call_function(aten.split_with_sizes.default, (stacked, [w.shape[0] for w in weights], -1))
            outs = [g.call_function(operator.getitem, (parts, i)) for i in range(len(nodes))]
        for old, new in zip(nodes, outs):
            old.replace_all_uses_with(new)
            g.erase_node(old)
        fused += 1
    if fused:
        gm.graph.eliminate_dead_code()  # also drops the separate weights' get_attr nodes (pure)
        refresh_meta(gm)
    return PassResult(modified=fused > 0, matched=fused)
