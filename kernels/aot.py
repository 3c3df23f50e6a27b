"""Ahead-of-time compilation of every kernel specialization we launch, for NVIDIA targets.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` lowers a
``@triton.jit`` function to PTX and (with the bundled ptxas) a cubin without a GPU, so
this is the CI check that the kernels build for sm_80 / sm_90 on a CPU-only machine.

It cannot run under ``TRITON_INTERPRET=1``: that env var makes ``@triton.jit`` return
interpreter objects, which have nothing to compile. Run it in a process without the var
(``tests/test_kernels_aot.py`` uses a subprocess), e.g.::

    python -c "from specgraph.kernels.aot import compile_all; compile_all(90, 'dump/')"

Specializations
---------------
Constexprs are what change the binary. ``cache_write``: dtype x head_dim.
``paged_attention``, ``paged_attention_fp8``, ``paged_attention_int4`` and the hot/cold
``paged_attention_mixed_{fp8,int4}`` are the one attention
kernel (``attention_kernel.py``) with its ``LAYOUT`` constexpr set to ``"float"`` / ``"fp8"`` /
``"int4"``: dtype (the cache's; for quantized caches q's) x head_dim x page_size, with the
GQA group size ``G`` a runtime argument (every ``G <= 16`` runs the ``BLOCK_G = 16`` binary,
so G in {1, 3, 4, 8} shares one build). Page size only changes index arithmetic, so the
other page sizes are built for a few (dtype, head_dim) points rather than the full cross
product: bf16 / 128 and fp32 / 32 for float caches, bf16 / 64 for quantized ones (whose
layout is fixed per scheme: e4m3 bits / int4 nibbles as ``uint8``, int4 groups following
from head_dim). The variant's ``window`` is a runtime argument; its ``HAS_SOFTCAP`` /
``HAS_ALIBI`` flags only add elementwise code on the scores, so their three on-combinations
are built at the first of those points per layout, and so is ``HAS_TREE`` (token trees:
``tree_mask.py``) for every padded GQA group. Quantized cache writes
(``quant_cache_write.py``) build every (dtype, head_dim).

``quant_linear_int8``, ``quant_linear_int4``, ``quant_linear_fp8`` and ``quant_linear_bfloat16``
are the one linear kernel (``quant_linear_triton.py``) with its ``SCHEME`` constexpr set: x's
dtype (float32, bfloat16) x the launcher's ``BLOCK_M`` values (16 for M <= 16, 64 above) x
with / without bias (``HAS_BIAS``; ``bias_ptr`` is None without). M, N, K and the int4 group
are runtime arguments, so one binary serves every layer shape and both int4 groups.

Cost: a build takes ~1.5-2.5 s on the 2-core dev box (cold Triton cache); Triton's on-disk
cache makes warm reruns take a few seconds.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import time
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget

from . import attention_kernel as _attention_kernel_mod
from . import cache_write as _cache_write_mod
from . import quant as _quant_mod
from . import quant_cache_write as _quant_cache_write_mod
from . import quant_linear as _quant_linear_mod
from . import quant_linear_triton as _quant_linear_triton_mod
from . import triton_helpers as _triton_helpers_mod

ARCHS = (80, 90)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEAD_DIMS = (32, 64, 128)
PAGE_SIZES = (8, 16, 32)
GQA_GROUPS = (1, 3, 4, 8)
VARIANT_FLAGS = ((True, False), (False, True), (True, True))  # (HAS_SOFTCAP, HAS_ALIBI) besides neither
QUANT_LINEAR_DTYPES = (torch.float32, torch.bfloat16)  # x's dtype (y's too)
_DEFAULT_PAGE_SIZE = 16
_TRITON_TYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One compiled specialization: which kernel and the values of its constexprs."""

    kernel_name: str  # a key of _KERNELS: "cache_write", "paged_attention", "cache_write_fp8", ...
    dtype: torch.dtype  # cache dtype (q / k / v the same); quantized kernels: the k / v / q dtype; quant_linear: x's
    head_dim: int | None = None  # every kernel but quant_linear
    page_size: int | None = None  # paged_attention only
    block_g: int | None = None  # paged_attention only: padded GQA group
    softcap: bool = False  # paged_attention only: the variant's HAS_SOFTCAP / HAS_ALIBI
    alibi: bool = False
    tree: bool = False  # paged_attention only: HAS_TREE (a tree_mask is given)
    block_m: int | None = None  # quant_linear only: rows per program
    bias: bool = False  # quant_linear only: HAS_BIAS

    @property
    def tag(self) -> str:
        parts = [self.kernel_name, _TRITON_TYPE[self.dtype]]
        if self.head_dim is not None:
            parts.append(f"d{self.head_dim}")
        if self.page_size is not None:
            parts += [f"p{self.page_size}", f"g{self.block_g}"]
        if self.block_m is not None:
            parts.append(f"m{self.block_m}")
        parts += ["softcap"] * self.softcap + ["alibi"] * self.alibi + ["tree"] * self.tree + ["bias"] * self.bias
        return "_".join(parts)


