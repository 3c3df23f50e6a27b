"""Generated code for the decode step: the transformed graph compiled by Inductor, per step shape.

The eager lowering (:mod:`.lowering`) runs the graph op by op from Python, about 1,600 ATen calls
per SmolLM2 step. Here Inductor compiles it instead (``compile_fx`` straight on the captured,
transformed graph; no second Dynamo trace): C++/OpenMP on CPU (``lowering="inductor"``), Triton on
CUDA, or Triton run by the interpreter on CPU tensors (``lowering="triton-interpret"``, how CI
proves the whole decoder lowers to Triton). Inductor freezes the weights, except where every float32
linear is a panel op (see ``_inductor_config``). The kernel ops stay extern calls: on CPU their native
C++ twins (``lowering.bind_native_ops``), elsewhere the ``specgraph::`` ops, whose bodies dispatch
through ``kernels/registry.py``. On CPU every graph's float32 linears
run specgraph's panel kernel over weights packed once (``kernels/panel_linear.py``), as the C++
attention kernel runs every step: a token's logits are then bitwise the same whichever graph, step
size or batch computed them.

Shapes. A step's graph is specialized to a :class:`~.program.StepShape` and every step is padded
to one (``AttentionMetadata.padded``), so steady-state generation never recompiles:

* one static graph per bucket ``b`` in ``buckets``: ``b`` tokens, ``b`` sequences, ``b`` logit
  rows and the widest block table (decodes of up to ``b`` sequences, short verifies);
  :func:`~.step_plan.choose_buckets` decides by measurement on this machine whether any pays;
* one dynamic graph for every other step (prefill chunks, large batches): tokens, sequences,
  logit rows and table width symbolic, each padded to at least 2 (the shape environment
  specializes sizes 0 and 1).

:meth:`StepGraphs.warm_up` compiles them all when the engine is built; ``compiles`` counts every
Inductor compile, so a compile after warm-up shows as a recompile in ``engine.stats``. Compiled
code is cached on disk by Inductor's FX graph cache (``$TORCHINDUCTOR_CACHE_DIR``, by default a folder
per version of the C++ kernels under ``~/.cache/specgraph/inductor``), so a second process on the same
machine skips code generation, and where the weights are not frozen AOT Autograd's trace too (its own
cache; ``compile_decoder`` gives every process the same graph, whose code the key hashes).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import statistics
import time
from typing import Callable

import torch
import torch.fx as fx

from .signature import InputSpec, Role
from ..kernels.config import use_triton_kernels
from ..kernels.paired_timing import clearly_faster, median_ratio
from .dump import Dumper
from .lowering import bind_native_ops, prepack_linears
from .passes import copy_graph_module

# inputs whose every dim varies from step to step (tokens, sequences, table width)
_STREAM_ROLES = {Role.POSITIONS, Role.SLOTS, Role.BLOCK_TABLES, Role.SEQ_LENS, Role.QUERY_START, Role.LOGITS_INDICES}
_CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"
#: the C++ wrapper and the kernels are compiled apart (see _inductor_config); a switch for the A/B benchmark
SEPARATE_WRAPPER_BUILD = True
#: step graphs whose float32 linears are panel ops are frozen too (see _inductor_config); a switch for the A/B
#: benchmark
FREEZE_PANEL_GRAPHS = False


def default_cache_dir() -> str:
    """One folder per version of the C++ kernels: generated code calls their native ops by schema, and
    Inductor's cache key does not cover an extension's schemas (code compiled against an older schema
    would call the new one with the old arguments)."""
    from ..kernels import cpu_kernels

    digest = hashlib.blake2b(cpu_kernels.CPP_SOURCE.encode(), digest_size=6).hexdigest()
    return os.path.join(os.path.expanduser("~"), ".cache", "specgraph", "inductor", f"kernels-{digest}")


@contextlib.contextmanager
def persistent_cache():
    """Inductor's on-disk caches in a folder that outlives ``/tmp``, unless the user chose one
    (Inductor itself writes its ``/tmp`` default into the variable on first use)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default

    before = os.environ.get(_CACHE_DIR_ENV)
    if before is not None and os.path.abspath(before) != os.path.abspath(torch_default()):
        yield  # the user's choice
        return
    os.environ[_CACHE_DIR_ENV] = default_cache_dir()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_CACHE_DIR_ENV, None)
        else:
            os.environ[_CACHE_DIR_ENV] = before


