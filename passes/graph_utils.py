"""Small helpers shared by the decoder passes: adding inputs, refreshing metadata."""
from __future__ import annotations

from typing import Any

import torch
from torch._dispatch.python import enable_python_dispatcher
import torch.fx as fx


def add_input(gm: fx.GraphModule, name: str, fake_val: Any) -> fx.Node:
    """Append a placeholder named ``name`` after the existing ones (its ``meta["val"]`` set)."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if any(p.name == name for p in placeholders):
        raise ValueError(f"graph already has an input named {name!r}")
    anchor = placeholders[-1] if placeholders else next(iter(graph.nodes))
    with graph.inserting_after(anchor):
        node = graph.placeholder(name)
    node.meta["val"] = fake_val
    return node


def attr_value(gm: fx.GraphModule, target: str):
    """The object a ``get_attr`` node with this ``target`` ("a.b.c") reads, or None."""
    value = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def graph_device(gm: fx.GraphModule) -> torch.device:
    """The device of the graph's tensor inputs (the model's: capture fakeifies the real inputs)."""
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    return torch.device("cpu")


def fake_like(gm: fx.GraphModule, shape, dtype) -> torch.Tensor:
    """A fake tensor (of the capture's fake mode, on the graph's device) for a new input's metadata."""
    with gm.meta["fake_mode"]:
        return torch.empty(shape, dtype=dtype, device=graph_device(gm))


def is_whole_size(target) -> bool:
    """``aten.size(x)`` (the packet or its overload), which some torch versions capture for ``x.size()``."""
    return target is torch.ops.aten.size or target is torch.ops.aten.size.default


class _FakeProp(fx.Interpreter):
    """Runs the graph on fake values, parameters included, recording each node's ``meta["val"]``."""

    def __init__(self, gm: fx.GraphModule, mode):
        super().__init__(gm)
        self.mode = mode

    def placeholder(self, target, args, kwargs):
        return self.current_node.meta["val"]

    def get_attr(self, target, args, kwargs):
        val = self.current_node.meta.get("val")
        if val is not None:
            return val
        # static: a weight's sizes are constants, and symbols for them would add guards to Dynamo's shapes
        return self.mode.from_tensor(super().get_attr(target, args, kwargs), static_shapes=True)

    def call_function(self, target, args, kwargs):
        if is_whole_size(target):  # a fake dispatch returns ints (a guard on each symbol)
            return tuple(args[0].size())
        return super().call_function(target, args, kwargs)

    def run_node(self, n):
        self.current_node = n
        if n.op not in ("call_function", "call_method", "call_module"):
            out = super().run_node(n)
            if n.op != "output":
                n.meta["val"] = out
            return out
        inputs = (n.target, fx.node.map_arg((n.args, n.kwargs), lambda a: _Same(self.env[a])))
        memo = n.meta.get(_MEMO)
        old = n.meta.get("val")
        if memo is not None and memo[1] is old and _equal(memo[0], inputs):
            return old  # the same op on the same values: the same value
        out = super().run_node(n)
        if old is not None and _same_fake(old, out):
            out = old  # unchanged: the nodes that read it need not run again
        n.meta["val"] = out
        n.meta[_MEMO] = (inputs, out)
        return out


_MEMO = "specgraph_fake_inputs"  # (target and arguments with the values they had, the value computed from them)


class _Same:
    """An argument's fake value, equal only to the very same object."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, _Same) and other.value is self.value

    __hash__ = None


def _equal(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an argument whose == is not a bool (a tensor constant): compute again
        return False


def _exprs(sizes) -> tuple:
    """Sizes as ints and sympy expressions (comparing SymInts themselves would add guards)."""
    return tuple(s.node.expr if isinstance(s, torch.SymInt) else s for s in sizes)


def _same_fake(a, b) -> bool:
    """Whether two fake values have the same type, dtype, device, sizes and strides (sizes compared as
    expressions: no guards)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (type(a) is type(b) and a.dtype == b.dtype and a.device == b.device
                and a.requires_grad == b.requires_grad and _exprs(a.shape) == _exprs(b.shape)
                and _exprs((*a.stride(), a.storage_offset())) == _exprs((*b.stride(), b.storage_offset())))
    if isinstance(a, (tuple, list)) and type(a) is type(b):
        return len(a) == len(b) and all(_same_fake(x, y) for x, y in zip(a, b))
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)) and type(a) is type(b):
        return a.node.expr == b.node.expr
    if a is None or isinstance(a, (bool, int, float)):
        return type(a) is type(b) and a == b
    return False


def refresh_meta(gm: fx.GraphModule) -> None:
    """Recompute every node's ``meta["val"]`` from the inputs' and parameters' fake values.

    A node runs again only when its op, its constant arguments or the value of one of its inputs
    changed since the last refresh, and a value that comes out the same as before stays the same
    object, so a pass that rewrote a few nodes pays for those and the nodes whose inputs they changed
    (fake propagation with symbolic sizes costs milliseconds a node: refreshing all of SmolLM2's
    ~2,000 nodes after each pass was half its capture time).

    Under the Python dispatcher, as Dynamo and make_fx trace: composite ops (``aten.matmul``) then
    run their symbolic Python decompositions. Their C++ kernels read concrete sizes on some
    devices (torch 2.11 on CUDA: RoPE's matmul pinned the sequence length to its sample's, and
    Dynamo refused the specialization).
    """
    mode = gm.meta["fake_mode"]
    with mode, enable_python_dispatcher(), torch.no_grad():
        _FakeProp(gm, mode).run()


def remove_dead_code(graph: fx.Graph) -> bool:
    """Erase nodes nothing uses, keeping ops that mutate (the cache writes).

    Random ops are pure here: FX's own default treats them (SDPA, with its dropout argument) as
    impure outside a Dynamo tracing context, which made the result depend on where a pass ran.
    """
    return graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure(impure_random=False))
