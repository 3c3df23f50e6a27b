"""Which step graphs to compile on this machine: the static buckets and the dynamic graph's padding.

:func:`choose_buckets` decides from timings of the model's own weights (see its docstring);
:meth:`~.inductor.StepGraphs.keep_faster_buckets` then times whole steps and drops the wide
buckets that do not pay, and :meth:`~.inductor.StepGraphs.measure_padding` picks the dynamic
graph's padding. Their outcome is one :class:`StepPlan`, kept per machine beside the program's
graph-cache entry (:func:`load_plan`, :func:`save_plan`), so later builds of the same program (model
and options) on this kind of CPU compile only the graphs that were kept, skip the timings, and run
the same plan.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from ..passes.graph_utils import attr_value

_TIMED_BYTES = 160 << 20  # weights streamed by choose_buckets' timing (over any L3)
_PREFETCH_TIMED_BYTES = 256 << 20  # by set_prefetch's: a step's memory stream, not a cached one
#: set_prefetch times a kernel only over at least this many bytes of its weights (see there)
PREFETCH_MIN_BYTES = 64 << 20

#: CUDA: static graphs for these stream sizes, each replayed as a CUDA graph; larger steps run the dynamic
#: graph, its kernels launched one by one. On an H100 (RESULTS.md, run V) with buckets (1, 8), SmolLM2 took
#: 2.4 ms for 1 token, 3.0-3.6 ms for 2-8 and 13-14 ms for 9-20, so a batch-4 verify of 2 drafts each lost
#: to plain decoding by 1.3-1.6x; 16 and 32 take those verifies and decodes of 9-32 sequences (chosen from
#: that run, not yet run on a GPU).
CUDA_BUCKETS = (1, 8, 16, 32)


@dataclass(frozen=True)
class StepPlan:
    """Which graphs to compile: static ``buckets`` and the dynamic graph, with its padding once
    measured; ``reason`` says why."""

    buckets: tuple[int, ...]
    reason: str
    #: dynamic-graph steps of n tokens run padded to pad_tokens[n] (StepGraphs.measure_padding); None:
    #: not measured yet
    pad_tokens: dict[int, int] | None = None


WIDE_BUCKETS = (4, 8)  # the multi-token static graphs choose_buckets considers (row counts it times)
#: a wide graph is compiled as a candidate when its linears cost at most this times oneDNN's: the
#: linears are not the whole step (a static graph of 4 tokens ran 15-20% faster than the dynamic
#: graph on an AVX-512 EPYC whose few-row GEMMs timed 16% slower), so StepGraphs.keep_faster_buckets
#: times whole steps and keeps it only where it wins.
WIDE_CANDIDATE_SLACK = 1.25


def choose_buckets(gm: fx.GraphModule, device: torch.device, panel_linears: bool = False) -> StepPlan:
    """The step graphs to compile, decided by measurement on this machine.

    On CUDA: :data:`CUDA_BUCKETS`. With ``panel_linears`` (every graph's float32 linears run specgraph's
    batch-invariant panel kernel: ``StepGraphs(panel_linears=True)``, the default where the C++ kernels
    are built) no kernel is to be chosen: static graphs for 1 and :data:`WIDE_BUCKETS` tokens are
    compiled (their C++ wrappers save host time) and :meth:`StepGraphs.keep_faster_buckets` keeps the
    wide ones where whole steps win.

    Otherwise the linears are Inductor's: MKL's packed GEMM in a graph with a static row count,
    oneDNN's in the dynamic graph. Which wins differs between CPUs and even with the load (on an AMD
    EPYC with AVX2: oneDNN 8.2 ms, MKL 10.7 ms over 160 MiB when quiet), so this times both
    streaming the graph's own weights (more bytes than any CPU cache: timing one small matrix again
    and again measures the cache) and compiles a static graph for 1-token steps only when MKL beats
    oneDNN at 2 rows (the dynamic graph pads a decode to 2 rows; a memory-bound GEMV costs about the
    same for 1 and 2), and beside it one for each of 4 and 8 rows where MKL comes within
    :data:`WIDE_CANDIDATE_SLACK` of oneDNN (whole steps decide later)."""
    if device.type == "cuda":
        return StepPlan(CUDA_BUCKETS, f"CUDA: static graphs for {CUDA_BUCKETS} tokens, the dynamic graph above")
    if panel_linears:
        buckets = (1,) + WIDE_BUCKETS
        return StepPlan(buckets, f"batch-invariant linears (the panel kernel for float32 weights, specgraph's "
                                 f"kernel for quantized ones) at every step size -> static graphs for steps of "
                                 f"{buckets} tokens")
    if not torch.backends.mkldnn.is_available():
        return StepPlan((), "CPU without oneDNN: every step runs the dynamic graph")
    weights = _float32_weights(gm, _TIMED_BYTES)
    total = sum(w.numel() * 4 for w in weights)
    if not weights:
        if any(n.op == "call_function" and n.target == torch.ops.specgraph.quant_linear.default for n in gm.graph.nodes):
            return StepPlan((1, 8), "quantized linears (specgraph's kernel at any row count) -> static graphs for "
                                    "steps of 1 and of up to 8 tokens: their C++ wrapper saves host time")
        return StepPlan((), "no float32 linears: every step runs the dynamic graph")
    times = _time_linears(weights)
    line = (f"few-row GEMMs over {total / 2**20:.0f} MiB of the model's weights: "
            + ", ".join(f"{name} {t * 1e3:.2f} ms" for name, t in times.items()))
    buckets = []
    for rows in (1,) + WIDE_BUCKETS:  # a wide graph only beside a 1-token one: decodes must not pad to it
        within = 0.95 if rows == 1 else WIDE_CANDIDATE_SLACK
        mkl = times.get(f"MKL ({rows} row{'s' if rows > 1 else ''})")
        if mkl is None or mkl >= within * times[f"oneDNN ({max(rows, 2)} rows)"] or (rows > 1 and 1 not in buckets):
            continue
        buckets.append(rows)
    if not buckets:
        return StepPlan((), line + " -> decodes run the dynamic graph (oneDNN)")
    return StepPlan(tuple(buckets), line + f" -> static graphs (MKL) for steps of up to {tuple(buckets)} tokens")


def set_bf16_products(gm: fx.GraphModule, key: str | None) -> str:
    """Whether the program's bfloat16 weights run on native bf16 dot products
    (:func:`~specgraph.kernels.cpu_kernels.choose_bf16_products`), measured once per machine and kept beside
    the step plan; the process-wide switch is set on every build, from the kept choice or a new measurement.
    Returns what was measured and chosen ("" without bfloat16 weights)."""
    from ..kernels import cpu_kernels
    from .graph_cache import measurement_path, read_json, write_json

    bf16 = _bf16_weights(gm)
    module = cpu_kernels.load()
    if not bf16 or module is None:
        return ""
    path = measurement_path(key, "bf16-dots")
    kept = read_json(path) if path is not None else None
    if isinstance(kept, dict) and isinstance(kept.get("native"), bool) and isinstance(kept.get("line"), str):
        module.set_bf16_dots(kept["native"])
        return "as measured by an earlier build on this machine: " + kept["line"]
    native, line = cpu_kernels.choose_bf16_products(bf16)
    if path is not None:
        write_json(path, dict(native=native, line=line))
    return line


def set_prefetch(gm: fx.GraphModule, key: str | None, panel_linears: bool) -> str:
    """How far ahead the C++ linears prefetch their weights (``kernels/prefetch.py``): the panel kernel's
    distances (with ``panel_linears``) and the quantized kernel's, each measured once per machine over
    the program's own weights and kept beside the step plan; the process-wide settings are made on every
    build, from the kept choice or a new measurement. A kernel whose weights here total under
    :data:`PREFETCH_MIN_BYTES` (they stay in cache, where prefetching decides nothing) is not timed and
    its setting is left as it is. A choice is kept per page size of the weights (huge pages, or 4 KiB ones
    with ``SPECGRAPH_HUGE_PAGES=0``). Returns what was measured and chosen ("" where nothing was)."""
    from ..kernels import cpu_kernels, huge_pages, prefetch
    from .graph_cache import measurement_path, read_json, write_json

    module = cpu_kernels.load()
    if module is None:
        return ""
    floats = _float32_weights(gm, _PREFETCH_TIMED_BYTES) if panel_linears else []
    quantized = _quant_linears(gm, _PREFETCH_TIMED_BYTES)
    floats = floats if sum(w.numel() * w.element_size() for w in floats) >= PREFETCH_MIN_BYTES else []
    quantized = quantized if sum(w.numel() * w.element_size() for w, _, _ in quantized) >= PREFETCH_MIN_BYTES else []
    if not floats and not quantized:
        return ""
    # (kept apart for weights in 4 KiB pages: a prefetch there may miss the TLB, so the best distance may differ)
    pages = "" if huge_pages.available() else "-4k-pages"
    path = measurement_path(key, "prefetch" + ("-panel" if floats else "") + ("-quant" if quantized else "") + pages)
    kept = _kept_prefetch(read_json(path) if path is not None else None, bool(floats), bool(quantized))
    if kept is not None:
        panel, quant, line = kept
        if floats:
            module.set_panel_prefetch(*panel)
        if quantized:
            module.set_quant_prefetch(quant)
        return "as measured by an earlier build on this machine: " + line
    panel, quant, lines = None, None, []
    if floats:
        panel, panel_line = prefetch.choose_panel_prefetch(floats)
        lines.append(panel_line)
    if quantized:
        quant, quant_line = prefetch.choose_quant_prefetch(quantized)
        lines.append(quant_line)
    if path is not None:
        write_json(path, dict(panel=panel, quant=quant, line="; ".join(lines)))
    return "; ".join(lines)


def _kept_prefetch(kept, floats: bool, quantized: bool) -> tuple[list[int] | None, int | None, str] | None:
    """A prefetch choice :func:`set_prefetch` kept: the panel kernel's three distances (wanted with ``floats``),
    the quantized kernel's (with ``quantized``), all ints >= 0, and its line; None where nothing is kept or
    what is kept is not that (an older format, such as the two panel distances of before, or a damaged file)."""
    def distance(d) -> bool:
        return isinstance(d, int) and not isinstance(d, bool) and d >= 0

    if not isinstance(kept, dict) or not isinstance(kept.get("line"), str):
        return None
    panel, quant = kept.get("panel"), kept.get("quant")
    if floats and not (isinstance(panel, list) and len(panel) == 3 and all(map(distance, panel))):
        return None
    if quantized and not distance(quant):
        return None
    return panel, quant, kept["line"]


def _float32_weights(gm: fx.GraphModule, limit: int) -> list[torch.Tensor]:
    """The graph's float32 linear weights, in order, until they exceed ``limit`` bytes."""
    weights, total = [], 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == torch.ops.aten.linear.default and total < limit:
            w = node.args[1]
            if isinstance(w, fx.Node) and w.op == "get_attr":
                t = attr_value(gm, w.target)
                if isinstance(t, torch.Tensor) and t.dim() == 2 and t.dtype == torch.float32:
                    weights.append(t.detach())
                    total += t.numel() * 4
    return weights