def _inductor_config(lowering: str, cpp_wrapper: bool = False, freeze: bool = True) -> dict:
    # Freezing packs aten linear weights into oneDNN tensors, which the FX graph cache cannot pickle,
    # so without the C++ kernels each process compiles the dynamic graph again (in the background).
    # Measured on SmolLM2 (AMD EPYC, 2 threads, prefill 8x75 / 1x480 tokens): unfrozen 974 / 867 ms,
    # frozen without prepacking 1246 / 916 ms, frozen and packed 780 / 677 ms. Prefill speed wins.
    # With the C++ kernels the linears are panel ops over weights packed once, so freezing has nothing to
    # pack, and its passes (whole-graph fake-tensor propagations, run before the FX graph cache is looked up)
    # only cost time, in every process: ``freeze`` False passes the weights to the graph as inputs instead
    # (SmolLM2, AMD EPYC: a warm build's two graphs 45 s instead of 61 s; the same tokens, the same speed).
    config = {"freezing": freeze, "fx_graph_cache": True}
    if lowering == "triton-interpret":
        config["cpu_backend"] = "triton"
    if cpp_wrapper:
        config["cpp_wrapper"] = True
        # One source holds the C++ wrapper (every op call of all layers in one function, ~4,300 lines for
        # SmolLM2) and the fused kernels (~900 lines); at -O3 g++ spends ~40 s a graph on the wrapper alone.
        # Built apart, the wrapper at Inductor's wrapper level (-O1) and the kernels at -O3, a graph's g++
        # time falls from 43.6 to ~16 s (AMD EPYC), with no step-time difference seen
        # (benchmarks/inductor_switch_ab.py).
        if SEPARATE_WRAPPER_BUILD and hasattr(torch._inductor.config, "cpp_wrapper_build_separate"):
            config["cpp_wrapper_build_separate"] = True
    return config


def _shim_triton_interpreter() -> None:
    """Two shims Inductor's Triton code needs to run in the interpreter (FEASIBILITY.md Q5).

    1. Codegen hashes the active Triton driver; the interpreter has none (``0 active drivers``).
    2. The interpreter implements ``tl.math`` but its ``libdevice`` functions are stubs that return
       None; Inductor's kernels call ``libdevice.exp``, ``libdevice.rsqrt``, ...: point each one at
       ``tl.math.<fn>``.
    ``tests/test_inductor_lowering.py`` checks in a fresh process that each is still needed.
    """
    import torch.utils._triton as triton_utils
    from torch._inductor.runtime import triton_compat, triton_helpers

    if not getattr(triton_utils.triton_hash_with_backend, "specgraph_shim", False):
        def triton_hash_with_backend() -> str:
            return "specgraph-triton-interpreter"

        triton_hash_with_backend.specgraph_shim = True
        triton_utils.triton_hash_with_backend = triton_hash_with_backend
    if not isinstance(triton_helpers.libdevice, _MathAsLibdevice):  # generated kernels import it from here
        triton_compat.libdevice = triton_helpers.libdevice = _MathAsLibdevice()


class _MathAsLibdevice:
    """``libdevice.fn`` -> ``tl.math.fn`` (the interpreter's libdevice functions are stubs)."""

    def __getattr__(self, name):
        import triton.language as tl

        return getattr(tl.math, name)


PAD_SEARCH_TOKENS = 16  # StepGraphs.measure_padding times dynamic steps up to this many tokens


