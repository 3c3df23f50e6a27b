"""Backend options: one frozen dataclass, validated on construction.

Every knob the compiler and the runtime read from the user lives here, so a typo is an error at
the call site rather than a silently ignored keyword.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "int4", "adaptive")
DEFAULT_HOT_WINDOW = 32  # tokens kept in the compute dtype per sequence under fp8 / int4 / adaptive
WEIGHT_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8", "int4")
PAGE_SIZES = (8, 16, 32)
MAX_TREE_NODES = 128  # nodes of one sequence's token tree in a step (4 mask words)
CHECK_MODES = ("off", "numeric")
DUMP_ENV_VAR = "SPECGRAPH_DUMP_DIR"
LOWERINGS = ("inductor", "eager", "triton-interpret")
LOWERING_ENV_VAR = "SPECGRAPH_LOWERING"


@dataclass(frozen=True)
class BackendOptions:
    """Options of the specgraph backend.

    Attributes
    ----------
    kv_dtype:
        Storage type of the KV cache: ``"auto"`` (the model's dtype), ``"float32"``,
        ``"bfloat16"``, ``"float16"``, ``"fp8"`` (e4m3 + per-token scales), ``"int4"``, or
        ``"adaptive"``. fp8 and int4 keep each sequence's newest ``kv_hot_window`` tokens in the
        model's dtype and store older pages quantized (a hot/cold cache, ``kernels/hot_cold.py``);
        ``"adaptive"`` keeps every page in the model's dtype while the hot pages have room and
        quantizes (fp8) the oldest pages outside the window, longest sequences first, only when a
        step would otherwise preempt: its outputs may then depend on load, unlike ``"auto"``'s.
    kv_hot_window:
        Tokens per sequence kept in the model's dtype under fp8 / int4 / adaptive (rounded up to
        whole pages; the page being written is always hot). ``None``: ``DEFAULT_HOT_WINDOW``;
        ``0`` with fp8 / int4: every page quantized as it is written (no hot pages).
    page_size:
        Tokens per KV-cache block (8, 16 or 32).
    weight_dtype:
        Storage of the linears' weights: ``"auto"`` / ``"float32"`` (the model's own, unchanged),
        ``"bfloat16"``, ``"int8"`` (per output channel), ``"fp8"`` (e4m3, per output channel) or
        ``"int4"`` (groups of 32 with scale and min; each linear's input is rounded to an int8 grid
        per 32 values); under int4 and fp8 the LM head is int8. The ``quantize_weights`` pass
        rewrites the linears (formats in ``specgraph/kernels/quant_linear.py``); the embedding
        table stays float.
    weight_calibration:
        Token ids the int8 and fp8 weights (and the 8-bit LM head under int4) are calibrated on:
        GPTQ picks each weight's code from its linear's inputs on these tokens instead of the
        nearest one (``specgraph/compiler/calibration.py``). Empty: nearest. The Engine fills it
        from a built-in text when it has a tokenizer.
    passes:
        User passes: plain callables ``fn(gm, ctx)`` or ``@specgraph.graph_pass`` objects. A
        plain callable without placement runs after every built-in pass.
    dump_dir:
        Folder for inspection dumps (graphs before/after each pass, pass log, kernels, MLIR).
        Defaults to ``$SPECGRAPH_DUMP_DIR`` when set (a debugging aid), else no dumps.
    check:
        ``"off"`` or ``"numeric"``: after each pass, run the graph before and after on sample
        inputs and fail if the outputs differ (slow; for pass authors and tests).
    mlir:
        Also dump the captured graph as MLIR through torch-mlir (needs the ``mlir`` extra).
    self_check:
        After compiling a decoder program, run it incrementally on random ids and compare with the
        cache-free graph (:mod:`specgraph.compiler.self_check`); a mismatch raises
        ``UnsupportedModelError`` instead of letting the engine answer wrongly. Costs a few
        forwards. (The backend's own cache-free graph needs no such check.)
    lowering:
        How a decoder program's step runs: ``"inductor"`` (generated code: C++/OpenMP on CPU,
        Triton on CUDA; compiled once per machine, cached on disk), ``"eager"`` (the transformed
        graph op by op: the reference the others are tested against) or ``"triton-interpret"``
        (Inductor's Triton code for CPU tensors, run by the Triton interpreter: slow, for CI).
        Defaults to ``$SPECGRAPH_LOWERING`` when set, else ``"inductor"``.
    hidden_states:
        The program also returns the last hidden state (the LM head's input) of every token of
        the step (``DecoderProgram(..., return_hidden=True)``): a draft head's features.
    tree_nodes:
        The largest token tree (new tokens per sequence) a step may verify in one forward; ``0``
        (default): no trees, and no ``tree_mask`` pass. The program then takes a ``tree_mask``
        input (``kernels/tree_mask.py``) sized for it.
    cuda_graphs:
        On CUDA with the ``"inductor"`` lowering, replay each static bucket's step (the decodes and
        short verifies) as a CUDA graph: one launch per step instead of one per kernel
        (:mod:`specgraph.compiler.cuda_graphs`). ``False`` launches the kernels one by one (for
        comparison and debugging). Ignored elsewhere.
    prepack_weights:
        On CPU, run float32 linears as oneDNN linears over weights reordered once at compile
        time (faster few-row GEMMs; one extra copy of those weights). ``False`` keeps
        ``aten.linear``.
    """

    kv_dtype: str = "auto"
    page_size: int = 16
    weight_dtype: str = "auto"
    weight_calibration: tuple[int, ...] = ()
    passes: Sequence[Callable[..., Any]] = field(default_factory=tuple)
    dump_dir: str | None = None
    check: str = "off"
    mlir: bool = False
    prepack_weights: bool = True
    self_check: bool = True
    lowering: str | None = None
    tree_nodes: int = 0
    hidden_states: bool = False
    kv_hot_window: int | None = None
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.tree_nodes, int) or not 0 <= self.tree_nodes <= MAX_TREE_NODES:
            raise ValueError(f"tree_nodes must be an int in 0..{MAX_TREE_NODES}; got {self.tree_nodes!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype={self.kv_dtype!r} is not supported; valid: {', '.join(KV_DTYPES)}")
        if self.kv_hot_window is not None:
            if not isinstance(self.kv_hot_window, int) or self.kv_hot_window < 0:
                raise ValueError(f"kv_hot_window must be an int >= 0 (tokens); got {self.kv_hot_window!r}")
            if self.kv_dtype not in ("fp8", "int4", "adaptive"):
                raise ValueError(f"kv_hot_window applies to kv_dtype fp8, int4 or adaptive; kv_dtype={self.kv_dtype!r} "
                                 f"keeps every page in its own dtype")
            if self.kv_dtype == "adaptive" and self.kv_hot_window == 0:
                raise ValueError("kv_dtype='adaptive' needs a hot window (kv_hot_window >= 1)")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype={self.weight_dtype!r} is not supported; valid: {', '.join(WEIGHT_DTYPES)}")
        calibration = tuple(self.weight_calibration)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in calibration):
            raise ValueError("weight_calibration must be a sequence of token ids (non-negative ints)")
        object.__setattr__(self, "weight_calibration", calibration)
        if self.page_size not in PAGE_SIZES:
            raise ValueError(f"page_size={self.page_size!r} is not supported; valid: {PAGE_SIZES}")
        if self.lowering is None:
            object.__setattr__(self, "lowering", os.environ.get(LOWERING_ENV_VAR) or "inductor")
        if self.lowering not in LOWERINGS:
            raise ValueError(f"lowering={self.lowering!r} is not supported; valid: {', '.join(LOWERINGS)}")
        if self.check not in CHECK_MODES:
            raise ValueError(f"check={self.check!r} is not supported; valid: {CHECK_MODES}")
        for p in self.passes:
            if not callable(p):
                raise ValueError(f"passes must be callables fn(gm, ctx); got {p!r}")
        object.__setattr__(self, "passes", tuple(self.passes))
        if self.dump_dir is None and os.environ.get(DUMP_ENV_VAR):
            object.__setattr__(self, "dump_dir", os.environ[DUMP_ENV_VAR])

    @property
    def kv_cold_scheme(self) -> str | None:
        """The quantized format of the cache's pages (``"fp8"`` / ``"int4"``), or None for a float cache."""
        return "fp8" if self.kv_dtype == "adaptive" else self.kv_dtype if self.kv_dtype in ("fp8", "int4") else None

    @property
    def kv_hot_cold(self) -> bool:
        """Whether the cache is hot/cold: float pages for the newest tokens, quantized older ones."""
        return self.kv_cold_scheme is not None and self.hot_window_tokens > 0

    @property
    def hot_window_tokens(self) -> int:
        """The hot window in tokens (0: no hot pages), rounded up to whole pages."""
        if self.kv_cold_scheme is None:
            return 0
        window = DEFAULT_HOT_WINDOW if self.kv_hot_window is None else self.kv_hot_window
        return -(-window // self.page_size) * self.page_size

    @property
    def weight_scheme(self) -> str | None:
        """The ``quant_linear`` scheme the weights are rewritten to (None: they stay as they are)."""
        return None if self.weight_dtype in ("auto", "float32") else self.weight_dtype

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "BackendOptions":
        """Build options from keywords, rejecting unknown names with the list of valid ones."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ValueError(f"unknown specgraph option(s) {unknown}; valid options: {', '.join(names)}")
        return cls(**kwargs)
