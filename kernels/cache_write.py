"""Write new keys/values into the paged KV cache.

Glossary
--------
page / block
    ``page_size`` consecutive token slots of one sequence; the cache is
    ``[num_blocks, page_size, kv_heads, head_dim]``.
slot
    flat token index into the cache, ``block * page_size + offset``. The token at
    position ``j`` of sequence ``s`` lives in slot
    ``block_tables[s, j // page_size] * page_size + j % page_size``.
slot_mapping
    ``[N]`` slot of each token of the flat stream; ``-1`` (any negative) marks padding
    tokens that must not be written.

``cache_write_ref`` is the pure-torch implementation (the production CPU path);
``cache_write_triton`` launches ``_cache_write_kernel`` (CUDA, or CPU under
``TRITON_INTERPRET=1``). Both mutate the caches in place and return ``None``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_helpers import cast, check_launchable, is_interpreted
from .registry import register

CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_token_args(
    k: torch.Tensor,  # [N, kv_heads, head_dim]
    v: torch.Tensor,  # [N, kv_heads, head_dim]
    kv_heads: int,
    head_dim: int,
    slot_mapping: torch.Tensor,  # [N]
) -> None:
    """Validate the new tokens and their slots against a cache of ``kv_heads`` x ``head_dim``.

    Shared by every cache layout (plain and quantized); raises ``ValueError`` naming the bad
    argument. Cache layouts are checked by the callers.
    """
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"k and v must both be [N, kv_heads, head_dim]; got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if (kv_heads, head_dim) != tuple(k.shape[1:]):
        raise ValueError(f"cache (kv_heads, head_dim) {(kv_heads, head_dim)} != k's {tuple(k.shape[1:])}")
    if not (k.is_floating_point() and v.is_floating_point()):
        raise ValueError(f"k and v must be floating point; got {k.dtype}, {v.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping must be [N={k.shape[0]}]; got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be int64 (or int32); got {slot_mapping.dtype}")


def drop_padding(
    slot_mapping: torch.Tensor, *rows: torch.Tensor
) -> tuple[torch.Tensor, ...]:  # (slots int64 [M], *rows[:M])
    """Slots as int64 and the rows to write, without the padding tokens (slot < 0)."""
    slots = slot_mapping.long()
    keep = slots >= 0
    if bool(keep.all()):
        return (slots, *rows)
    # padding present: drop it (data-dependent shape, fine in eager)
    return (slots[keep], *(r[keep] for r in rows))


def check_cache_write_args(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Validate shapes/dtypes/devices; raises ``ValueError`` with the offending value."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, page_size, kv_heads, head_dim]; "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    check_token_args(k, v, k_cache.shape[2], k_cache.shape[3], slot_mapping)
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"cache dtype must be one of {CACHE_DTYPES} (same for k and v); got {k_cache.dtype}, {v_cache.dtype}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (slots are addressed as a flat index)")
    devices = {t.device for t in (k, v, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")


def cache_write_ref(
    k: torch.Tensor,  # [N, kv_heads, head_dim]
    v: torch.Tensor,  # [N, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim], written in place
    v_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [N] int64, < 0 = skip
) -> None:
    """Pure-torch cache write: ``cache.view(-1, KVH, D)[slot_mapping[i]] = k[i]`` for slots >= 0.

    Values are cast to the cache dtype. Duplicate non-negative slots are undefined behaviour.

    Example
    -------
    >>> kc = torch.zeros(2, 4, 1, 2); vc = torch.zeros_like(kc)
    >>> cache_write_ref(torch.ones(2, 1, 2), torch.ones(2, 1, 2), kc, vc, torch.tensor([5, -1]))
    >>> kc.view(-1, 1, 2)[5].tolist()
    [[1.0, 1.0]]
    """
    check_cache_write_args(k, v, k_cache, v_cache, slot_mapping)
    kv_heads, head_dim = k_cache.shape[2:]
    slots, k, v = drop_padding(slot_mapping, k, v)
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


def cache_write_triton(
    k: torch.Tensor,  # [N, kv_heads, head_dim]
    v: torch.Tensor,  # [N, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim], written in place
    v_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [N] int64, < 0 = skip
) -> None:
    """Triton cache write; same contract as :func:`cache_write_ref`.

    One program per (token, kv head) copies one ``head_dim`` row. ``k``/``v`` may be
    strided but their last dim must be contiguous.
    """
    check_cache_write_args(k, v, k_cache, v_cache, slot_mapping)
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v must be contiguous in head_dim (stride(-1) == 1)")
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    check_launchable(_cache_write_kernel, k.device)
    flat_k_cache = k_cache.view(-1, kv_heads, head_dim)
    flat_v_cache = v_cache.view(-1, kv_heads, head_dim)
    _cache_write_kernel[(num_tokens, kv_heads)](
        k, v, flat_k_cache, flat_v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        flat_k_cache.stride(0), flat_k_cache.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        INTERPRETER=is_interpreted(_cache_write_kernel),
    )


@triton.jit
def _cache_write_kernel(
    k_ptr, v_ptr,  # [N, KVH, D]
    k_cache_ptr, v_cache_ptr,  # [num_slots, KVH, D], contiguous
    slot_mapping_ptr,  # [N]
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_cache_slot, stride_cache_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    INTERPRETER: tl.constexpr,  # work around interpreter numerics (triton_helpers.py)
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    # A negative slot is padding: masking every lane turns the program into a no-op.
    # (Written as one comparison: the interpreter rejects `block_mask & scalar_mask`.)
    mask = offs_d < tl.where(slot >= 0, HEAD_DIM, 0)
    dst = slot * stride_cache_slot + head * stride_cache_head + offs_d
    k = tl.load(k_ptr + tok * stride_kn + head * stride_kh + offs_d, mask=mask)
    v = tl.load(v_ptr + tok * stride_vn + head * stride_vh + offs_d, mask=mask)
    tl.store(k_cache_ptr + dst, cast(k, k_cache_ptr.dtype.element_ty, INTERPRETER), mask=mask)
    tl.store(v_cache_ptr + dst, cast(v, v_cache_ptr.dtype.element_ty, INTERPRETER), mask=mask)


register("cache_write", "reference", cache_write_ref, ("cpu", "cuda"))
register("cache_write", "triton", cache_write_triton, ("cuda",), priority=10)
