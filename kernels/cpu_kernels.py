"""The C++ CPU kernels: paged attention for decodes and short verifies, and the cache write.

**Cache write** (``cache_write_rows``): each token's K and V rows copied to their slots, padding
slots (< 0) skipped, any dtype as long as the rows and the cache share it. The torch reference
validates and drops padding with tensor ops and a host sync, about 0.25 ms per layer; this costs
a few microseconds, which is 30 layers x that per SmolLM2 step.

**Paged attention** (``paged_attention_short``): a small kernel that reads the pages in place.

The torch path (``paged_attention_ref``) gathers every K/V row a step reads into a fresh tensor
and then runs SDPA over it: each cached byte is read twice and written once. This kernel walks
the block table and reads each K and V row (all kv heads of a slot, contiguous) once, straight
from the cache, for every query token and head of the sequence that sees it (GQA: head ``h``
uses kv head ``h // G``), with an online softmax in float32 over fixed chunks of 64 keys whose partials
are folded in key order. One work item is a (sequence, kv head), spread over torch's intra-op threads;
where there are fewer than two per thread, a short step's items are split by key chunk and a long
one's by query head, neither of which changes a row's bits. (Work items per (token, kv head) read each
row in three head-sized pieces at different times and were 3x slower on SmolLM2's cold cache.)

It implements the op contract's variants (``paged_attention.py``, "variant"): ``window``,
``softcap`` and ``alibi_slopes`` (float32 ``[num_heads]``). With a sliding window each token sees
keys ``[max(0, p - window + 1), min(p + 1, seq_len))``, and a sequence's work item walks only the
union of its tokens' ranges, never the keys before it: a windowed decode reads ``window`` keys
(and checks only those block-table entries) at any context length. The soft cap and the ALiBi
bias rewrite the scores row by row between the QK pass and the softmax, behind one test per
(token, head); the window's per-key test is compiled only into the windowed instance of the loops
(a template flag), so plain calls run the same loops as before. Token trees (``tree_mask``,
``tree_mask.py``): each token reads keys up to its own cache index, those the rule hides scored the
float minimum (exp gives 0), ALiBi biased by the keys' positions; without a mask none of it runs.

It serves every step over float32, fp8 and int4 caches (float32 queries), with or without a
variant: decodes, verifies and prefill chunks (SmolLM2's heads, 2 threads, against the torch path:
4 sequences x 4 queries over 1000 keys 0.45 vs 3.5 ms, 2 x 300-token prefills 2.0 vs 3.6 ms, one
1024-token prefill 19.3 vs 18.4 ms). It used to hand long verifies and prefill chunks to the torch
path, which made a token's attention depend on the step that computed it. bf16/fp16 caches or
queries run the torch path. Over a quantized cache each work item first dequantizes the K and V rows of
its key range into the thread's buffers (each quantized byte read once; the pool is never
dequantized), then runs the float loops on them. It registers as the ``"cpp"`` implementation of
``specgraph::paged_attention`` and ``specgraph::paged_attention_{fp8,int4}`` (``registry.py``)
with that test (which validates the variant with ``check_variant``). The native ops
``specgraph_cpu::paged_attention[_fp8|_int4]`` (what compiled graphs call) run it under the same
test, variant included, and hand every other call, or an invalid one, to the ``specgraph::`` op. The C++ source is compiled once
per machine by ``torch.utils.cpp_extension.load_inline`` (cached in ``TORCH_EXTENSIONS_DIR``;
20-60 s on 2 cores the first time), with ``-fopenmp``: ATen's ``at::parallel_for`` is OpenMP code
inlined from its headers, and without the flag every kernel here ran on one thread (a few-row
linear streamed SmolLM2's weights at 14 GB/s on 2 cores; with it, 21-27 GB/s). If it cannot be built the torch path runs and ``build_error()``
says why. The pure-torch reference it is tested against is ``paged_attention.paged_attention_ref``.
"""
from __future__ import annotations

import contextlib
import threading
import time
import warnings
from pathlib import Path

import torch