class StepGraphs:
    """Compiled step graphs of one decoder program (see module docstring)."""

    def __init__(self, gm: fx.GraphModule, inputs: list[InputSpec], lowering: str, buckets: tuple[int, ...],
                 dump_dir: str | None = None, cuda_graphs: bool = True, panel_linears: bool = False):
        if lowering not in ("inductor", "triton-interpret"):
            raise ValueError(f"StepGraphs compiles the inductor lowerings; got {lowering!r}")
        self.lowering = lowering
        self.buckets = tuple(sorted(set(buckets)))
        self.compiles = 0  # Inductor compiles, warm-up included
        self._warm = None  # compiles when warm_up finished
        self.compile_seconds = 0.0
        self.dump_dir = dump_dir
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        ids_name = names[[s.role for s in inputs].index(Role.TOKENS)]
        len_name = next((name for name, s in zip(names, inputs) if s.role == Role.LENGTH), None)
        self._keep = [i for i, spec in enumerate(inputs) if spec.role != Role.LENGTH]
        self._roles = [inputs[i].role for i in self._keep]
        self._base = _tensor_inputs_only(gm, ids_name, len_name)
        self._on_cpu = all(t.device.type == "cpu" for t in self._base.parameters())
        #: every graph's float32 linears run the panel kernel (a row's result is the same in each); the
        #: caller decides (DecoderProgram: CPU, inductor, prepack_weights and the C++ kernels built)
        self.panel_linears = panel_linears
        if lowering == "inductor" and self._on_cpu:
            bind_native_ops(self._base)
            if self.panel_linears:
                prepack_linears(self._base, "panel")
        self._graphs: dict[object, Callable] = {}  # (bucket size or "dynamic", cache size) -> compiled
        #: on CUDA, bucket steps replay as CUDA graphs (cuda_graphs.py); the dynamic graph's shapes vary
        self.cuda_graphs = cuda_graphs and lowering == "inductor" and not self._on_cpu
        self._graph_pool = None
        caches = [i for i, k in enumerate(self._keep) if inputs[k].role == Role.CACHE and inputs[k].part == "k"]
        self._first_cache = caches[0] if caches else None
        self._table_width: int | None = None
        #: dynamic-graph steps of n tokens run padded to pad_tokens[n] tokens, where that was
        #: measured cheaper (:meth:`measure_padding`)
        self.pad_tokens: dict[int, int] = {}
        self.dropped: tuple[int, ...] = ()  # buckets compiled, then dropped (:meth:`keep_faster_buckets`)

    # ----------------------------------------------------------------- shapes
    def shape_for(self, have) -> tuple[object, "object"]:
        """The graph key and the padded shape that serves a step of shape ``have``."""
        from .program import StepShape

        n, s, m, w = have
        width = self._table_width or w
        for b in self.buckets:
            if n <= b and w <= width:
                return b, StepShape(b, b, b, width)
        tokens = self.pad_tokens.get(n, max(n, 2))
        pad_seq = 1 if tokens > n else 0  # padding tokens need a padding sequence
        return "dynamic", StepShape(tokens, max(s + pad_seq, 2), max(m, 2), max(w, 2))

    def warm_up(self, run_padding_step: Callable[[object], None], table_width: int,
                progress: Callable[[str], None] | None = None) -> None:
        """Compile every graph now. ``run_padding_step(shape)`` runs a step of that shape made only of
        padding (it writes no cache slot). Bucket graphs are specialized to ``table_width`` columns.
        ``progress(stage)`` is told which graph is being compiled."""
        from .program import StepShape

        self._table_width = table_width
        shapes = [(f"bucket {b}", StepShape(b, b, b, table_width)) for b in self.buckets]
        # distinct sizes (none may be taken for another), more tokens than any bucket holds
        shapes.append(("dynamic", StepShape(max(self.buckets, default=0) + 7, 3, 5, 4)))
        for i, (name, shape) in enumerate(shapes):
            if progress is not None:
                progress(f"step graph {i + 1}/{len(shapes)} ({name}, {self.lowering})")
            run_padding_step(shape)
        if self.cuda_graphs:  # the first run compiled each bucket's kernels; the second captures them
            for name, shape in shapes[:-1]:
                if progress is not None:
                    progress(f"capturing {name} as a CUDA graph")
                run_padding_step(shape)
        self._warm = self.compiles

    def keep_faster_buckets(self, run_padding_step: Callable[[object], None], repeats: int = 7) -> str:
        """Time each wide bucket's static step against the dynamic graph at the sizes it would serve
        (past the kept bucket below it; every row wanting logits, as in a verify), every step once per
        round (the order reversed every other round), ``repeats`` rounds. From the narrowest up, a bucket
        is kept only where its step is clearly cheaper than the mean of those sizes' dynamic steps in the
        same round (``kernels/paired_timing.py``: 5% cheaper in the median same-round ratio, and cheaper at all
        in 80% of the rounds), else dropped (a wider one then serves its sizes too): a best-of-rounds time lets one
        quiet moment keep a bucket (five rounds once dropped a 4-token graph that four other builds kept
        by 8-22%). Returns what it measured and chose (medians)."""
        from .program import StepShape

        width = self._table_width or 2
        served = self.buckets
        wide = [b for b in served if b > 1]
        if not wide:
            return "no wide bucket to check"
        shapes = {b: StepShape(b, b, b, width) for b in wide}
        shapes.update({("dynamic", n): StepShape(n, 2, n, width) for n in range(2, max(wide) + 1)})
        times: dict = {key: [] for key in shapes}
        try:
            for round_ in range(repeats):  # interleaved, so that a load swing hits every step
                for key, shape in list(shapes.items())[::1 if round_ % 2 == 0 else -1]:
                    self.buckets = served if key in served else (1,) if 1 in served else ()
                    t0 = time.perf_counter()
                    run_padding_step(shape)
                    times[key].append(time.perf_counter() - t0)
        finally:
            self.buckets = served
        kept, parts = [b for b in served if b == 1], []
        for b in wide:
            sizes = range(max(2, max(kept, default=0) + 1), b + 1)
            dynamic = [statistics.fmean(times[("dynamic", n)][i] for n in sizes) for i in range(repeats)]
            keep = clearly_faster(times[b], dynamic, 0.05)
            kept += [b] if keep else []
            parts.append(f"bucket {b} {statistics.median(times[b]) * 1e3:.1f} ms vs dynamic "
                         f"{statistics.median(dynamic) * 1e3:.1f} -> " + ("kept" if keep else "dropped"))
        self.buckets = tuple(kept)
        self.dropped = tuple(b for b in served if b not in kept)
        for key in [k for k in self._graphs if (k[0] if isinstance(k, tuple) else k) not in (*kept, "dynamic")]:
            del self._graphs[key]  # a dropped bucket's code and packed weights
        return "whole steps: " + ", ".join(parts)

    def measure_padding(self, run_padding_step: Callable[[object], None], upto: int = PAD_SEARCH_TOKENS,
                        repeats: int = 5) -> str:
        """Time the dynamic graph at each step size it serves up to ``upto`` tokens, every size once per round
        (the order reversed every other round), and pad each size to the size above it that was clearly
        cheaper (``kernels/paired_timing.py``: at least 5% in the median same-round ratio, and cheaper at all in 4 rounds of 5),
        the cheapest such: few-row GEMMs do not cost in proportion to their rows (oneDNN at 2 rows took longer
        than at 4 on an AVX-512 EPYC, so a batch-2 decode is faster padded to 4). Returns what it measured and
        chose (medians)."""
        from .program import StepShape

        sizes = [n for n in range(max(2, max(self.buckets, default=0) + 1), upto + 1)]
        if len(sizes) < 2:
            return "no dynamic step sizes to pad"
        width = self._table_width or 2
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for round_ in range(repeats):  # interleaved, so that a load swing hits every size
            for n in sizes if round_ % 2 == 0 else sizes[::-1]:
                t0 = time.perf_counter()
                run_padding_step(StepShape(n, 2, 2, width))
                times[n].append(time.perf_counter() - t0)
        self.pad_tokens = {}
        for n in sizes:
            cheaper = [m for m in sizes if m > n and clearly_faster(times[m], times[n], 0.05)]
            if cheaper:
                self.pad_tokens[n] = min(cheaper, key=lambda m: median_ratio(times[m], times[n]))
        line = "dynamic step ms by tokens: " + ", ".join(f"{n} {statistics.median(times[n]) * 1e3:.1f}"
                                                        for n in sizes)
        pads = ", ".join(f"{n}->{m}" for n, m in self.pad_tokens.items())
        return line + (f" -> padded {pads}" if pads else " -> no padding pays")

    @property
    def captures(self) -> int:
        """CUDA graphs recorded for the bucket steps (0 off CUDA)."""
        from .cuda_graphs import GraphedStep

        return sum(g.captures for g in self._graphs.values() if isinstance(g, GraphedStep))

    @property
    def recompiles(self) -> int:
        """Compiles after :meth:`warm_up` (a step shape or cache size it did not foresee)."""
        return self.compiles - self._warm if self._warm is not None else 0

    # ----------------------------------------------------------------- running
    def __call__(self, key, values: list):
        """Run graph ``key`` on a padded step's placeholder values (all of them, in program order).

        A graph is compiled per (key, cache size): a program called with a cache of another size
        compiles again (counted in ``compiles``) rather than failing Inductor's size asserts."""
        inputs = [values[i] for i in self._keep]
        full_key = (key, tuple(inputs[self._first_cache].shape)) if self._first_cache is not None else key
        fn = self._graphs.get(full_key)
        with torch.no_grad(), use_triton_kernels(self.lowering == "triton-interpret"):
            if fn is None:
                fn = self._compile(key, inputs)
                if self.cuda_graphs and key != "dynamic":
                    from .cuda_graphs import GraphedStep

                    if self._graph_pool is None:
                        self._graph_pool = torch.cuda.graph_pool_handle()
                    fn = GraphedStep(fn, [role in (Role.CACHE, Role.STATIC) for role in self._roles], self._graph_pool)
                self._graphs[full_key] = fn
            return fn(*inputs)

    def _compile(self, key, inputs: list) -> Callable:
        """``compile_fx`` straight on the graph (no Dynamo: the graph is already captured; Inductor sees the
        weights as the module's constants, and freezes and prepacks them unless the linears are panel ops)."""
        t0 = time.perf_counter()
        name = f"bucket{key}" if key != "dynamic" else "dynamic"
        gm = copy_graph_module(self._base)
        # fakes under our own shape env for both kinds: a scalar the model lifted to an input (a norm's
        # epsilon) is read with .item(), which a fake mode without a shape env refuses
        fake_mode, examples = _symbolic_inputs(inputs, self._roles, dynamic=key == "dynamic")
        # decode and verify steps are short, so the host's cost per op shows: every graph's calls are made
        # from a C++ wrapper (SmolLM2's 30 layers, 1 token: 1.65 vs 2.9 ms of host time per step; the
        # dynamic graph's 2-16 token verifies 0.6-1.0 ms cheaper, for a longer first compile: 49 s vs 28 s)
        cpp_wrapper = self.lowering == "inductor" and self._on_cpu
        with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
            compiled = compile_graph(gm, examples, self.lowering, self.dump_dir, name, cpp_wrapper=cpp_wrapper,
                                     freeze=FREEZE_PANEL_GRAPHS or not self.panel_linears)
        self.compiles += 1
        self.compile_seconds += time.perf_counter() - t0
        return compiled


