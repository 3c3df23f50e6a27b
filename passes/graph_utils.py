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
        out = super().run_node(n)
        if n.op != "output":
            n.meta["val"] = out
        return out


def refresh_meta(gm: fx.GraphModule) -> None:
    """Recompute every node's ``meta["val"]`` from the inputs' and parameters' fake values.

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
