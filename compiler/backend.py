"""The ``specgraph`` torch.compile backend.

``torch.compile(model, backend="specgraph")`` finds :func:`specgraph_backend` through the
``torch_dynamo_backends`` entry point; ``specgraph.backend(**options)`` returns a configured one.
The backend captures the Dynamo graph at the ATen level (:mod:`.capture`), runs the phase-1
passes and the user's passes (:mod:`.pipeline`), and returns a callable that runs the result.
Compile with ``dynamic=True`` (or ``torch._dynamo.mark_dynamic(ids, 1)``) to get one graph for
every sequence length; Dynamo otherwise specializes the first length it sees.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch.fx as fx

from .capture import CapturedGraph, capture
from .dump import Dumper
from .options import BackendOptions
from .passes import PassContext, PassManager, order_passes
from .pipeline import backend_passes


@dataclass
class CompiledGraph:
    """What one backend call produced (kept on the returned callable for inspection)."""

    captured: CapturedGraph
    gm: fx.GraphModule
    context: PassContext
    capture_seconds: float
    generated: Callable | None = None  # the gm compiled by Inductor (lowering != "eager")

    def __call__(self, *dynamo_args: Any):
        inputs = self.captured.select_inputs(dynamo_args)
        return self.generated(*inputs) if self.generated is not None else self.gm(*inputs)


def run_capture_pipeline(dynamo_gm: fx.GraphModule, example_inputs: list, options: BackendOptions,
                         passes=None) -> CompiledGraph:
    t0 = time.perf_counter()
    captured = capture(dynamo_gm, example_inputs)
    dumper = Dumper(options.dump_dir) if options.dump_dir else None
    ctx = PassContext(options=options, sample_inputs={i.name: i.example for i in captured.inputs})
    manager = PassManager(order_passes(passes or backend_passes(), options.passes), dumper=dumper,
                          check=options.check == "numeric")
    gm = manager.run(captured.gm, ctx)
    if dumper is not None and options.mlir:
        dumper.mlir(gm, [i.example for i in captured.inputs])
    return CompiledGraph(captured, gm, ctx, time.perf_counter() - t0)


class SpecgraphBackend:
    """A configured backend: ``torch.compile(model, backend=SpecgraphBackend(options))``."""

    def __init__(self, options: BackendOptions):
        self.options = options
        self.compiled: list[CompiledGraph] = []  # one per graph Dynamo handed us

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        compiled = run_capture_pipeline(gm, example_inputs, self.options)
        if self.options.lowering != "eager":
            from .inductor import compile_graph

            # the placeholders' fake values carry Dynamo's symbolic sizes: one graph for every length
            fakes = [n.meta["val"] for n in compiled.gm.graph.nodes if n.op == "placeholder"]
            compiled.generated = compile_graph(compiled.gm, fakes, self.options.lowering, self.options.dump_dir,
                                               name="backend")
        self.compiled.append(compiled)
        return compiled

    def __repr__(self) -> str:
        return f"SpecgraphBackend({self.options})"


def backend(**options: Any) -> SpecgraphBackend:
    """A configured specgraph backend; unknown options raise ``ValueError`` naming the valid ones."""
    return SpecgraphBackend(BackendOptions.from_kwargs(**options))


def specgraph_backend(gm: fx.GraphModule, example_inputs: list, **options: Any) -> Callable:
    """The entry-point backend (``torch.compile(model, backend="specgraph", options={...})``)."""
    return backend(**options)(gm, example_inputs)


def register() -> None:
    """Register ``"specgraph"`` with Dynamo by hand (the entry point normally does it)."""
    from torch._dynamo import list_backends
    from torch._dynamo.backends.registry import register_backend

    if "specgraph" not in list_backends(exclude_tags=()):
        register_backend(compiler_fn=specgraph_backend, name="specgraph")