def _symbolic_inputs(inputs: list, roles: list[Role], dynamic: bool = True):
    """Fake example inputs whose stream sizes (tokens, sequences, logit rows, table width) are
    distinct symbols, every other size static (all static when not ``dynamic``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    fake_mode = FakeTensorMode(shape_env=ShapeEnv(duck_shape=False), allow_non_fake_inputs=True)
    examples = []
    for role, value in zip(roles, inputs):
        if not isinstance(value, torch.Tensor):
            examples.append(value)
            continue
        symbolic = (range(value.dim()) if role in _STREAM_ROLES else (1,) if role == Role.TOKENS
                    else (0,) if role == Role.TREE_MASK else ())
        sizes = [DimDynamic.DYNAMIC if dynamic and d in symbolic else DimDynamic.STATIC for d in range(value.dim())]
        examples.append(fake_mode.from_tensor(value, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes)))
    return fake_mode, examples


def compile_graph(gm: fx.GraphModule, example_inputs: list, lowering: str, dump_dir: str | None,
                  name: str, cpp_wrapper: bool = False, freeze: bool = True) -> Callable:
    """``compile_fx`` under the lowering's Inductor settings; with ``dump_dir``, the generated code
    is written there as ``<lowering>_<name>.py`` beside ``<lowering>_<name>_index.json``. With
    ``cpp_wrapper`` the code that calls the kernels is C++ too (no Python between ops); with ``freeze``
    Inductor folds the weights into the graph (see :func:`_inductor_config`)."""
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    outputs = []

    def inner(*args, **kwargs):
        out = compile_fx_inner(*args, **kwargs)
        outputs.append(out)
        return out

    if cpp_wrapper:  # the C++ wrapper path takes its example inputs from the placeholders' metadata
        for node, example in zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs):
            node.meta["val"] = example
    # A hit in AOTAutograd's cache returns the compiled graph without calling ``inner``, so there would be
    # no code to dump; with ``dump_dir`` only Inductor's FX graph cache is used (its entries keep the code).
    autograd_cache = functorch_config.patch(enable_autograd_cache=not dump_dir)
    with persistent_cache(), autograd_cache, \
            torch._inductor.config.patch(_inductor_config(lowering, cpp_wrapper, freeze)):
        if lowering == "triton-interpret":
            _shim_triton_interpreter()
        compiled = compile_fx(gm, example_inputs, inner_compile=inner)
    code = "\n\n".join(s for s in (getattr(o, "source_code", None) for o in outputs) if s)
    if dump_dir and code:
        stem = f"{lowering.replace('-', '_')}_{name}"
        dumper = Dumper(dump_dir)
        dumper.write(f"{stem}.py", code)
        dumper.write(f"{stem}_index.json", json.dumps(kernel_index(code), indent=1, sort_keys=True))
    return compiled


_SOURCE_NODES = re.compile(r"(?:#|//)\s*Topologically Sorted Source Nodes:\s*\[([^\]]*)\]")
# a call in the Python wrapper (kernel, extern kernel, op) or in the C++ wrapper (kernel, dispatcher call)
_KERNEL_CALL = re.compile(r"\b(cpp_fused_\w+|triton_\w+|extern_kernels\.\w+|torch\.ops\.[\w.]+)(?:\.run)?\("
                          r"|aoti_torch_call_dispatcher\(\"([\w:]+)\"")
_DEFINITION = re.compile(r'^\s*(?:extern "C"|def |async_compile)')


def kernel_index(code: str) -> dict[str, list[str]]:
    """Graph node name -> the generated kernels and extern calls that compute it, read from
    Inductor's output code. Its wrapper (Python or C++) comments calls with ``Topologically Sorted
    Source Nodes: [a, b, ...]``: before a Triton kernel or an extern call; a CPU kernel
    (``cpp_fused_*``) has none of its own, its nodes are listed by the comment of the next extern
    call. Kernel definitions are not calls."""
    index: dict[str, list[str]] = {}
    nodes: list[str] = []
    pending: list[str] = []  # CPU kernels whose comment comes later

    def add(kernels: list[str]) -> None:
        for node in nodes:
            for kernel in kernels:
                if kernel not in index.setdefault(node, []):
                    index[node].append(kernel)

    for line in code.splitlines():
        m = _SOURCE_NODES.search(line)
        if m:
            nodes = [x.strip() for x in m.group(1).split(",") if x.strip()]
            add(pending)
            pending = []
            continue
        if _DEFINITION.match(line):
            nodes, pending = [], []
            continue
        for call in _KERNEL_CALL.finditer(line):
            if call.group(2):  # a dispatcher call from the C++ wrapper
                add([call.group(2).replace("::", ".")])
            elif call.group(1).startswith("cpp_fused_"):
                pending.append(call.group(1))
            else:
                add([call.group(1)])
    return index


def _tensor_inputs_only(gm: fx.GraphModule, ids_name: str, len_name: str | None) -> fx.GraphModule:
    """A copy of ``gm`` whose sequence-length int input is read from the ids' shape instead (Dynamo
    would specialize an int argument; a tensor dim it treats as the marked size)."""
    gm = copy_graph_module(gm)
    if len_name is None:
        return gm
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first_op):
        size = graph.call_function(torch.ops.aten.sym_size.int, (nodes[ids_name], 1))
    nodes[len_name].replace_all_uses_with(size)
    graph.erase_node(nodes[len_name])
    gm.recompile()
    return gm
