"""Lowering: the ``specgraph::`` ops of a decoder graph -> direct calls of their implementations.

The passes emit opaque custom ops (``torch.ops.specgraph.*``) so the graph stays traceable by
FakeTensor, Inductor and torch-mlir. The eager lowering (``lowering="eager"``, the reference
path) runs the graph op by op, with each specgraph op replaced by a plain function that calls
the kernel registry (``kernels/registry.py``: Triton for CUDA tensors or when forced, the C++
kernel for CPU decodes, the torch reference otherwise). This skips the custom-op dispatcher's
Python layers (about 0.1 ms per call, 60 calls per SmolLM2 step). New kernels register their
implementations in the registry; nothing here changes. (The Inductor lowerings,
:mod:`.inductor`, keep the custom ops as extern calls, whose bodies call the same registry.)

On CPU, float32 ``aten.linear`` calls on constant weights also run over weights packed once, here
(``prepack=True``): specgraph's panel kernel (``kernels/panel_linear.py``) when the C++ kernels are
built, whose rows do not depend on each other (a verify's logits are bitwise a decode's) and which
streamed SmolLM2's weights faster than oneDNN at 1-28 rows and as fast at 64-256; else oneDNN's
blocked layout (1.6x to 2.4x ``aten.linear``'s MKL call at 1-8 rows). The packed copy is extra
memory: the graph module of the program keeps the plain weights (they are the model's).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from ..kernels import cpu_kernels
from ..kernels.registry import dispatch, implementations
from ..passes.graph_utils import attr_value
from .dump import Dumper
from .passes import copy_graph_module

_DIRECT: dict[str, Callable] = {}


def direct_call(op: str) -> Callable:
    """A plain function running ``specgraph::<op>`` through the kernel registry (no custom-op layers)."""
    if op not in _DIRECT:
        implementations(op)  # a clear KeyError for an op nothing implements

        def run(*args):
            return dispatch(op, *args)

        run.__name__ = f"{op}_impl"
        _DIRECT[op] = run
    return _DIRECT[op]


def _specgraph_op(target) -> str | None:
    """``torch.ops.specgraph.<op>.default`` -> ``"<op>"`` (None for any other target)."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "specgraph":
        return target._opname
    return None


def lower(gm: fx.GraphModule, prepack: bool = True, dump_dir: str | None = None) -> fx.GraphModule:
    """A copy of ``gm`` whose specgraph ops call their implementations directly (and whose CPU
    float32 linears run over weights packed once, with ``prepack``: :func:`cpu_linear_kind`).
    With ``dump_dir``, the C++ source of the CPU attention kernel is written there when it is used."""
    lowered = copy_graph_module(gm)
    for node in lowered.graph.nodes:
        op = _specgraph_op(node.target) if node.op == "call_function" else None
        if op is not None:
            node.target = direct_call(op)
    kind = cpu_linear_kind() if prepack else None
    if kind is not None:
        prepack_linears(lowered, kind)
    if _runs_cpu_kernels(lowered):
        cpu_kernels.build_now()  # compile the C++ kernels here, not in the middle of the first request
        if dump_dir:
            Dumper(dump_dir).write("cpu_kernels.cpp", cpu_kernels.CPP_SOURCE)
    lowered.recompile()
    return lowered


def bind_native_ops(gm: fx.GraphModule) -> int:
    """For generated code on CPU: each specgraph op with a native twin (``cpu_kernels.NATIVE_OPS``)
    calls the twin, which runs the C++ kernel straight from the dispatcher where it applies and the
    specgraph op (the registry) otherwise, so a compiled decode step runs no Python per layer.
    Returns how many nodes were rebound (0 when the C++ kernels are not built)."""
    count = 0
    for node in gm.graph.nodes:
        op = _specgraph_op(node.target) if node.op == "call_function" else None
        native = cpu_kernels.native_op(op) if op is not None else None
        if native is not None:
            node.target = native
            count += 1
    if count:
        gm.recompile()
    return count


def _runs_cpu_kernels(gm: fx.GraphModule) -> bool:
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    on_cpu = all(t.device.type == "cpu" for t in gm.parameters()) and all(t.device.type == "cpu" for t in gm.buffers())
    return direct_call("paged_attention") in targets and on_cpu


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


PREPACK_ROWS_HINT = 8  # oneDNN picks the weight layout for this many rows; measured fine for 1-16


def prepack_linears(gm: fx.GraphModule, kind: str = "onednn") -> int:
    """``aten.linear(x, w[, b])`` with ``w`` a CPU float32 constant -> a linear over ``w`` packed once
    (a new buffer ``<w>_<kind>``): ``"panel"``, specgraph's batch-invariant kernel
    (``kernels/panel_linear.py``), or ``"onednn"``, ``mkldnn._linear_pointwise`` over oneDNN's layout.
    Returns how many were rewritten."""
    from ..kernels import panel_linear

    packed: dict[str, str] = {}
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.linear.default or node.kwargs:
            continue
        w_node = node.args[1]
        if not isinstance(w_node, fx.Node) or w_node.op != "get_attr":
            continue
        w = attr_value(gm, w_node.target)
        if not (isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == torch.float32 and w.device.type == "cpu"):
            continue
        if w_node.target not in packed:
            name = w_node.target.replace(".", "_") + "_" + kind
            gm.register_buffer(name, panel_linear.packed(w) if kind == "panel" else
                               torch.ops.mkldnn._reorder_linear_weight(w.detach(), PREPACK_ROWS_HINT))
            packed[w_node.target] = name
        with gm.graph.inserting_before(node):
            packed_w = gm.graph.get_attr(packed[w_node.target])
        bias = node.args[2] if len(node.args) > 2 else None
        if kind == "panel":
            node.target = cpu_kernels.native_op("panel_linear")
            node.args = (node.args[0], packed_w, bias, w.shape[0])
        else:
            node.target = torch.ops.mkldnn._linear_pointwise.default
            node.args = (node.args[0], packed_w, bias, "none", [], "")
        if not w_node.users:  # (no graph-wide DCE: the lowered kernel calls look pure to FX)
            gm.graph.erase_node(w_node)
        count += 1
    if count:
        gm.recompile()
    return count


def cpu_linear_kind() -> str | None:
    """How :func:`prepack_linears` runs CPU float32 linears here: ``"panel"`` when the C++ kernels are
    built, else ``"onednn"`` when oneDNN is, else None (``aten.linear`` stays)."""
    if cpu_kernels.native_op("panel_linear") is not None:
        return "panel"
    return "onednn" if onednn_available() else None

