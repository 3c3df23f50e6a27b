"""Hot/cold paged KV caches: a sequence's newest pages in the compute dtype, its older pages quantized.

One layer's cache is six tensors, in this order in every op signature::

    k_hot, v_hot                      float [num_hot, page_size, kv_heads, head_dim]
    k_cold, v_cold, k_scale, v_scale  a quantized layer cache (quant.py, fp8 or int4) of num_cold pages

Block ids
    One id space and one block table per sequence, so a table may mix both kinds of page (the page's
    dtype is implied by its id): id ``b < num_hot`` is hot page ``b`` (``0`` is the null page), id
    ``b >= num_hot`` is cold page ``b - num_hot``. Prefix sharing, copy-on-write and forks work on ids
    as before; the runtime never writes a cold page.
Writes
    Always into hot pages, with the plain float ``cache_write`` on ``k_hot, v_hot``: the runtime keeps
    each sequence's newest pages hot (the *hot window*, at least the page being written), so every
    slot a step writes is hot.
Demotion
    :func:`demote_blocks` quantizes whole hot pages into cold pages with the scheme's own write op,
    so a demoted page holds bit for bit what writing its rows quantized would have stored (per-token
    scales: a page can be demoted at any time, alone, without touching any other page).
Attention
    ``paged_attention_mixed`` reads each key from the pool its block id names and dequantizes only
    the cold rows it reads. The reference (:func:`paged_attention_mixed_ref`) gathers through
    ``paged_attention.attend_pages_ref``; the Triton kernel (``attention_kernel.py``, ``MIXED``)
    loads a tile's hot and cold rows under complementary masks; the C++ kernel (``cpu_kernels``)
    copies hot rows and dequantizes cold ones into the work item's buffers.

Why hot pages: the keys a token attends to most are the recent ones, and quantization error in them
costs the most; keeping the window exact removes most of the loss (KIVI keeps a full-precision
residual for the same reason, arXiv 2402.02750) while long contexts still cost the quantized bytes.
"""

from __future__ import annotations

import dataclasses

import torch

from . import huge_pages
from .attention_kernel import launch_paged_attention
from .paged_attention import attend_pages_ref, check_same_device, check_stream_args, check_variant
from .quant import FP8_DTYPE, QuantLayout, dequantize_fp8, dequantize_int4, fp8_layout, get_scheme, int4_layout
from .registry import dispatch, register


@dataclasses.dataclass(frozen=True)
class MixedLayout:
    """Geometry of one layer's hot/cold cache, read off (and checked against) its tensors."""

    scheme: str  # "fp8" or "int4": the cold pages' format
    num_hot: int
    cold: QuantLayout

    @property
    def page_size(self) -> int:
        return self.cold.page_size

    @property
    def kv_heads(self) -> int:
        return self.cold.kv_heads

    @property
    def head_dim(self) -> int:
        return self.cold.head_dim


def cold_scheme(k_cold: torch.Tensor) -> str:
    """The cold pages' scheme, from their dtype (e4m3: fp8; bytes: int4)."""
    if k_cold.dtype == FP8_DTYPE:
        return "fp8"
    if k_cold.dtype == torch.uint8:
        return "int4"
    raise ValueError(f"cold KV pages must be float8_e4m3fn (fp8) or uint8 (int4); got {k_cold.dtype}")


def mixed_layout(k_hot, v_hot, k_cold, v_cold, k_scale, v_scale) -> MixedLayout:
    """Validate a hot/cold layer cache; raises ``ValueError`` naming the bad tensor."""
    scheme = cold_scheme(k_cold)
    cold = (fp8_layout if scheme == "fp8" else int4_layout)(k_cold, v_cold, k_scale, v_scale)
    want = (cold.page_size, cold.kv_heads, cold.head_dim)
    for name, t in (("k_hot", k_hot), ("v_hot", v_hot)):
        if t.dim() != 4 or tuple(t.shape[1:]) != want or not t.is_floating_point() or t.element_size() == 1:
            raise ValueError(f"{name} must be a float [num_hot, {', '.join(map(str, want))}] cache matching the cold "
                             f"pages; got {t.dtype} {list(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (slots are addressed as a flat index)")
    if v_hot.shape != k_hot.shape or v_hot.dtype != k_hot.dtype:
        raise ValueError(f"k_hot and v_hot differ: {k_hot.dtype} {list(k_hot.shape)} vs {v_hot.dtype} {list(v_hot.shape)}")
    return MixedLayout(scheme, k_hot.shape[0], cold)