@dataclasses.dataclass(frozen=True)
class CompileResult:
    spec: KernelSpec
    arch: int  # SM version, e.g. 90
    ptx: str
    cubin_size: int  # bytes
    seconds: float


def _ast_source(fn, signature: dict, constexprs: dict) -> triton.compiler.ASTSource:
    """``fn`` specialized to ``constexprs`` (each marked in the signature) over the runtime ``signature``."""
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    return triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)


def _cache_write_source(spec: KernelSpec) -> triton.compiler.ASTSource:
    t = _TRITON_TYPE[spec.dtype]
    signature = {
        "k_ptr": f"*{t}", "v_ptr": f"*{t}", "k_cache_ptr": f"*{t}", "v_cache_ptr": f"*{t}",
        "slot_mapping_ptr": "*i64",
        "stride_kn": "i32", "stride_kh": "i32", "stride_vn": "i32", "stride_vh": "i32",
        "stride_cache_slot": "i32", "stride_cache_head": "i32",
        "HEAD_DIM": "constexpr", "BLOCK_D": "constexpr", "INTERPRETER": "constexpr",
    }
    constexprs = {
        "HEAD_DIM": spec.head_dim,
        "BLOCK_D": triton.next_power_of_2(spec.head_dim),
        "INTERPRETER": False,
    }
    return triton.compiler.ASTSource(
        fn=_cache_write_mod._cache_write_kernel, signature=signature, constexprs=constexprs
    )


