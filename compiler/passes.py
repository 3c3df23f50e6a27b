"""The pass-authoring API and the pass manager.

A pass is any callable ``fn(gm, ctx)`` that rewrites ``gm`` (a ``torch.fx.GraphModule``) in place
and returns ``None`` or a :class:`PassResult`. ``@graph_pass(name=..., before=..., after=...)``
gives it a name and a place relative to a built-in pass. After every pass the manager lints the
graph, recompiles it, records a :class:`PassRecord` (nodes added/removed, time) and, when asked,
dumps the graph and compares its outputs with the previous graph's on sample inputs.

Example::

    @specgraph.graph_pass(after="normalize")
    def count_linears(gm, ctx):
        n = sum(node.target == torch.ops.aten.linear.default for node in gm.graph.nodes)
        return PassResult(modified=False, info={"linears": n})
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx

from .options import BackendOptions
from .signature import DecoderSignature


@dataclass
class PassResult:
    """What a pass changed: ``modified`` and how many rewrites it made (``matched``)."""

    modified: bool = True
    matched: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    check_atol: float | None = None  # a lossy rewrite (lower-precision cache) states its tolerance


@dataclass
class PassRecord:
    """One line of the pass log."""

    name: str
    nodes_before: int
    nodes_after: int
    added: int
    removed: int
    ms: float
    result: PassResult

    def line(self) -> str:
        extra = f" matched={self.result.matched}" if self.result.matched else ""
        info = f" {self.result.info}" if self.result.info else ""
        return (f"{self.name:<16} nodes {self.nodes_before:>5} -> {self.nodes_after:<5} "
                f"(+{self.added} -{self.removed}) {self.ms:8.1f} ms{extra}{info}")


@dataclass
class PassContext:
    """What passes share: options, the analysis, sample inputs (by placeholder name), the graph's typed
    inputs (``signature``) and what the decoder passes decided."""

    options: BackendOptions
    analysis: Any = None  # compiler.analysis.GraphAnalysis once the "annotate" pass ran
    cache_free_gm: fx.GraphModule | None = None  # the analysed graph as captured (annotate), for self-checks
    cache_free_inputs: dict[str, Any] = field(default_factory=dict)  # its sample inputs
    sample_inputs: dict[str, Any] = field(default_factory=dict)
    signature: DecoderSignature = field(default_factory=DecoderSignature)
    kv_scheme: Any = None  # kernels.quant.QuantScheme once kv_quant quantized the cache
    selects_logits: bool = False  # select_logits made the LM head read only logits_indices rows
    hidden_index: int | None = None  # hidden_states: the last hidden state's place among the outputs
    calibration: Any = None  # compiler.calibration.Calibration once quantize_weights calibrated
    log: list[PassRecord] = field(default_factory=list)


@dataclass(frozen=True)
class GraphPass:
    """A named pass with an optional place relative to a built-in pass."""

    fn: Callable[[fx.GraphModule, PassContext], PassResult | None]
    name: str
    before: str | None = None
    after: str | None = None
    check_atol: float | None = None  # tolerance of the numeric check (None: the manager's default)

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult | None:
        return self.fn(gm, ctx)


def graph_pass(fn: Callable | None = None, *, name: str | None = None, before: str | None = None,
               after: str | None = None):
    """Decorator: name a pass and place it before or after a built-in pass."""
    if before is not None and after is not None:
        raise ValueError("a pass is placed either before or after one pass, not both")

    def wrap(f: Callable) -> GraphPass:
        return GraphPass(fn=f, name=name or f.__name__, before=before, after=after)

    return wrap(fn) if fn is not None else wrap


def as_graph_pass(p: Callable) -> GraphPass:
    if isinstance(p, GraphPass):
        return p
    return GraphPass(fn=p, name=getattr(p, "__name__", type(p).__name__))


def order_passes(builtin: list[GraphPass], user: Iterable[Callable]) -> list[GraphPass]:
    """Built-in passes in order, each user pass inserted where it asked (unplaced ones last)."""
    ordered = list(builtin)
    names = [p.name for p in builtin]
    for p in map(as_graph_pass, user):
        anchor = p.before or p.after
        if anchor is None:
            ordered.append(p)
            continue
        if anchor not in names:
            raise ValueError(f"pass {p.name!r} is placed relative to {anchor!r}, which is not a built-in pass; "
                             f"built-in passes: {', '.join(names)}")
        idx = next(i for i, q in enumerate(ordered) if q.name == anchor)
        ordered.insert(idx if p.before else idx + 1, p)
    return ordered


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with its own graph, sharing parameters, buffers and module meta (fake mode)."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copy = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    copy.meta.update(gm.meta)
    return copy


def placeholder_args(gm: fx.GraphModule, values: dict[str, Any]) -> list:
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    missing = [n for n in names if n not in values]
    if missing:
        raise KeyError(f"no sample value for graph inputs {missing}")
    return [values[n] for n in names]


def _logits_output(out, ctx: "PassContext"):
    """The logits among a graph's outputs (the first output until the analysis has found them)."""
    from .analysis import pick_output

    return pick_output(out, ctx.analysis.logits_index if ctx.analysis is not None else 0)