from .build_lock import exclusive_build
from .cache_write import check_cache_write_args, check_token_args
from .paged_attention import check_attention_args, check_stream_args, check_variant
from .hot_cold import mixed_layout
from .quant import fp8_layout, int4_layout
from .quant_linear import check_quant_linear_args
from .registry import register
from .tree_mask import check_tree_mask

_SOURCES = ("cpu_kernels.cpp", "cpu_quant_linear.cpp", "cpu_quant_cache.cpp", "cpu_panel_linear.cpp")  # beside this file, compiled as one extension
CPP_SOURCE = "\n".join((Path(__file__).with_name(name)).read_text() for name in _SOURCES)
#: native ops (``torch.ops.specgraph_cpu.<name>``): the twins of specgraph ops (the same contract, the
#: C++ kernel straight from the dispatcher where it applies, else the specgraph op itself), and
#: ``panel_linear`` (over ``pack_panels`` weights), the batch-invariant linear (``panel_linear.py``)
NATIVE_OPS = ("paged_attention", "cache_write", "pack_panels", "panel_linear", "quant_linear", "paged_attention_fp8", "paged_attention_int4",
              "cache_write_fp8", "cache_write_int4")

_EXTENSION = "specgraph_cpu_kernels"
#: the flags the extension is built with (and the A/B builds of benchmarks/ab_*.py, to time what runs)
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math")
_lock = threading.Lock()
_module = None
_error: str | None = None


def load():
    """The compiled extension (built on first use, then cached on disk), or None if it cannot be built."""
    global _module, _error
    with _lock:
        if _module is None and _error is None:
            try:
                with exclusive_build(build_directory()):
                    _module = _build()
                _register_native_fakes()
            except Exception as e:  # no compiler, no ninja, ...: the torch path still works
                _error = f"{type(e).__name__}: {e}"
                warnings.warn(f"specgraph: the C++ CPU attention kernel could not be built, using the torch path "
                              f"({_error.splitlines()[0]})", stacklevel=2)
        return _module


def _build():
    """torch's ``load_inline`` of the kernels: a build, or the load of the build cached on disk."""
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name=_EXTENSION, cpp_sources=[CPP_SOURCE],
        functions=["paged_attention_short", "paged_attention_quant_short", "quant_attention_applies",
                   "paged_attention_mixed_short", "quant_cache_write_cpu", "quant_cache_write_applies",
                   "cache_write_rows", "quant_linear_cpu", "quant_linear_applies", "set_bf16_dots",
                   "set_panel_prefetch", "set_quant_prefetch", "bf16_dot_available"],
        extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"],
        verbose=False)


