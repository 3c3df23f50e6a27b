"""DecoderProgram: a compiled decoder that runs one flat token stream against a paged KV cache.

``compile_decoder(model)`` captures ``model`` (token ids ``[1, T]`` -> logits) through Dynamo
with a symbolic sequence length, runs the full pass pipeline (positions, kv_cache, paging,
cleanup, select_logits) and wraps the resulting graph; a later process loads that graph from the
graph cache (``graph_cache.py``) instead. The program feeds each graph input by its declared role
(``signature.py``). One call runs any mix of prefill chunks and decodes of several sequences; what
differs is only :class:`AttentionMetadata`.
"""
from __future__ import annotations

import atexit
import dataclasses
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
import torch.fx as fx

from .analysis import pick_output
from .backend import CompiledGraph, run_capture_pipeline
from .lowering import cpu_linear_kind, lower
from .options import BackendOptions
from .pipeline import decoder_passes
from .signature import CACHE_PARTS, Role, SignatureError
from ..kernels import huge_pages
from ..kernels.tree_mask import ancestor_mask, causal_rows, depths, mask_words


@dataclass
class AttentionMetadata:
    """Where each token of the stream belongs and where its K/V lives.

    Shapes: ``positions [N]`` int64, ``slot_mapping [N]`` int64 (physical cache slot written by
    each token), ``block_tables [S, max_blocks]`` int32, ``seq_lens [S]`` int32 (tokens in the
    cache after this step), ``query_start_loc [S + 1]`` int32 (sequence s owns stream tokens
    ``query_start_loc[s]:query_start_loc[s + 1]``), ``logits_indices [M]`` int64 (stream rows whose
    logits are returned), ``tree_mask [N, W]`` int32 (each token's ancestor bits when the step
    verifies token trees, ``kernels/tree_mask.py``; None: every row all ones).
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    logits_indices: torch.Tensor
    tree_mask: torch.Tensor | None = None

    @staticmethod
    def build(seqs: list[tuple[list[int], int, list[int]]], page_size: int, logits: list[list[int]],
              trees: dict[int, list[int]] | None = None, tree_words: int = 0) -> "AttentionMetadata":
        """From per-sequence ``(block_table, start_position, num_new_tokens)`` tuples.

        ``logits[s]`` lists the offsets (within sequence s's new tokens) that need logits. The host
        work is per sequence and per page touched, never per token (ranges extend in C).
        ``trees[s]``: the parents of sequence s's new tokens when they form a token tree (node ``m``
        at cache index ``start + m``, position ``start + depth``); ``tree_words``: the program's mask
        words (0: no mask; any other sequence's rows are all ones).
        """
        trees = trees or {}
        if trees and not tree_words:
            raise ValueError("token trees need a program compiled with tree_nodes > 0")
        positions, slots, qsl, lens, rows, masks = [], [], [0], [], [], []
        for s, ((table, start, n), want) in enumerate(zip(seqs, logits)):
            if s in trees:
                if len(trees[s]) != n:
                    raise ValueError(f"sequence {s}: a tree of {len(trees[s])} nodes for {n} new tokens")
                positions.extend(start + d for d in depths(trees[s]))
                masks.append(ancestor_mask(trees[s], tree_words))
            else:
                positions.extend(range(start, start + n))
                if tree_words:
                    masks.append(causal_rows(n, tree_words))
            for page in range(start // page_size, (start + n + page_size - 1) // page_size):
                lo, hi = max(start, page * page_size), min(start + n, (page + 1) * page_size)
                base = table[page] * page_size - page * page_size
                slots.extend(range(base + lo, base + hi))
            rows.extend(qsl[-1] + o for o in want)
            qsl.append(qsl[-1] + n)
            lens.append(start + n)
        width = max([1] + [len(t) for t, _, _ in seqs])
        tables = torch.tensor([list(t) + [0] * (width - len(t)) for t, _, _ in seqs],
                              dtype=torch.int32).view(len(seqs), width)
        return AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.int64), slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=tables, seq_lens=torch.tensor(lens, dtype=torch.int32),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32), logits_indices=torch.tensor(rows, dtype=torch.int64),
            tree_mask=torch.cat(masks) if masks else None)

    def to(self, device) -> "AttentionMetadata":
        return AttentionMetadata(*(None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                                   for f in dataclasses.fields(self)))

    @property
    def shape(self) -> "StepShape":
        return StepShape(self.positions.numel(), self.seq_lens.numel(), self.logits_indices.numel(),
                         self.block_tables.shape[1])

    def padded(self, shape: "StepShape") -> "AttentionMetadata":
        """The same step stretched to ``shape`` (every field >= this step's), changing no real row.

        Padding tokens go to one extra sequence with no cached keys (its attention output is 0) and
        write no cache slot (``slot_mapping`` -1); padding sequences are empty; padding logit rows
        repeat row 0; padding block-table columns are 0. The real rows keep their indices, so the
        first ``M`` logits of the padded step are this step's.
        """
        have = self.shape
        if have == shape:
            return self
        n, s, m, w = have
        if shape.num_tokens < n or shape.num_logits < m or shape.table_width < w or \
                shape.num_seqs < s + (shape.num_tokens > n):
            raise ValueError(f"cannot pad a step of {have} to {shape}")

        def grow(t: torch.Tensor, size: int, value: int) -> torch.Tensor:
            return torch.cat([t, t.new_full((size - t.shape[0],), value)]) if size > t.shape[0] else t

        tables = self.block_tables
        if shape.table_width > w or shape.num_seqs > s:
            tables = tables.new_zeros(shape.num_seqs, shape.table_width)
            tables[:s, :w] = self.block_tables
        return AttentionMetadata(
            positions=grow(self.positions, shape.num_tokens, 0),
            slot_mapping=grow(self.slot_mapping, shape.num_tokens, -1),
            block_tables=tables, seq_lens=grow(self.seq_lens, shape.num_seqs, 0),
            # the first padding sequence owns every padding token; the others are empty
            query_start_loc=grow(self.query_start_loc, shape.num_seqs + 1, shape.num_tokens),
            logits_indices=grow(self.logits_indices, shape.num_logits, 0),
            tree_mask=None if self.tree_mask is None else torch.cat(
                [self.tree_mask, self.tree_mask.new_full((shape.num_tokens - n, self.tree_mask.shape[1]), -1)]))


class StepShape(NamedTuple):
    """The sizes a compiled step graph is specialized to: tokens N, sequences S, logit rows M and
    block-table width."""

    num_tokens: int
    num_seqs: int
    num_logits: int
    table_width: int


COMPILE_THREAD = "specgraph-compile"  # the thread of a background compile_steps

# the inputs a program feeds on every call (CACHE_ROWS must be gone: paging replaces it)
RUNTIME_ROLES = {Role.TOKENS, Role.LENGTH, Role.STATIC, Role.POSITIONS, Role.SLOTS, Role.BLOCK_TABLES, Role.SEQ_LENS,
                 Role.QUERY_START, Role.LOGITS_INDICES, Role.TREE_MASK, Role.CACHE}


@dataclass
class LayerCacheSpec:
    kv_heads: int
    head_dim: int
    dtype: torch.dtype  # of the float cache (the model's K/V dtype when quantized)
    scheme: Any = None  # kernels.quant.QuantScheme for fp8/int4 caches
    hot_cold: bool = False  # quantized pages plus float hot pages (kernels/hot_cold.py)

    def bytes_per_token(self) -> int:
        """Bytes of one cached token (K and V, params included); a hot/cold cache's cold pages'."""
        if self.scheme is not None:
            return self.scheme.bytes_per_token(self.kv_heads, self.head_dim)
        return self.float_bytes_per_token()

    def float_bytes_per_token(self) -> int:
        """Bytes of one token in the model's dtype (a hot page's)."""
        return 2 * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self, num_blocks: int, page_size: int, device, num_cold: int = 0) -> tuple[torch.Tensor, ...]:
        """``(k_cache, v_cache)``, or ``(k_cache, v_cache, k_scale, v_scale)`` when quantized; a hot/cold
        cache: ``num_cold`` quantized pages, then ``num_blocks`` hot pages ``(k_hot, v_hot)``."""
        shape = (num_blocks, page_size, self.kv_heads, self.head_dim)
        if self.hot_cold:
            from ..kernels.hot_cold import allocate_mixed

            return allocate_mixed(num_blocks, num_cold, page_size, self.kv_heads, self.head_dim, self.dtype,
                                  self.scheme.name, device)
        if self.scheme is not None:
            return self.scheme.allocate(num_blocks, page_size, self.kv_heads, self.head_dim, device=device).tensors()
        return (huge_pages.zeros(shape, self.dtype, device), huge_pages.zeros(shape, self.dtype, device))


@dataclass
class DecoderProgram:
    """The transformed graph plus what is needed to feed it."""

    compiled: CompiledGraph
    layers: list[LayerCacheSpec]
    vocab_size: int
    page_size: int
    selects_logits: bool
    logits_index: int = 0  # position of the logits among the graph's flattened outputs
    hidden_index: int | None = None  # position of the last hidden state (options.hidden_states)
    self_check_seconds: float | None = None  # time the compile-time self-check took (None: not run)
    from_cache: bool = False  # loaded from the graph cache (no capture, no passes in this process)
    cache_key: str | None = None  # its graph-cache key (None: not cacheable); measurements keyed by it live there

    @property
    def gm(self) -> fx.GraphModule:
        return self.compiled.gm

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def kv_bytes_per_token(self) -> int:
        """Cache bytes one token takes over all layers, K and V, scales included (hot/cold: in a cold page)."""
        return sum(s.bytes_per_token() for s in self.layers)

    def kv_hot_bytes_per_token(self) -> int:
        """Cache bytes one token takes in a hot page (the model's dtype), over all layers."""
        return sum(s.float_bytes_per_token() for s in self.layers)

    @property
    def hot_cold(self) -> bool:
        """Whether the cache is hot/cold (``kernels/hot_cold.py``): block ids from ``num_blocks`` on are cold."""
        return bool(self.layers) and self.layers[0].hot_cold

    def new_kv_cache(self, num_blocks: int, device: torch.device | str = "cpu",
                     num_cold: int = 0) -> list[tuple[torch.Tensor, ...]]:
        """Per-layer cache tensors: ``(k_cache, v_cache)`` of ``[num_blocks, page_size, kv_heads, head_dim]``,
        plus ``(k_scale, v_scale)`` for a quantized cache; a hot/cold cache has ``num_blocks`` hot pages
        (ids ``0 .. num_blocks - 1``) and ``num_cold`` cold ones (ids from ``num_blocks`` on); on CPU in huge pages
        (``huge_pages.zeros``)."""
        return [s.allocate(num_blocks, self.page_size, device, num_cold) for s in self.layers]

    def graph_inputs(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                     kv_cache: list[tuple[torch.Tensor, ...]]) -> list:
        """The graph's placeholder values for one call, in order."""
        n = input_ids.numel()
        if meta.positions.numel() != n or meta.slot_mapping.numel() != n:
            raise ValueError(f"metadata describes {meta.positions.numel()} tokens, the stream has {n}")
        if len(kv_cache) != len(self.layers):
            raise ValueError(f"kv_cache has {len(kv_cache)} layers; the model has {len(self.layers)}")
        by_role = {Role.TOKENS: input_ids.view(1, n), Role.LENGTH: n, Role.POSITIONS: meta.positions,
                   Role.SLOTS: meta.slot_mapping, Role.BLOCK_TABLES: meta.block_tables, Role.SEQ_LENS: meta.seq_lens,
                   Role.QUERY_START: meta.query_start_loc, Role.LOGITS_INDICES: meta.logits_indices}
        if self.tree_words:
            mask = meta.tree_mask
            if mask is None:
                mask = causal_rows(n, self.tree_words).to(meta.positions.device)
            elif mask.shape != (n, self.tree_words):
                raise ValueError(f"tree_mask must be [{n}, {self.tree_words}]; got {tuple(mask.shape)}")
            by_role[Role.TREE_MASK] = mask
        return [spec.value if spec.role == Role.STATIC
                else kv_cache[spec.layer][CACHE_PARTS.index(spec.part)] if spec.role == Role.CACHE
                else by_role[spec.role] for spec in self._inputs]

    def logits_of(self, out, meta: AttentionMetadata) -> torch.Tensor:
        """``[M, vocab]`` logits of the rows ``meta.logits_indices`` from the graph's raw output."""
        logits = pick_output(out, self.logits_index)  # the model may also return caches, hidden states, ...
        logits = logits.reshape(-1, logits.shape[-1])
        return logits if self.selects_logits else logits.index_select(0, meta.logits_indices)

    def __call__(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                 kv_cache: list[tuple[torch.Tensor, ...]], return_hidden: bool = False):
        """Run the stream. ``input_ids [N]`` -> logits ``[M, vocab]`` for ``meta.logits_indices``; with
        ``return_hidden`` (a program compiled with ``hidden_states``), ``(logits, hidden [N, width])``: the
        last hidden state of every stream token.

        Runs the eager lowering until :meth:`compile_steps` has compiled the step graphs. Ids and
        metadata built on the host move to the program's device here."""
        if return_hidden and self.hidden_index is None:
            raise ValueError("return_hidden needs a program compiled with hidden_states=True")
        if input_ids.device != self._device:
            input_ids = input_ids.to(self._device, non_blocking=True)
        if meta.positions.device != self._device:
            meta = meta.to(self._device)
        m, n = meta.logits_indices.numel(), input_ids.numel()
        if self._steps is None:
            padded, out = meta, self._eager(*self.graph_inputs(input_ids, meta, kv_cache))
        else:
            key, shape = self._steps.shape_for(meta.shape)
            padded = meta.padded(shape)
            if shape.num_tokens > n:
                input_ids = torch.cat([input_ids.view(-1), input_ids.new_zeros(shape.num_tokens - n)])
            out = self._steps(key, self.graph_inputs(input_ids, padded, kv_cache))
        logits = self.logits_of(out, padded)[:m]
        if not return_hidden:
            return logits
        hidden = pick_output(out, self.hidden_index)
        return logits, hidden.reshape(-1, hidden.shape[-1])[:n]

    def compile_steps(self, kv_cache: list[tuple[torch.Tensor, ...]], table_width: int,
                      buckets: tuple[int, ...] | None = None, progress: Callable[[str], None] | None = None,
                      background: bool = False) -> None:
        """Compile the step graphs of ``options.lowering`` for this cache (nothing for "eager").

        ``table_width``: the widest block table a step may carry (bucket graphs are specialized
        to it). ``buckets``: the static graphs' stream sizes; by default measured on this machine
        (:func:`~specgraph.compiler.step_plan.choose_buckets`, its reason in ``self.step_plan``; the
        outcome is kept per machine, and later builds reuse it).
        Once compiled, every call runs generated code (see :mod:`specgraph.compiler.inductor`).
        ``progress(stage)`` is told which graph is being compiled. With ``background``, a thread
        compiles while calls keep running the eager lowering; they switch to the generated code
        when every graph is ready (:meth:`wait_for_steps`); a failure is kept in ``step_error``
        and the program stays eager."""
        if self.lowering == "eager" or self._steps is not None or self._compiling is not None:
            return
        if not background:
            self._steps = self._build_steps(kv_cache, table_width, buckets, progress)
            return

        def build() -> None:
            try:
                self._steps = self._build_steps(kv_cache, table_width, buckets, progress)
            except Exception as e:  # keep serving with the eager lowering, say why
                self.step_error = f"{type(e).__name__}: {e}"
                warnings.warn(f"specgraph: compiling the step graphs failed, staying on the eager lowering "
                              f"({self.step_error.splitlines()[0]})", stacklevel=1)

        self._compiling = threading.Thread(target=build, name=COMPILE_THREAD, daemon=True)
        self._compiling.start()
        atexit.register(self._compiling.join)  # a process must not end under a thread in native code

    def wait_for_steps(self, timeout: float | None = None) -> bool:
        """Wait for a background compile; True when the generated code is in use."""
        if self._compiling is not None:
            self._compiling.join(timeout)
        return self._steps is not None

    def _build_steps(self, kv_cache, table_width: int, buckets, progress):
        from .inductor import StepGraphs
        from .step_plan import StepPlan, save_plan, starting_plan

        timed = self.device.type == "cpu" and self.lowering == "inductor"  # (the interpreter's timings mean nothing)
        options = self.compiled.context.options
        panel = (self.device.type == "cpu" and self.lowering == "inductor" and options.prepack_weights
                 and cpu_linear_kind() == "panel")
        plan, cached = starting_plan(self.gm, self.device, self.cache_key, self.lowering, table_width, buckets,
                                     timed, panel)
        self.step_plan = plan.reason
        steps = StepGraphs(self.gm, self._inputs, self.lowering, plan.buckets, dump_dir=options.dump_dir,
                           cuda_graphs=options.cuda_graphs, panel_linears=panel)

        def run_padding_step(shape: StepShape) -> None:
            empty = AttentionMetadata.build([], self.page_size, [])
            key, _ = steps.shape_for(shape)
            ids = torch.zeros(shape.num_tokens, dtype=torch.long, device=self._device)
            steps(key, self.graph_inputs(ids, empty.padded(shape).to(self._device), kv_cache))

        with torch.no_grad():
            steps.warm_up(run_padding_step, table_width, progress)
            self.step_plan += f"; buckets {steps.buckets} replay as CUDA graphs" if steps.cuda_graphs else ""
            if cached:
                steps.pad_tokens = dict(plan.pad_tokens)
            elif timed:
                self.step_plan += "; " + steps.keep_faster_buckets(run_padding_step)
                self.step_plan += "; " + steps.measure_padding(run_padding_step)
                if buckets is None:
                    save_plan(self.cache_key, self.lowering, table_width, panel,
                              StepPlan(steps.buckets, self.step_plan, steps.pad_tokens))
        return steps

    @property
    def compiles(self) -> int:
        """Inductor compiles of the step graphs so far, warm-up included (0 for the eager lowering)."""
        return self._steps.compiles if self._steps is not None else 0

    @property
    def recompiles(self) -> int:
        """Step graphs compiled after the warm-up (0 in steady state; 0 for the eager lowering)."""
        return self._steps.recompiles if self._steps is not None else 0

    @property
    def captures(self) -> int:
        """CUDA graphs recorded for the bucket steps (one per bucket in steady state; 0 off CUDA)."""
        return self._steps.captures if self._steps is not None else 0

    @property
    def compiling(self) -> bool:
        """A background compile of the step graphs is still running."""
        return self._compiling is not None and self._compiling.is_alive()

    @property
    def buckets(self) -> tuple[int, ...]:
        """Stream sizes of the static step graphs (() until compiled, and for the eager lowering)."""
        return self._steps.buckets if self._steps is not None else ()

    lowering = property(lambda self: self.compiled.context.options.lowering)

    @property
    def tree_words(self) -> int:
        """Words of the program's ``tree_mask`` input (0: compiled without trees)."""
        nodes = self.compiled.context.options.tree_nodes
        return mask_words(nodes) if nodes else 0

    max_tree_nodes = property(lambda self: self.compiled.context.options.tree_nodes)

    device = property(lambda self: self._device)

    def __post_init__(self) -> None:
        context = self.compiled.context
        self._inputs = context.signature.validate(self.gm, RUNTIME_ROLES)  # each placeholder's role, in order
        self._device = next(iter(self.gm.parameters()), torch.empty(0)).device
        options = context.options
        huge_pages.move_buffers(self.gm)  # (CPU) the weights the passes made (fused, quantized): read every step
        self._eager = lower(self.gm, prepack=options.prepack_weights, dump_dir=options.dump_dir)
        self._steps = None  # StepGraphs once compile_steps ran
        self._compiling: threading.Thread | None = None  # a background compile_steps
        self.step_error: str | None = None
        self.step_plan = "eager lowering: op by op" if self.lowering == "eager" else "step graphs not compiled yet"

    def cache_spec(self) -> dict:
        """What :func:`cached_program` needs besides the graph (``graph_cache.py`` saves it)."""
        ctx = self.compiled.context
        return {"layers": [(s.kv_heads, s.head_dim, s.dtype) for s in self.layers], "vocab_size": self.vocab_size,
                "page_size": self.page_size, "selects_logits": self.selects_logits,
                "logits_index": self.logits_index, "self_check_seconds": self.self_check_seconds,
                "hidden_index": self.hidden_index,
                "signature": dict(ctx.signature.specs)}


def cached_program(gm: fx.GraphModule, spec: dict, options: BackendOptions) -> DecoderProgram:
    """A program over a graph loaded from the graph cache (``graph_cache.load``)."""
    from ..kernels.quant import get_scheme
    from .passes import PassContext
    from .signature import DecoderSignature

    scheme = get_scheme(options.kv_cold_scheme) if options.kv_cold_scheme is not None else None
    context = PassContext(options=options, signature=DecoderSignature(dict(spec["signature"])), kv_scheme=scheme,
                          selects_logits=spec["selects_logits"])
    layers = [LayerCacheSpec(kv_heads, head_dim, dtype, scheme, options.kv_hot_cold)
              for kv_heads, head_dim, dtype in spec["layers"]]
    return DecoderProgram(compiled=CompiledGraph(None, gm, context, 0.0), layers=layers,
                          vocab_size=spec["vocab_size"], page_size=spec["page_size"],
                          selects_logits=spec["selects_logits"], logits_index=spec["logits_index"],
                          hidden_index=spec.get("hidden_index"),
                          self_check_seconds=spec["self_check_seconds"], from_cache=True)


def compile_decoder(model: torch.nn.Module, options: BackendOptions | None = None, example_len: int = 8,
                    progress: Callable[[str], None] | None = None) -> DecoderProgram:
    """Capture ``model`` and run the full decoder pipeline (see module docstring); ``progress(stage)``
    is told when each stage starts."""
    options = options or BackendOptions()
    say = progress or (lambda stage: None)
    from . import graph_cache

    key = graph_cache.cache_key(model, options, example_len) if graph_cache.cache_dir() is not None else None
    entry = graph_cache.load(key, model) if key is not None else None
    if entry is not None:
        say("graph from the cache")
        program = cached_program(entry["gm"], entry["spec"], options)
        program.cache_key = key
        return program
    say("capture + passes")
    result: dict[str, CompiledGraph] = {}

    def capture_backend(gm, example_inputs):
        result["compiled"] = run_capture_pipeline(gm, example_inputs, options, passes=decoder_passes())
        return gm.forward

    device = next(iter(model.parameters())).device
    ids = torch.zeros(1, example_len, dtype=torch.long, device=device)
    torch._dynamo.mark_dynamic(ids, 1)
    compiled_model = torch.compile(model, backend=capture_backend, fullgraph=True)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1 << 30, accumulated_recompile_limit=1 << 30):
        try:
            compiled_model(ids)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            raise e.inner_exception if getattr(e, "inner_exception", None) else e
        except torch._dynamo.exc.Unsupported as e:
            raise ValueError(f"specgraph needs the whole forward as one graph; Dynamo could not capture it: {e}") from e
    if "compiled" not in result:
        raise RuntimeError("Dynamo did not call the specgraph backend (the forward may already be compiled elsewhere "
                           "with a cache-size limit hit); call torch._dynamo.reset() and retry")
    program = _program(result["compiled"], options)
    if options.self_check:
        from .self_check import self_check

        say("self-check")
        # a hot/cold cache is checked as built: every page hot, so exact like a float cache
        program.self_check_seconds = self_check(program, "auto" if options.kv_hot_cold else options.kv_dtype)
    if key is not None:
        graph_cache.save(key, program, model)
        # run the graph as later processes load it (a re-trace names nodes unlike the capture), so that
        # AOT Autograd's cache, keyed on the code, serves them what this process compiles
        program = cached_program(graph_cache.retraced(program.gm), program.cache_spec(), options)
        program.from_cache, program.cache_key = False, key
    return program


def _program(compiled: CompiledGraph, options: BackendOptions) -> DecoderProgram:
    ctx = compiled.context
    analysis = ctx.analysis
    caches = ctx.signature.caches(compiled.gm)
    if sorted(caches) != [s.layer for s in analysis.sites]:
        raise SignatureError(f"cache inputs for layers {sorted(caches)}; the model has attention sites "
                             f"{[s.layer for s in analysis.sites]}")
    layers = [LayerCacheSpec(s.kv_heads, s.head_dim, s.q.meta["val"].dtype if ctx.kv_scheme else
                             caches[s.layer]["k"].meta["val"].dtype, ctx.kv_scheme, ctx.options.kv_hot_cold)
              for s in analysis.sites]
    return DecoderProgram(compiled=compiled, layers=layers, vocab_size=analysis.vocab_size,
                          page_size=options.page_size, selects_logits=ctx.selects_logits,
                          logits_index=analysis.logits_index, hidden_index=ctx.hidden_index)