def _check_args(q, caches, block_tables, seq_lens, query_start_loc, positions) -> MixedLayout:
    layout = mixed_layout(*caches)
    check_stream_args(q, layout.kv_heads, layout.head_dim, block_tables, seq_lens, query_start_loc, positions)
    check_same_device(q, *caches, block_tables, seq_lens, query_start_loc, positions)
    return layout


def paged_attention_mixed_ref(
    q: torch.Tensor,  # [N, num_heads, head_dim]
    k_hot: torch.Tensor,  # [num_hot, page_size, kv_heads, head_dim] float
    v_hot: torch.Tensor,
    k_cold: torch.Tensor,  # [num_cold, page_size, kv_heads, ...] quantized (quant.py)
    v_cold: torch.Tensor,
    k_scale: torch.Tensor,  # the cold pages' params (quant.py)
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32: ids < num_hot hot, >= num_hot cold
    seq_lens: torch.Tensor,  # [S] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    positions: torch.Tensor,  # [N] int64
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,  # [num_heads] float
    tree_mask: torch.Tensor | None = None,  # [N, W] int32 (tree_mask.py)
) -> torch.Tensor:  # [N, num_heads, head_dim], q.dtype
    """Pure-torch paged attention over a hot/cold cache: hot rows as stored, cold rows dequantized.

    Example
    -------
    >>> from specgraph.kernels.quant import allocate_int4
    >>> layer = allocate_mixed(2, 2, 4, 1, 8, torch.float32, "int4")      # 2 hot, 2 cold pages of 4 slots
    >>> _ = layer[4].normal_(), layer[5].normal_()
    >>> demote_blocks(*layer[4:], *layer[:4], [1], [2])                   # hot 1 -> cold 0 (id 2)
    >>> out = paged_attention_mixed_ref(torch.randn(1, 2, 8), *layer[4:], *layer[:4],
    ...     torch.tensor([[2, 1]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32),
    ...     torch.tensor([0, 1], dtype=torch.int32), torch.tensor([5]), 8 ** -0.5)
    >>> out.shape
    torch.Size([1, 2, 8])
    """
    caches = (k_hot, v_hot, k_cold, v_cold, k_scale, v_scale)
    layout = _check_args(q, caches, block_tables, seq_lens, query_start_loc, positions)
    check_variant(q, window, softcap, alibi_slopes, tree_mask)
    dequantize = dequantize_fp8 if layout.scheme == "fp8" else dequantize_int4
    hot_slots = layout.num_hot * layout.page_size

    def gather(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hot = slots < hot_slots
        cold_slots = slots[~hot] - hot_slots
        out = []
        for pool, data, params in ((k_hot, k_cold, k_scale), (v_hot, v_cold, v_scale)):
            rows = torch.empty(len(slots), layout.kv_heads, layout.head_dim, dtype=torch.float32, device=q.device)
            rows[hot] = pool.flatten(0, 1).index_select(0, slots[hot]).float()
            rows[~hot] = dequantize(data.flatten(0, 1).index_select(0, cold_slots),
                                    params.flatten(0, 1).index_select(0, cold_slots))
            out.append(rows)
        return out[0], out[1]

    return attend_pages_ref(q, block_tables, seq_lens, query_start_loc, positions, scale,
                            page_size=layout.page_size, kv_heads=layout.kv_heads, gather=gather,
                            window=window, softcap=softcap, alibi_slopes=alibi_slopes, tree_mask=tree_mask)


def paged_attention_mixed_triton(q, k_hot, v_hot, k_cold, v_cold, k_scale, v_scale, block_tables, seq_lens,
                                 query_start_loc, positions, scale, window=0, softcap=0.0, alibi_slopes=None,
                                 tree_mask=None) -> torch.Tensor:
    """Triton paged attention over a hot/cold cache; same contract as :func:`paged_attention_mixed_ref`.

    The hot pages' dtype must be q's (the kernel dots in q's dtype for every row).
    """
    caches = (k_hot, v_hot, k_cold, v_cold, k_scale, v_scale)
    layout = _check_args(q, caches, block_tables, seq_lens, query_start_loc, positions)
    check_variant(q, window, softcap, alibi_slopes, tree_mask)
    if k_hot.dtype != q.dtype:
        raise ValueError(f"the Triton hot/cold kernel needs hot pages in q's dtype {q.dtype}; got {k_hot.dtype}")
    k_data, v_data = (k_cold.view(torch.uint8), v_cold.view(torch.uint8)) if layout.scheme == "fp8" else (k_cold, v_cold)
    return launch_paged_attention(q, k_data, v_data, k_scale, v_scale, block_tables, seq_lens, query_start_loc,
                                  positions, scale, window, softcap, alibi_slopes, tree_mask, layout=layout.scheme,
                                  page_size=layout.page_size, kv_heads=layout.kv_heads,
                                  k_group=layout.cold.k_group, v_group=layout.cold.v_group,
                                  hot=(k_hot, v_hot))


register("paged_attention_mixed", "reference", paged_attention_mixed_ref, ("cpu", "cuda"))
register("paged_attention_mixed", "triton", paged_attention_mixed_triton, ("cuda",), priority=10)


def demote_blocks(k_hot: torch.Tensor, v_hot: torch.Tensor, k_cold: torch.Tensor, v_cold: torch.Tensor,
                  k_scale: torch.Tensor, v_scale: torch.Tensor, src: list[int], dst: list[int]) -> None:
    """Quantize hot pages ``src`` (ids ``< num_hot``) into cold pages ``dst`` (ids ``>= num_hot``).

    Runs the scheme's cache write (C++, Triton or reference, by the registry) on the pages' rows,
    so the stored bytes equal a direct quantized write of the same rows. The hot pages are not
    changed (the caller frees them).
    """
    layout = mixed_layout(k_hot, v_hot, k_cold, v_cold, k_scale, v_scale)
    if len(src) != len(dst):
        raise ValueError(f"demote_blocks: {len(src)} source pages but {len(dst)} destinations")
    if not src:
        return
    num_hot, page = layout.num_hot, layout.page_size
    bad = [b for b in src if not 0 < b < num_hot] + [b for b in dst if not num_hot <= b < num_hot + k_cold.shape[0]]
    if bad:
        raise ValueError(f"demote_blocks: ids {bad} are not hot sources (1..{num_hot - 1}) / cold destinations "
                         f"({num_hot}..{num_hot + k_cold.shape[0] - 1})")
    device = k_hot.device
    src_t = torch.tensor(src, dtype=torch.long, device=device)
    offsets = torch.arange(page, device=device)
    slots = ((torch.tensor(dst, dtype=torch.long, device=device) - num_hot)[:, None] * page + offsets).view(-1)
    k = k_hot.index_select(0, src_t).flatten(0, 1).float()
    v = v_hot.index_select(0, src_t).flatten(0, 1).float()
    dispatch(f"cache_write_{layout.scheme}", k, v, k_cold, v_cold, k_scale, v_scale, slots)


def allocate_mixed(num_hot: int, num_cold: int, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                   scheme: str, device: torch.device | str | None = None) -> tuple[torch.Tensor, ...]:
    """A zeroed layer cache in the program's order (``signature.CACHE_PARTS``): the cold pages' quantized
    cache ``(k_cold, v_cold, k_scale, v_scale)`` of ``scheme`` (at least one page), then the hot pages
    ``(k_hot, v_hot)``. (The ops take the hot pages first: ``paged_attention_mixed(q, *layer[4:], *layer[:4], ...)``.)"""
    shape = (num_hot, page_size, kv_heads, head_dim)
    cold = get_scheme(scheme).allocate(max(num_cold, 1), page_size, kv_heads, head_dim, device=device)
    return (*cold.tensors(), huge_pages.zeros(shape, dtype, device), huge_pages.zeros(shape, dtype, device))


def hot_tensors(layer: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The tensors of a layer cache that a hot block id indexes (and writes reach): a hot/cold cache's
    hot pages, or every tensor of a cache of one kind."""
    return layer[4:] if len(layer) == 6 else layer