def _quant_linears(gm: fx.GraphModule,
                   limit: float = float("inf")) -> list[tuple[torch.Tensor, torch.Tensor | None, str]]:
    """The graph's quantized linears as ``(weight, scales, scheme)``, each weight once, in graph order,
    until they exceed ``limit`` bytes."""
    seen, out, total = set(), [], 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target != torch.ops.specgraph.quant_linear.default or total >= limit:
            continue
        w, scales = node.args[1], node.args[2]
        scheme = node.args[4] if len(node.args) > 4 else node.kwargs.get("scheme")
        if isinstance(w, fx.Node) and w.op == "get_attr" and w.target not in seen:
            seen.add(w.target)
            weight = attr_value(gm, w.target).detach()
            scale = attr_value(gm, scales.target).detach() if isinstance(scales, fx.Node) else None
            out.append((weight, scale, scheme))
            total += weight.numel() * weight.element_size()
    return out


def _bf16_weights(gm: fx.GraphModule) -> list[torch.Tensor]:
    """The bfloat16 weights of the graph's quantized linears, each once, in graph order."""
    return [w for w, _, scheme in _quant_linears(gm) if scheme == "bfloat16"]


def _time_linears(weights: list[torch.Tensor], repeats: int = 7) -> dict[str, float]:
    """Seconds for one pass over ``weights`` with oneDNN (2, 4, 8 rows) and MKL's packed GEMM (1, 4, 8),
    each the best of ``repeats``, interleaved so that load swings hit all of them."""
    x = {rows: {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights} for rows in (1, 2) + WIDE_BUCKETS}
    dnn = [(w, torch.ops.mkldnn._reorder_linear_weight(w, 2)) for w in weights]

    def onednn(rows: int):
        return lambda: [torch.ops.mkldnn._linear_pointwise(x[rows][w.shape[1]], p, None, "none", [], "")
                        for w, p in dnn]

    runs = {f"oneDNN ({rows} rows)": onednn(rows) for rows in (2,) + WIDE_BUCKETS}
    if torch._C.has_mkl:  # (MKL's packing is per batch size, as Inductor packs a static graph's weights)
        for rows in (1,) + WIDE_BUCKETS:
            mkl = [(w, torch.ops.mkl._mkl_reorder_linear_weight(w, rows)) for w in weights]
            runs[f"MKL ({rows} row{'s' if rows > 1 else ''})"] = \
                lambda rows=rows, mkl=mkl: [torch.ops.mkl._mkl_linear(x[rows][w.shape[1]], p, w, None, rows)
                                            for w, p in mkl]
    best = {name: float("inf") for name in runs}
    with torch.no_grad():
        for fn in runs.values():  # warm-up
            fn()
        for _ in range(repeats):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def _plan_name(lowering: str, table_width: int, panel_linears: bool) -> str:
    return f"step-plan-{lowering}-w{table_width}" + ("-panel" if panel_linears else "")