def _cache_write_quant_source(spec: KernelSpec) -> triton.compiler.ASTSource:
    t = _TRITON_TYPE[spec.dtype]
    int4 = spec.kernel_name == "cache_write_int4"
    params = "*fp16" if int4 else "*fp32"
    signature = {
        "k_ptr": f"*{t}", "v_ptr": f"*{t}", "k_cache_ptr": "*u8", "v_cache_ptr": "*u8",
        ("k_params_ptr" if int4 else "k_scale_ptr"): params, ("v_params_ptr" if int4 else "v_scale_ptr"): params,
        "slot_mapping_ptr": "*i64",
        "stride_kn": "i32", "stride_kh": "i32", "stride_vn": "i32", "stride_vh": "i32",
        "kv_heads": "i32",
    }
    if int4:
        k_group, v_group = _int4_groups(spec.head_dim)
        constexprs = {
            "HEAD_DIM": spec.head_dim, "K_GROUP": k_group, "V_GROUP": v_group,
            "BLOCK_KG": triton.next_power_of_2(spec.head_dim // k_group),
            "BLOCK_VG": triton.next_power_of_2(spec.head_dim // v_group),
        }
        fn = _quant_cache_write_mod._cache_write_int4_kernel
    else:
        constexprs = {"HEAD_DIM": spec.head_dim, "BLOCK_D": triton.next_power_of_2(spec.head_dim)}
        fn = _quant_cache_write_mod._cache_write_fp8_kernel
    return _ast_source(fn, signature, constexprs)


def _paged_attention_source(spec: KernelSpec) -> triton.compiler.ASTSource:
    t = _TRITON_TYPE[spec.dtype]
    layout = spec.kernel_name.removeprefix("paged_attention").removeprefix("_") or "float"
    mixed = layout.startswith("mixed_")  # hot/cold caches (hot_cold.py): hot pages in q's dtype
    layout = layout.removeprefix("mixed_")
    cache, params = {"float": (f"*{t}", None), "fp8": ("*u8", "*fp32"), "int4": ("*u8", "*fp16")}[layout]
    signature = {
        "out_ptr": f"*{t}", "q_ptr": f"*{t}", "k_cache_ptr": cache, "v_cache_ptr": cache,
        "k_params_ptr": params, "v_params_ptr": params,
        "k_hot_ptr": f"*{t}" if mixed else None, "v_hot_ptr": f"*{t}" if mixed else None, "num_hot": "i32",
        "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "positions_ptr": "*i64", "seq_ids_ptr": "*i32",
        "alibi_slopes_ptr": "*fp32" if spec.alibi else None,
        "tree_mask_ptr": "*i32" if spec.tree else None, "query_start_loc_ptr": "*i32", "tree_words": "i32",
        "qk_scale": "fp32", "softcap": "fp32", "window": "i32",
        "stride_qn": "i32", "stride_qh": "i32", "stride_on": "i32", "stride_oh": "i32",
        "stride_bt": "i32",
        "kv_heads": "i32",
        "group": "i32",
    }
    k_group, v_group = _int4_groups(spec.head_dim) if layout == "int4" else (0, 0)
    # float caches have no params and a call without ALiBi no slopes: the launcher passes None
    constexprs = {name: None for name, ty in signature.items() if ty is None}
    constexprs.update({
        "HEAD_DIM": spec.head_dim,
        "BLOCK_D": triton.next_power_of_2(spec.head_dim),
        "BLOCK_G": spec.block_g,
        "PAGE_SIZE": spec.page_size,
        "BLOCK_N": _attention_kernel_mod.BLOCK_N,
        "LAYOUT": layout,
        "K_GROUP": k_group,
        "V_GROUP": v_group,
        "HAS_SOFTCAP": spec.softcap,
        "HAS_ALIBI": spec.alibi,
        "HAS_TREE": spec.tree,
        "MIXED": mixed,
        "INTERPRETER": False,
    })
    return _ast_source(_attention_kernel_mod.paged_attention_kernel, signature, constexprs)


_QUANT_LINEAR_OPERANDS = {  # scheme -> (weight, scales) pointer types; None: the launcher passes None
    "int8": ("*i8", "*fp32"),
    "int4": ("*u8", "*fp16"),
    "fp8": ("*u8", "*fp32"),  # e4m3 bits: Triton's float8 type is refused below sm_89
    "bfloat16": ("*bf16", None),
}


def _quant_linear_source(spec: KernelSpec) -> triton.compiler.ASTSource:
    t = _TRITON_TYPE[spec.dtype]
    scheme = spec.kernel_name.removeprefix("quant_linear_")
    weight, scales = _QUANT_LINEAR_OPERANDS[scheme]
    signature = {
        "y_ptr": f"*{t}", "x_ptr": f"*{t}", "w_ptr": weight, "scales_ptr": scales,
        "bias_ptr": "*fp32" if spec.bias else None,
        "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "group": "i32",
    }
    constexprs = {name: None for name, ty in signature.items() if ty is None}
    constexprs.update({
        "SCHEME": scheme,
        "HAS_BIAS": spec.bias,
        "BLOCK_M": spec.block_m,
        "BLOCK_N": _quant_linear_triton_mod.BLOCK_N,
        "BLOCK_K": _quant_linear_triton_mod.BLOCK_K,
        "INTERPRETER": False,
    })
    return _ast_source(_quant_linear_triton_mod.quant_linear_kernel, signature, constexprs)


def _int4_groups(head_dim: int) -> tuple[int, int]:
    return tuple(_quant_mod.int4_group_size(head_dim, g) for g in _quant_mod.INT4_GROUPS)


_KERNELS = {
    "cache_write": (_cache_write_mod._cache_write_kernel, _cache_write_source),
    "paged_attention": (_attention_kernel_mod.paged_attention_kernel, _paged_attention_source),
    "cache_write_fp8": (_quant_cache_write_mod._cache_write_fp8_kernel, _cache_write_quant_source),
    "cache_write_int4": (_quant_cache_write_mod._cache_write_int4_kernel, _cache_write_quant_source),
    "paged_attention_fp8": (_attention_kernel_mod.paged_attention_kernel, _paged_attention_source),
    "paged_attention_int4": (_attention_kernel_mod.paged_attention_kernel, _paged_attention_source),
    "paged_attention_mixed_fp8": (_attention_kernel_mod.paged_attention_kernel, _paged_attention_source),
    "paged_attention_mixed_int4": (_attention_kernel_mod.paged_attention_kernel, _paged_attention_source),
    **{f"quant_linear_{scheme}": (_quant_linear_triton_mod.quant_linear_kernel, _quant_linear_source)
       for scheme in _quant_linear_mod.WEIGHT_SCHEMES},
}


def specializations(kernel_name: str) -> list[KernelSpec]:
    """The specializations of ``kernel_name`` that the launchers can produce (trimmed, see module doc)."""
    _check_kernel_name(kernel_name)
    if kernel_name.startswith("cache_write"):
        return [KernelSpec(kernel_name, dt, d) for dt in DTYPES for d in HEAD_DIMS]
    if kernel_name.startswith("quant_linear"):
        return [
            KernelSpec(kernel_name, dt, block_m=bm, bias=bias)
            for dt in QUANT_LINEAR_DTYPES for bm in _quant_linear_triton_mod.BLOCK_MS for bias in (False, True)
        ]
    block_gs = sorted({max(_attention_kernel_mod.MIN_BLOCK_G, triton.next_power_of_2(g)) for g in GQA_GROUPS})
    if kernel_name.startswith("paged_attention_mixed"):
        # the hot/cold kernels add only the hot-page loads to the quantized ones: the default page
        # size, the common head sizes, and the tree path
        return [KernelSpec(kernel_name, dt, d, _DEFAULT_PAGE_SIZE, bg, tree=tree)
                for dt in (torch.float32, torch.bfloat16) for d in (64, 128) for bg in block_gs
                for tree in (False, True)]
    specs = [
        KernelSpec(kernel_name, dt, d, _DEFAULT_PAGE_SIZE, bg)
        for dt in DTYPES for d in HEAD_DIMS for bg in block_gs
    ]
    # Other page sizes: one tensor-core (bf16) and one FMA (fp32, "ieee" dot) point; the quantized
    # kernels (~2 s per build, the dequantization adds integer code) one bf16 point.
    if kernel_name == "paged_attention":
        points = ((torch.bfloat16, 128), (torch.float32, 32))
    else:
        points = ((torch.bfloat16, 64),)
    specs += [
        KernelSpec(kernel_name, dt, d, p, bg)
        for dt, d in points
        for p in PAGE_SIZES if p != _DEFAULT_PAGE_SIZE for bg in block_gs
    ]
    # Score modifiers (elementwise code on the scores; the window is a runtime argument): each
    # combination of HAS_SOFTCAP / HAS_ALIBI at the first point.
    dt, d = points[0]
    specs += [
        KernelSpec(kernel_name, dt, d, _DEFAULT_PAGE_SIZE, bg, softcap, alibi)
        for softcap, alibi in VARIANT_FLAGS for bg in block_gs
    ]
    # Token trees (HAS_TREE: the mask's bit tests, and the key positions of a step's new keys), at the
    # first point, for every padded GQA group.
    specs += [KernelSpec(kernel_name, dt, d, _DEFAULT_PAGE_SIZE, bg, tree=True) for bg in block_gs]
    return specs


def compile_spec(spec: KernelSpec, arch: int) -> CompileResult:
    """Compile one specialization for ``sm_{arch}``; raises on any build failure."""
    _check_not_interpreted()
    src = _KERNELS[spec.kernel_name][1](spec)
    start = time.perf_counter()
    # enable_fp_fusion is spelled out to pin today's default (and silence Triton 3.9's warning).
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"enable_fp_fusion": True})
    seconds = time.perf_counter() - start
    ptx, cubin = compiled.asm.get("ptx", ""), compiled.asm.get("cubin", b"")
    if not ptx or not cubin:
        raise RuntimeError(f"{spec.tag} for sm_{arch}: empty PTX or cubin")
    return CompileResult(spec=spec, arch=arch, ptx=ptx, cubin_size=len(cubin), seconds=seconds)


