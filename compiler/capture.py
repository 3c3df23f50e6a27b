"""Capture: a Dynamo graph -> a normalized ATen-level FX graph with a symbolic sequence length.

Dynamo hands the backend a torch-level graph whose parameters are placeholders (inlined nn
modules) and, when the sequence dimension is dynamic, a SymInt input. We re-trace it with
``make_fx(pre_dispatch=True)`` inside Dynamo's own fake mode, which gives ATen ops that are the
same on every device (``aten.linear``, ``aten.scaled_dot_product_attention`` stay whole; the
device-specific flash/efficient SDPA variants only appear after dispatch) while keeping Dynamo's
symbolic sizes: every ``node.meta["val"]`` carries SymInts whose ``.node.expr`` is a sympy
expression. Parameters and buffers become ``get_attr`` nodes holding the module's real tensors (by
reference, so in-place weight updates stay visible), and placeholders get readable names.
"""
from __future__ import annotations

import keyword
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

_ATTR_PART = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]")
_LOCAL = re.compile(r"^L\['(?:kwargs'\]\[')?([A-Za-z_][A-Za-z0-9_]*)'\]")


@dataclass
class GraphInput:
    """One runtime input of a captured graph (parameters are not inputs: they are get_attr)."""

    name: str  # placeholder name in the captured graph
    position: int  # index in the argument list Dynamo passes to the backend
    example: Any  # the example value Dynamo passed (real tensor or int)


@dataclass
class CapturedGraph:
    """A normalized ATen graph and how to feed it from Dynamo's argument list."""

    gm: fx.GraphModule
    inputs: list[GraphInput]
    params: dict[str, torch.Tensor] = field(default_factory=dict)

    def select_inputs(self, dynamo_args: tuple | list) -> list:
        """Pick this graph's runtime inputs out of the argument list Dynamo calls us with."""
        return [dynamo_args[i.position] for i in self.inputs]


def _source_name(node: fx.Node) -> str | None:
    grapharg = node.meta.get("grapharg")
    return grapharg.source.name if grapharg is not None else None


def _attribute_path(source: str) -> str | None:
    """``L['self']._modules['model']._parameters['weight']`` -> ``model.weight`` (None if not an attribute)."""
    parts = _ATTR_PART.findall(source)
    return ".".join(parts) if parts and ("._parameters[" in source or "._buffers[" in source) else None


def _input_name(source: str | None, value: Any, used: set[str]) -> str:
    if isinstance(value, (int, torch.SymInt)) and source and ".size()" in source:
        match = _LOCAL.match(source)
        base = f"{match.group(1)}_size" if match else "size"
        dim = source.rsplit("[", 1)[-1].rstrip("]")
        base = f"{base}{dim}"
    else:
        match = _LOCAL.match(source or "")
        base = match.group(1) if match else "input"
        if base in ("self", "args", "kwargs") and source:  # e.g. a float attribute Dynamo lifted to an input
            words = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", source.split("]", 1)[-1])
            base = words[-1] if words else "input"
    if keyword.iskeyword(base) or base in ("self", "input"):
        base = f"{base}_arg"
    name, k = base, 1
    while name in used:
        name, k = f"{base}_{k}", k + 1
    used.add(name)
    return name


def _fake_inputs(dynamo_gm: fx.GraphModule, example_inputs: list) -> tuple[Any, list]:
    context = torch._guards.TracingContext.try_get()
    fake_mode = context.fake_mode if context is not None else None
    placeholders = [n for n in dynamo_gm.graph.nodes if n.op == "placeholder"]
    if fake_mode is None:  # called outside Dynamo (tests, re-capture): static shapes
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        return fake_mode, [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    fakes = []
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, torch.Tensor):
            fakes.append(fake_mode.from_tensor(value))  # memoized: Dynamo's symbolic fake
        else:
            fakes.append(node.meta.get("example_value", value))
    return fake_mode, fakes


def capture(dynamo_gm: fx.GraphModule, example_inputs: list) -> CapturedGraph:
    """Re-trace a Dynamo graph into a normalized ATen graph (see module docstring)."""
    fake_mode, fakes = _fake_inputs(dynamo_gm, example_inputs)
    with fake_mode, torch.no_grad():
        aten_gm = make_fx(dynamo_gm, pre_dispatch=True, tracing_mode="real")(*fakes)

    dynamo_placeholders = [n for n in dynamo_gm.graph.nodes if n.op == "placeholder"]
    aten_placeholders = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
    assert len(dynamo_placeholders) == len(aten_placeholders) == len(example_inputs)

    params: dict[str, torch.Tensor] = {}
    inputs: list[GraphInput] = []
    used: set[str] = set()
    graph = aten_gm.graph
    for position, (dyn, node, value) in enumerate(zip(dynamo_placeholders, aten_placeholders, example_inputs)):
        source = _source_name(dyn)
        path = _attribute_path(source) if source else None
        if path is None and isinstance(value, torch.nn.Parameter):
            path = f"param_{position}"
        if path is not None:
            params[path] = value
            torch.fx.graph_module._assign_attr(value, aten_gm, path)
            with graph.inserting_before(node):
                attr = graph.get_attr(path)
            attr.meta = dict(node.meta)
            node.replace_all_uses_with(attr)
            graph.erase_node(node)
        else:
            name = _input_name(source, value, used)
            node.target = name
            node._rename(name)
            if isinstance(value, torch.SymInt):  # Dynamo passes the symbol; keep its concrete hint
                value = value.node.hint
            node.meta["example"] = value
            inputs.append(GraphInput(name=node.name, position=position, example=value))

    gm = fx.GraphModule(aten_gm, graph, class_name="CapturedDecoder")
    gm.meta["fake_mode"] = fake_mode
    return CapturedGraph(gm=gm, inputs=inputs, params=params)