def _register_native_fakes() -> None:
    """Shapes of the native ops for FakeTensor tracing (the ops themselves are defined in C++)."""
    @torch.library.register_fake("specgraph_cpu::paged_attention")
    def _(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale, window=0, softcap=0.0,
          alibi_slopes=None, tree_mask=None):
        return q.new_empty(q.shape)

    for scheme in ("fp8", "int4"):
        @torch.library.register_fake(f"specgraph_cpu::paged_attention_{scheme}")
        def _(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, positions, scale,
              window=0, softcap=0.0, alibi_slopes=None, tree_mask=None):
            return q.new_empty(q.shape)

        @torch.library.register_fake(f"specgraph_cpu::cache_write_{scheme}")
        def _(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping):
            return None

    @torch.library.register_fake("specgraph_cpu::cache_write")
    def _(k, v, k_cache, v_cache, slot_mapping):
        return None

    @torch.library.register_fake("specgraph_cpu::pack_panels")
    def _(w):
        width = torch.ops.specgraph_cpu.panel_width()
        return w.new_empty((-(-w.shape[0] // width), w.shape[1], width))

    @torch.library.register_fake("specgraph_cpu::panel_linear")
    def _(x, panels, bias, n):
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("specgraph_cpu::quant_linear")
    def _(x, weight, scales, bias, scheme):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))


def native_op(name: str):
    """``torch.ops.specgraph_cpu.<name>.default`` when the extension is built (None otherwise)."""
    if name not in NATIVE_OPS or load() is None:
        return None
    return getattr(torch.ops.specgraph_cpu, name).default


def build_directory() -> str:
    """Where torch builds and caches the extension (``TORCH_EXTENSIONS_DIR`` or its default; created if missing)."""
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(_EXTENSION, verbose=False)


def build_now() -> None:
    """Build (or load the cached build of) the kernel, saying so on stderr when it is a real build."""
    if _module is not None or _error is not None:
        return
    import os
    import sys

    # (the directory itself is made by the first look at it: a built library says whether a build is cached)
    cached = any(f.startswith(_EXTENSION) and f.endswith(".so") for f in os.listdir(build_directory()))
    t0 = time.perf_counter()
    if not cached:
        print("specgraph: building the C++ CPU kernels (once per machine, 20-60 s)...",
              file=sys.stderr, flush=True)
    load()
    if not cached and _module is not None:
        print(f"specgraph: built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)


def build_error() -> str | None:
    """Why the kernel could not be built (None if it was, or was not tried yet)."""
    return _error


def _kernel_options(alibi_slopes, tree_mask):
    """The kernels' forms of the optional arguments: float32 slopes, a contiguous tree mask."""
    return (None if alibi_slopes is None else alibi_slopes.to(torch.float32).contiguous(),
            None if tree_mask is None else tree_mask.contiguous())


def paged_attention_short_cpp(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale,
                              window=0, softcap=0.0, alibi_slopes=None, tree_mask=None):
    """The C++ kernel (same contract as ``paged_attention_ref``, variant and token trees included; float32 q
    and caches, any query counts; slopes of any float dtype are passed as float32)."""
    module = load()
    if module is None:
        raise RuntimeError(f"the C++ CPU attention kernel is not available: {_error}")
    return module.paged_attention_short(
        q.contiguous(), k_cache, v_cache, block_tables.to(torch.int32).contiguous(),
        seq_lens.to(torch.int32).contiguous(), query_start_loc.to(torch.int32).contiguous(),
        positions.to(torch.int64).contiguous(), float(scale), int(window), float(softcap),
        *_kernel_options(alibi_slopes, tree_mask))


def _kernel_applies(q, k_cache, v_cache) -> bool:
    return (q.dtype == torch.float32 and k_cache.dtype == torch.float32 and v_cache.dtype == torch.float32
            and q.device.type == "cpu" and k_cache.is_contiguous() and v_cache.is_contiguous())


def _cpp_takes(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale, window=0,
               softcap=0.0, alibi_slopes=None, tree_mask=None) -> bool:
    """The registry's test: float32 contiguous caches on CPU and the kernel built (with or without a variant
    or a tree: the kernel implements the window, the soft cap, ALiBi and the tree mask)."""
    if not (_kernel_applies(q, k_cache, v_cache) and load() is not None):
        return False
    check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions)
    check_variant(q, window, softcap, alibi_slopes)
    check_tree_mask(q, tree_mask)
    return True


register("paged_attention", "cpp", paged_attention_short_cpp, ("cpu",), applies=_cpp_takes, priority=10)


def _quant_attention(scheme: str):
    """The C++ kernel over a quantized cache (``quant_paged_attention.py``'s contract for ``scheme``;
    float32 q): each item's K/V rows dequantized once into the thread's buffers, then the float loops."""
    def run(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, positions, scale,
            window=0, softcap=0.0, alibi_slopes=None, tree_mask=None):
        module = load()
        if module is None:
            raise RuntimeError(f"the C++ CPU attention kernel is not available: {_error}")
        return module.paged_attention_quant_short(
            q.contiguous(), k_cache, v_cache, k_scale, v_scale, block_tables.to(torch.int32).contiguous(),
            seq_lens.to(torch.int32).contiguous(), query_start_loc.to(torch.int32).contiguous(),
            positions.to(torch.int64).contiguous(), float(scale), int(window), float(softcap),
            *_kernel_options(alibi_slopes, tree_mask), scheme)

    def takes(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, positions, scale,
              window=0, softcap=0.0, alibi_slopes=None, tree_mask=None) -> bool:
        if q.dtype != torch.float32 or q.device.type != "cpu" or load() is None:
            return False
        layout = (int4_layout if scheme == "int4" else fp8_layout)(k_cache, v_cache, k_scale, v_scale)
        check_stream_args(q, layout.kv_heads, layout.head_dim, block_tables, seq_lens, query_start_loc, positions)
        check_variant(q, window, softcap, alibi_slopes)
        check_tree_mask(q, tree_mask)
        return bool(load().quant_attention_applies(q, k_cache, v_cache, k_scale, v_scale, scheme))

    return run, takes


def _quant_cache_write(scheme: str):
    """The C++ quantized cache write (``quant_cache_write.py``'s contract for ``scheme``, bit-exact
    with its reference; float32 rows)."""
    def run(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> None:
        module = load()
        if module is None:
            raise RuntimeError(f"the C++ CPU kernels are not available: {_error}")
        module.quant_cache_write_cpu(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping.to(torch.int64), scheme)

    def takes(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> bool:
        if k.dtype != torch.float32 or k.device.type != "cpu" or load() is None:
            return False
        layout = (int4_layout if scheme == "int4" else fp8_layout)(k_cache, v_cache, k_scale, v_scale)
        check_token_args(k, v, layout.kv_heads, layout.head_dim, slot_mapping)
        return bool(load().quant_cache_write_applies(k, v, k_cache, v_cache, k_scale, v_scale,
                                                     slot_mapping.to(torch.int64), scheme))

    return run, takes


for _scheme in ("fp8", "int4"):
    _run, _takes = _quant_attention(_scheme)
    register(f"paged_attention_{_scheme}", "cpp", _run, ("cpu",), applies=_takes, priority=10)
    _run, _takes = _quant_cache_write(_scheme)
    register(f"cache_write_{_scheme}", "cpp", _run, ("cpu",), applies=_takes, priority=10)


def paged_attention_mixed_cpp(q, k_hot, v_hot, k_cold, v_cold, k_scale, v_scale, block_tables, seq_lens,
                              query_start_loc, positions, scale, window=0, softcap=0.0, alibi_slopes=None,
                              tree_mask=None) -> torch.Tensor:
    """The C++ kernel over a hot/cold cache (``hot_cold.py``'s contract; float32 q and hot pages): each
    item's hot rows copied and cold rows dequantized into the thread's buffers, then the float loops."""
    module = load()
    if module is None:
        raise RuntimeError(f"the C++ CPU attention kernel is not available: {_error}")
    return module.paged_attention_mixed_short(
        q.contiguous(), k_hot, v_hot, k_cold, v_cold, k_scale, v_scale, block_tables.to(torch.int32).contiguous(),
        seq_lens.to(torch.int32).contiguous(), query_start_loc.to(torch.int32).contiguous(),
        positions.to(torch.int64).contiguous(), float(scale), int(window), float(softcap),
        *_kernel_options(alibi_slopes, tree_mask), mixed_layout(k_hot, v_hot, k_cold, v_cold, k_scale, v_scale).scheme)


def _cpp_mixed_takes(q, k_hot, v_hot, k_cold, v_cold, k_scale, v_scale, block_tables, seq_lens, query_start_loc,
                     positions, scale, window=0, softcap=0.0, alibi_slopes=None, tree_mask=None) -> bool:
    if q.dtype != torch.float32 or k_hot.dtype != torch.float32 or q.device.type != "cpu" or load() is None:
        return False
    layout = mixed_layout(k_hot, v_hot, k_cold, v_cold, k_scale, v_scale)
    check_stream_args(q, layout.kv_heads, layout.head_dim, block_tables, seq_lens, query_start_loc, positions)
    check_variant(q, window, softcap, alibi_slopes)
    check_tree_mask(q, tree_mask)
    return True


register("paged_attention_mixed", "cpp", paged_attention_mixed_cpp, ("cpu",), applies=_cpp_mixed_takes, priority=10)


def cache_write_cpp(k, v, k_cache, v_cache, slot_mapping) -> None:
    """The C++ cache write (same contract as ``cache_write.cache_write_ref`` for same-dtype rows)."""
    check_cache_write_args(k, v, k_cache, v_cache, slot_mapping)
    module = load()
    if module is None:
        raise RuntimeError(f"the C++ CPU kernels are not available: {_error}")
    module.cache_write_rows(k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping.to(torch.int64).contiguous())


def _cpp_write_takes(k, v, k_cache, v_cache, slot_mapping) -> bool:
    return (k.device.type == "cpu" and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
            and k_cache.is_contiguous() and v_cache.is_contiguous() and load() is not None)


register("cache_write", "cpp", cache_write_cpp, ("cpu",), applies=_cpp_write_takes, priority=10)


def quant_linear_cpp(x, weight, scales, bias, scheme: str):
    """The C++ quantized linear (same contract as ``quant_linear.quant_linear_ref``; float32 x)."""
    check_quant_linear_args(x, weight, scales, bias, scheme)
    module = load()
    if module is None:
        raise RuntimeError(f"the C++ CPU kernels are not available: {_error}")
    return module.quant_linear_cpu(x, weight, scales, bias, scheme)


def _cpp_quant_linear_takes(x, weight, scales, bias, scheme) -> bool:
    return x.device.type == "cpu" and load() is not None and load().quant_linear_applies(x, weight, scales, bias, scheme)


register("quant_linear", "cpp", quant_linear_cpp, ("cpu",), applies=_cpp_quant_linear_takes, priority=10)


BF16_DOT_ROWS = (1, 4, 16, 64)  # row counts of x choose_bf16_products times: decodes, verifies, prefill chunks


def choose_bf16_products(weights: list[torch.Tensor], repeats: int = 5) -> tuple[bool, str]:
    """Set, by measurement, whether bfloat16 weights run on the CPU's native bf16 dot products
    (``cpu_quant_linear.cpp``: x split into two bf16 parts, so the result stays within 2^-17 of
    |x|.|w| of widening the weights) instead of being widened to float32; returns the choice (True:
    native) and a line saying what it measured. One choice for every row count, so a row's numbers
    never depend on the step it is in (batch invariance): native dots are taken only where they win
    by 5% at every row count timed.
    ``weights``: the model's bfloat16 ``[N, K]`` weights (K % 32 == 0), streamed as a decode step
    streams them. A CPU without the instructions (or a build without the extension) keeps widening.
    The switch is process-wide: the choice belongs to the machine."""
    module = load()
    if module is None or not weights:
        return False, "bfloat16 weights: widened (no C++ kernels)" if module is None else "no bfloat16 weights"
    if not module.bf16_dot_available():
        return False, "bfloat16 weights: widened to float32 (this CPU has no native bf16 dot products)"
    weights = [w for w in weights if w.shape[1] % 32 == 0]
    x = {rows: {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights} for rows in BF16_DOT_ROWS}

    def run(rows: int) -> None:
        for w in weights:
            module.quant_linear_cpu(x[rows][w.shape[1]], w, None, None, "bfloat16")

    best = {(way, rows): float("inf") for way in ("widened", "native") for rows in BF16_DOT_ROWS}
    for round_ in range(repeats + 1):  # the first round warms up
        for (way, rows) in best:
            with bf16_products(way == "native"):
                t0 = time.perf_counter()
                run(rows)
                elapsed = time.perf_counter() - t0
            if round_ > 0:
                best[way, rows] = min(best[way, rows], elapsed)
    # (they lose where the products, not the widening, bound the time: vdpbf16ps has half FMA's ports)
    native = all(best["native", rows] < 0.95 * best["widened", rows] for rows in BF16_DOT_ROWS)
    module.set_bf16_dots(native)
    line = ", ".join(f"{rows} rows {best['widened', rows] * 1e3:.2f}/{best['native', rows] * 1e3:.2f} ms"
                     for rows in BF16_DOT_ROWS)
    choice = "native bf16 dots at every row count" if native else "widened to float32"
    return native, f"bfloat16 weights, widened/native bf16 dots: {line} -> {choice}"


@contextlib.contextmanager
def bf16_products(on: bool):
    """Within the block, bfloat16 weights run on native bf16 dot products (``on``) or are widened, where
    the CPU has them; the process's choice is restored after."""
    module = load()
    previous = module.set_bf16_dots(on)
    try:
        yield module.bf16_dot_available()
    finally:
        module.set_bf16_dots(previous)