def compile_for_target(kernel_name: str, arch: int | str) -> list[CompileResult]:
    """Compile every specialization of ``kernel_name`` for ``arch`` (80, 90, or "sm_90")."""
    arch = _parse_arch(arch)
    return [compile_spec(spec, arch) for spec in specializations(kernel_name)]


def compile_all(arch: int | str, dump_dir: str | os.PathLike | None = None) -> list[CompileResult]:
    """Compile every specialization of every kernel for ``arch``.

    With ``dump_dir``, writes ``<kernel>.py`` (the source of the kernel's module),
    ``triton_helpers.py`` (the ``@triton.jit`` helpers they call) and
    ``<tag>.sm<arch>.ptx`` per specialization into it.

    Example
    -------
    >>> results = compile_all(90, "/tmp/ptx")   # doctest: +SKIP
    >>> sum(r.cubin_size for r in results) > 0  # doctest: +SKIP
    True
    """
    arch = _parse_arch(arch)
    _check_not_interpreted()
    results = []
    for name in _KERNELS:
        results += compile_for_target(name, arch)
    if dump_dir is not None:
        out = Path(dump_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name, (kernel, _) in _KERNELS.items():
            # The whole module: kernels call @triton.jit helpers defined beside them.
            (out / f"{name}.py").write_text(inspect.getsource(inspect.getmodule(kernel.fn)))
        (out / "triton_helpers.py").write_text(inspect.getsource(_triton_helpers_mod))  # cast / dot / e4m3
        for r in results:
            (out / f"{r.spec.tag}.sm{r.arch}.ptx").write_text(r.ptx)
    return results


def _check_kernel_name(kernel_name: str) -> None:
    if kernel_name not in _KERNELS:
        raise ValueError(f"unknown kernel {kernel_name!r}; valid: {sorted(_KERNELS)}")


def _parse_arch(arch: int | str) -> int:
    value = int(arch.removeprefix("sm_")) if isinstance(arch, str) else int(arch)
    if value not in ARCHS:
        raise ValueError(f"unsupported arch {arch!r}; valid: {[f'sm_{a}' for a in ARCHS]}")
    return value


def _check_not_interpreted() -> None:
    interpreted = [n for n, (k, _) in _KERNELS.items() if not isinstance(k, triton.runtime.JITFunction)]
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or interpreted:
        raise RuntimeError(
            "AOT compilation needs real @triton.jit functions, but TRITON_INTERPRET=1 replaced "
            f"them with interpreter objects ({interpreted or 'env var set'}); run compile_all in a "
            "process started without TRITON_INTERPRET (set before specgraph.kernels was imported)"
        )