class PassCheckError(AssertionError):
    """A pass changed the graph's outputs (check mode)."""


class PassManager:
    """Runs passes in order with lint, log, dumps and optional numeric checks."""

    def __init__(self, passes: list[GraphPass], dumper=None, check: bool = False, atol: float = 1e-4):
        self.passes, self.dumper, self.check, self.atol = passes, dumper, check, atol

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        if self.dumper is not None:
            self.dumper.graph("captured", gm)
        for i, p in enumerate(self.passes):
            before = copy_graph_module(gm) if self.check and ctx.sample_inputs else None
            samples_before = dict(ctx.sample_inputs)
            nodes_before = set(gm.graph.nodes)
            t0 = time.perf_counter()
            try:
                result = p(gm, ctx)
                gm.graph.lint()
                gm.recompile()
            except Exception as e:
                done = ", ".join(q.name for q in self.passes[:i]) or "none"
                raise type(e)(f"pass {p.name!r} failed (after: {done}): {e}") from e
            ms = (time.perf_counter() - t0) * 1e3
            result = result if isinstance(result, PassResult) else PassResult()
            nodes_after = set(gm.graph.nodes)
            record = PassRecord(p.name, len(nodes_before), len(nodes_after), len(nodes_after - nodes_before),
                                len(nodes_before - nodes_after), ms, result)
            ctx.log.append(record)
            if self.dumper is not None:
                self.dumper.graph(f"after_{p.name}", gm)
            if before is not None:
                atol = result.check_atol or p.check_atol or self.atol
                self._check(p.name, before, samples_before, gm, ctx, atol)
        if self.dumper is not None:
            self.dumper.pass_log(ctx.log)
        return gm

    def _check(self, name: str, before: fx.GraphModule, samples_before: dict, after: fx.GraphModule,
               ctx: PassContext, atol: float) -> None:
        device = next(iter(after.parameters()), torch.empty(0)).device  # passes make metadata samples on the host

        def args(gm, values):
            return [v.to(device) if isinstance(v, torch.Tensor) else v for v in placeholder_args(gm, values)]

        with torch.no_grad():
            ref = _logits_output(before(*args(before, samples_before)), ctx)
            got = _logits_output(after(*args(after, ctx.sample_inputs)), ctx)
        if ref.shape != got.shape or not torch.allclose(ref, got, atol=atol, rtol=1e-4):
            diff = (ref - got).abs().max().item() if ref.shape == got.shape else f"shape {ref.shape} vs {got.shape}"
            raise PassCheckError(f"pass {name!r} changed the graph's output (max diff {diff})")
