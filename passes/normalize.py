"""normalize: remove no-op nodes and dead code from a captured ATen graph.

Invariant: outputs are unchanged bit for bit; only nodes that return their input unchanged
(or a view equal to it) are removed.

Before / after::

    dropout = aten.dropout(x, 0.1, False)        # train=False: identity
    to = aten.to.dtype(dropout, torch.float32)   # x is already float32
    y = aten.linear(to, w)
    ->
    y = aten.linear(x, w)

Cases: ``dropout(train=False)``, ``to``/``type_as`` to the same dtype, ``alias``/``detach``,
full slices ``slice(x, d, 0, >= size)``, ``x + 0``, ``x * 1``, ``cat`` with empty operands (a
cache-free capture of a model that still concatenates an empty past), then dead-code elimination.
A whole-size read ``aten.size(x)`` indexed by ``getitem`` becomes one ``sym_size.int(x, d)`` per
dimension (some torch versions capture ``x.size()`` so; re-running it on fake tensors reads every
dimension as an int, which pins the dynamic sequence length).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..compiler.passes import PassContext, PassResult
from .graph_utils import is_whole_size, remove_dead_code

aten = torch.ops.aten
INT_MAX = 2**63 - 1


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _expr(x):
    x = _val(x) if isinstance(x, fx.Node) else x
    return x.node.expr if isinstance(x, torch.SymInt) else x


def _same_dtype(node: fx.Node) -> bool:
    src, out = _val(node.args[0]), _val(node)
    return isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.dtype == out.dtype \
        and src.device == out.device


def _identity_input(node: fx.Node) -> fx.Node | None:
    """The input ``node`` returns unchanged, or None."""
    t, args = node.target, node.args
    if t == aten.dropout.default and (len(args) < 3 or args[2] is False):
        return args[0]
    if t in (aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.type_as.default, aten._to_copy.default) \
            and _same_dtype(node):
        return args[0]
    if t in (aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default):
        return args[0]
    if t == aten.slice.Tensor and len(args) >= 4:
        src = _val(args[0])
        dim, start, end = args[1], args[2], args[3]
        step = args[4] if len(args) > 4 else 1
        if start == 0 and step == 1 and (end == INT_MAX or (isinstance(src, torch.Tensor) and _expr(end) == _expr(src.shape[dim]))):
            return args[0]
    if t == aten.add.Tensor and len(args) == 2 and not isinstance(args[1], fx.Node) and args[1] == 0 \
            and _same_dtype(node):
        return args[0]
    if t == aten.mul.Tensor and len(args) == 2 and not isinstance(args[1], fx.Node) and args[1] == 1 \
            and _same_dtype(node):
        return args[0]
    return None


def _drop_empty_cat_operands(node: fx.Node) -> fx.Node | None:
    if node.target != aten.cat.default:
        return None
    tensors = node.args[0]
    keep = [t for t in tensors if not (isinstance(_val(t), torch.Tensor) and _val(t).numel() == 0
                                       and isinstance(_val(t).shape[0], int))]
    if len(keep) == 1 and len(keep) < len(tensors) and _val(keep[0]).shape == _val(node).shape:
        return keep[0]
    return None


def normalize(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    removed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        src = _identity_input(node) or _drop_empty_cat_operands(node)
        if src is not None:
            node.replace_all_uses_with(src)
            removed += 1
    removed += _split_size_reads(gm.graph)
    # detach_ on a lifted constant is an in-place op with no effect on the value; drop unused ones
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target == aten.detach_.default and not node.users:
            gm.graph.erase_node(node)
    remove_dead_code(gm.graph)
    return PassResult(modified=removed > 0, matched=removed)


def _split_size_reads(graph: fx.Graph) -> int:
    """``getitem(aten.size(x), d)`` -> ``sym_size.int(x, d)``; returns how many size reads went."""
    split = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not is_whole_size(node.target):
            continue
        if not all(u.op == "call_function" and u.target is operator.getitem for u in node.users):
            continue
        for user in list(node.users):
            with graph.inserting_before(user):
                dim = graph.call_function(aten.sym_size.int, (node.args[0], user.args[1]))
            dim.meta.update(user.meta)
            user.replace_all_uses_with(dim)
            graph.erase_node(user)
        graph.erase_node(node)
        split += 1
    return split
