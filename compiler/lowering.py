"""Lowering: the ``specgraph::`` ops of a decoder graph -> direct calls of their implementations.

The passes emit opaque custom ops (``torch.ops.specgraph.*``) so the graph stays traceable by
FakeTensor, Inductor and torch-mlir. To *run* it we replace each op by a plain function that
picks the implementation per call: the Triton launcher for CUDA tensors (or on CPU inside
``use_triton_kernels()``, through the interpreter) and the pure-torch reference otherwise. This
skips the custom-op dispatcher's Python layers (about 0.1 ms per call, 60 calls per SmolLM2
step). New kernels register here with :func:`register_lowering`.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from ..kernels import quant_cache_write, quant_paged_attention
from ..kernels.cache_write import cache_write_ref, cache_write_triton
from ..kernels.config import use_triton_for
from ..kernels.paged_attention import paged_attention_ref, paged_attention_triton
from .passes import copy_graph_module

_LOWERINGS: dict[object, Callable] = {}


def register_lowering(op, reference: Callable, triton_impl: Callable | None) -> None:
    """Run ``op`` as ``reference`` on CPU and ``triton_impl`` on CUDA (or when Triton is forced)."""

    def dispatch(*args):
        return (triton_impl if triton_impl is not None and use_triton_for(args[0]) else reference)(*args)

    dispatch.__name__ = f"{getattr(op, '__name__', 'op').split('.')[0]}_impl"
    _LOWERINGS[op] = dispatch


register_lowering(torch.ops.specgraph.cache_write.default, cache_write_ref, cache_write_triton)
register_lowering(torch.ops.specgraph.paged_attention.default, paged_attention_ref, paged_attention_triton)
for _scheme in ("fp8", "int4"):
    register_lowering(getattr(torch.ops.specgraph, f"cache_write_{_scheme}").default,
                      getattr(quant_cache_write, f"cache_write_{_scheme}_ref"),
                      getattr(quant_cache_write, f"cache_write_{_scheme}_triton"))
    register_lowering(getattr(torch.ops.specgraph, f"paged_attention_{_scheme}").default,
                      getattr(quant_paged_attention, f"paged_attention_{_scheme}_ref"),
                      getattr(quant_paged_attention, f"paged_attention_{_scheme}_triton"))


def lower(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose specgraph ops call their implementations directly."""
    lowered = copy_graph_module(gm)
    for node in lowered.graph.nodes:
        if node.op == "call_function" and node.target in _LOWERINGS:
            node.target = _LOWERINGS[node.target]
    lowered.recompile()
    return lowered