def load_plan(key: str | None, lowering: str, table_width: int, panel_linears: bool) -> StepPlan | None:
    """The plan a build of the program cached under ``key`` measured on this kind of machine (its
    buckets already checked by whole steps, its padding measured), or None."""
    from .graph_cache import measurement_path, read_json

    path = measurement_path(key, _plan_name(lowering, table_width, panel_linears))
    data = read_json(path) if path is not None else None
    try:
        return StepPlan(tuple(int(b) for b in data["buckets"]), str(data["reason"]),
                        {int(n): int(m) for n, m in data["pad_tokens"].items()})
    except (TypeError, KeyError, ValueError, AttributeError):
        return None


def save_plan(key: str | None, lowering: str, table_width: int, panel_linears: bool, plan: StepPlan) -> None:
    """Keep a fully measured ``plan`` for :func:`load_plan` (nothing without a graph-cache key)."""
    from .graph_cache import measurement_path, write_json

    path = measurement_path(key, _plan_name(lowering, table_width, panel_linears))
    if path is not None and plan.pad_tokens is not None:
        write_json(path, dict(buckets=list(plan.buckets), reason=plan.reason,
                              pad_tokens={str(n): m for n, m in plan.pad_tokens.items()}))


def starting_plan(gm: fx.GraphModule, device: torch.device, key: str | None, lowering: str, table_width: int,
                  buckets, timed: bool, panel_linears: bool = False) -> tuple[StepPlan, bool]:
    """The plan a build compiles, and whether an earlier build measured it (then nothing is timed again):
    the ``buckets`` given; else, where timings mean
    something (``timed``), the plan an earlier build of the program kept on this kind of machine; else
    :func:`choose_buckets`' measurement. Where timings mean something, bfloat16 weights' products are
    set too (:func:`set_bf16_products`, whatever the buckets), and the linears' prefetch distances
    (:func:`set_prefetch`); a new plan's reason says how (a kept one's already does)."""
    products = set_bf16_products(gm, key) if timed else ""
    if timed:
        products = "; ".join(p for p in (products, set_prefetch(gm, key, panel_linears)) if p)
    if buckets is not None:
        plan, cached = StepPlan(tuple(buckets), f"buckets {buckets} given"), False
    else:
        kept = load_plan(key, lowering, table_width, panel_linears) if timed else None
        cached = kept is not None
        plan = (replace(kept, reason="as measured by an earlier build on this machine: " + kept.reason) if cached
                else choose_buckets(gm, device, panel_linears))
    return (replace(plan, reason=f"{plan.reason}; {products}") if products and not cached else plan), cached
