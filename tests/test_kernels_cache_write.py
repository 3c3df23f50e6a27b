"""cache_write: Triton (interpreter) == C++ (CPU) == torch ref == a per-token Python loop."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (conftest does it too)

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton.runtime.interpreter import InterpretedFunction

from specgraph.kernels import cache_write as cw
from specgraph.kernels.cache_write import cache_write_ref, cache_write_triton
from specgraph.kernels.cpu_kernels import cache_write_cpp

if not isinstance(cw._cache_write_kernel, InterpretedFunction):
    raise RuntimeError("specgraph.kernels was imported before TRITON_INTERPRET=1 was set: the Triton kernels would not run in the interpreter")


def loop_write(k, v, k_cache, v_cache, slot_mapping):
    """The obvious per-token loop, on copies."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    page_size = k_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // page_size, slot % page_size] = k[i].to(k_cache.dtype)
            v_cache[slot // page_size, slot % page_size] = v[i].to(v_cache.dtype)
    return k_cache, v_cache


@st.composite
def problems(draw):
    page_size = draw(st.sampled_from([8, 16, 32]))
    num_blocks = draw(st.integers(1, 6))
    kv_heads = draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from([32, 64, 128, 40]))
    cache_dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    src_dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    num_slots = num_blocks * page_size
    num_tokens = draw(st.integers(0, min(40, num_slots)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    # Distinct random slots (any block, any order), some replaced by -1 padding.
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    padding = torch.rand(num_tokens, generator=gen) < draw(st.sampled_from([0.0, 0.3]))
    slots[padding] = -1
    # k/v as strided views of a fused qkv-like buffer (non-contiguous in N), as after a projection.
    fused = torch.randn(num_tokens, 3, kv_heads, head_dim, generator=gen).to(src_dtype)
    k, v = fused[:, 1], fused[:, 2]
    k_cache = torch.randn(num_blocks, page_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, page_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    return k, v, k_cache, v_cache, slots


@settings(max_examples=15, deadline=None)
@given(problems())
def test_ref_matches_loop(p):
    k, v, k_cache, v_cache, slots = p
    expected_k, expected_v = loop_write(*p)
    cache_write_ref(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@settings(max_examples=15, deadline=None)
@given(problems())
def test_triton_matches_ref(p):
    k, v, k_cache, v_cache, slots = p
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    cache_write_ref(k, v, ref_k, ref_v, slots)
    cache_write_triton(k, v, k_cache, v_cache, slots)
    # Both are a copy plus one rounding cast: bit-exact.
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@settings(max_examples=15, deadline=None)
@given(problems())
def test_cpp_matches_ref(p):
    k, v, k_cache, v_cache, slots = p
    k, v = k.to(k_cache.dtype), v.to(k_cache.dtype)  # the C++ write copies rows of the cache's dtype
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    cache_write_ref(k, v, ref_k, ref_v, slots)
    cache_write_cpp(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("rows", [torch.float32, torch.bfloat16])
def test_native_cache_write_copies_rows_or_falls_back(rows):
    """``torch.ops.specgraph_cpu.cache_write``: the C++ copy for rows of the cache's dtype, the
    registry's path (a cast) otherwise; both equal the reference."""
    import specgraph.kernels.cpu_kernels as cpu

    assert cpu.load() is not None, cpu.build_error()
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(3, 2, 32, generator=g).to(rows), torch.randn(3, 2, 32, generator=g).to(rows)
    caches = [torch.zeros(2, 8, 2, 32) for _ in range(4)]
    slots = torch.tensor([9, -1, 2])
    torch.ops.specgraph_cpu.cache_write(k, v, caches[0], caches[1], slots)
    cache_write_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_cpp_names_a_slot_outside_the_cache():
    cache = torch.zeros(2, 8, 1, 32)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[1\] = 16 is outside the cache's 16 slots"):
        cache_write_cpp(torch.ones(2, 1, 32), torch.ones(2, 1, 32), cache, cache.clone(), torch.tensor([3, 16]))


@pytest.mark.parametrize("impl", [cache_write_ref, cache_write_triton, cache_write_cpp])
def test_padding_only_and_int32_slots(impl):
    k_cache = torch.zeros(2, 8, 1, 32)
    v_cache = torch.zeros(2, 8, 1, 32)
    k = torch.ones(3, 1, 32)
    impl(k, k, k_cache, v_cache, torch.full((3,), -1))
    assert not k_cache.any() and not v_cache.any()
    impl(k, 2 * k, k_cache, v_cache, torch.tensor([15, -1, 0], dtype=torch.int32))
    assert k_cache[1, 7].eq(1).all() and v_cache[0, 0].eq(2).all()
    assert int(k_cache.ne(0).sum()) == 2 * 32


@pytest.mark.parametrize("impl", [cache_write_ref, cache_write_triton, cache_write_cpp])
def test_bad_arguments_raise_value_error(impl):
    k = torch.zeros(2, 2, 32)
    cache = torch.zeros(4, 8, 2, 32)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        impl(k, k, cache, cache, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        impl(k, k, cache, cache, torch.zeros(2))
    with pytest.raises(ValueError, match="kv_heads, head_dim"):
        impl(k, k, torch.zeros(4, 8, 1, 32), torch.zeros(4, 8, 1, 32), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="contiguous"):
        impl(k, k, cache.transpose(0, 1), cache.transpose(0, 1), torch.zeros(2, dtype=torch.long))
