"""Quantized KV cache, part 1: fp8 bit helpers, quantizer error bounds, cache writes, registry.

* ``rne_e4m3`` / ``e4m3_to_bits`` / ``e4m3_from_bits`` in the interpreter == torch's
  ``float8_e4m3fn`` conversions on every value class (all e4m3 values, midpoints, +-1 ulp
  around them, subnormals, saturation, negatives, -0).
* quantize -> dequantize error bounds of the references (fp8: 2^-4 of the row amax;
  int4: scale / 2 per value), exact zeros.
* Triton cache writes (interpreter) == references, bit for bit (data and scales).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (conftest does it too)

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from specgraph.kernels import QUANT_SCHEMES, get_scheme
from specgraph.kernels import quant_cache_write as qcw
from specgraph.kernels.quant import (
    FP8_MAX,
    dequantize_fp8,
    dequantize_int4,
    int4_group_size,
    quantize_fp8,
    quantize_int4,
)
from specgraph.kernels.triton_helpers import e4m3_from_bits, e4m3_to_bits, is_interpreted, rne_e4m3

if not is_interpreted(qcw._cache_write_fp8_kernel):
    raise RuntimeError("specgraph.kernels was imported before TRITON_INTERPRET=1 was set: the Triton kernels would not run in the interpreter")

WRITERS = {
    "fp8": (qcw.cache_write_fp8_ref, qcw.cache_write_fp8_triton),
    "int4": (qcw.cache_write_int4_ref, qcw.cache_write_int4_triton),
}


# ------------------------------------------------------------------------ e4m3 helpers


@triton.jit
def _encode_kernel(x_ptr, bits_ptr, rounded_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(bits_ptr + offs, e4m3_to_bits(x), mask=mask)
    tl.store(rounded_ptr + offs, rne_e4m3(x), mask=mask)


@triton.jit
def _decode_kernel(bits_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, e4m3_from_bits(tl.load(bits_ptr + offs)))


def _encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bits = torch.empty(x.shape, dtype=torch.uint8)
    rounded = torch.empty_like(x)
    _encode_kernel[(triton.cdiv(x.numel(), 4096),)](x, bits, rounded, x.numel(), BLOCK=4096)
    return bits, rounded


def _e4m3_probe_values() -> torch.Tensor:
    finite = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = finite[~finite.isnan()].unique()  # 253 values: +-0 merge, NaNs dropped
    ordered = finite.double().sort().values
    mids = ((ordered[1:] + ordered[:-1]) / 2).float()  # exact: <= 5 significant bits
    assert torch.equal(mids.double(), (ordered[1:] + ordered[:-1]) / 2)
    up = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    down = torch.nextafter(mids, torch.full_like(mids, float("-inf")))
    gen = torch.Generator().manual_seed(0)
    subnormals = torch.rand(4000, generator=gen) * 2**-6
    tiny = torch.tensor([2**-10, 2**-11, 3 * 2**-11, 1e-30, 1e-45, 0.0, -0.0])
    beyond = torch.tensor([448.0, 449.0, 463.9, 464.0, 480.0, 500.0, 1e4, 1e30, float("inf")])
    carries = torch.tensor([1.9375, 7.75, 0.121, 0.484, 126.24, 15.5, 31.0, 240.0, 0.0146])  # round-up carries
    wide = torch.randn(20000, generator=gen) * 10 ** (torch.rand(20000, generator=gen) * 8 - 5)
    x = torch.cat([finite, mids, up, down, subnormals, tiny, beyond, carries, wide])
    return torch.cat([x, -x])


def test_e4m3_encode_matches_torch_on_every_value_class():
    x = _e4m3_probe_values()
    bits, rounded = _encode(x)
    expected = x.to(torch.float8_e4m3fn)
    mismatches = (bits != expected.view(torch.uint8)).nonzero().flatten()
    assert mismatches.numel() == 0, (x[mismatches][:8], bits[mismatches][:8],
                                     expected.view(torch.uint8)[mismatches][:8])
    # rne_e4m3 (the fp32 value) == torch's round trip, bit for bit (so -0.0 stays -0.0).
    assert torch.equal(rounded.view(torch.int32), expected.float().view(torch.int32))
    assert rounded.abs().max() == FP8_MAX  # saturation, no inf / NaN


def test_e4m3_decode_matches_torch_on_all_256_patterns():
    patterns = torch.arange(256, dtype=torch.uint8)
    out = torch.empty(256)
    _decode_kernel[(1,)](patterns, out, BLOCK=256)
    expected = patterns.view(torch.float8_e4m3fn).float()
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan) and int(nan.sum()) == 2  # 0x7F, 0xFF
    assert torch.equal(out[~nan].view(torch.int32), expected[~nan].view(torch.int32))  # incl. -0.0


# ------------------------------------------------------------------------- references


def test_dequantize_fp8_is_torch_float_times_scale_bit_for_bit():
    """The reference's vectorized e4m3 decode (bits moved into float16 fields) == ``data.float() * scale``."""
    patterns = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).view(16, 16)
    for s in (1.0, 2**-30, 3.7e-3, 1 / 448, 7.5e35, 1e-38):
        scale = torch.full((16,), s)
        out, expected = dequantize_fp8(patterns, scale), patterns.float() * scale[:, None]
        nan = expected.isnan()
        assert torch.equal(out.isnan(), nan) and int(nan.sum()) == 2
        assert torch.equal(out[~nan].view(torch.int32), expected[~nan].view(torch.int32)), s



@st.composite
def rows(draw, max_abs=1e6):
    """``[N, kv_heads, head_dim]`` float32 rows from a mix of value classes."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    n, kv_heads = draw(st.integers(1, 12)), draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([32, 64, 128]))
    x = torch.randn(n, kv_heads, head_dim, generator=gen)
    x *= 10 ** (torch.rand(n, kv_heads, 1, generator=gen) * 8 - 4)  # per-row magnitudes 1e-4 .. 1e4
    kind = draw(st.sampled_from(["plain", "outliers", "limits", "zeros", "constant"]))
    if kind == "outliers":  # one huge value per row: everything else lands in fp8 subnormals / int4 code 0
        x[..., 3] = max_abs * torch.sign(torch.randn(n, kv_heads, generator=gen))
    elif kind == "limits":  # e4m3 limits after scaling: 448, the top midpoints, subnormal steps
        x[..., :8] = torch.tensor([448.0, -448.0, 440.0, 432.0, 2**-9, 2**-10, 3 * 2**-10, 2**-6])
    elif kind == "zeros":
        x[::2] = 0.0
        x[..., : head_dim // 2] = 0.0  # all-zero int4 groups in the other rows
    elif kind == "constant":
        x[:] = x[..., :1]
    return x


def _check_fp8_roundtrip(x):
    data, scale = quantize_fp8(x)
    out = dequantize_fp8(data, scale)
    amax = x.abs().amax(-1)
    assert torch.isfinite(out).all()
    assert (out[x == 0] == 0).all()  # exact zeros stay zero
    err = (out - x).abs()
    assert (err <= 2**-4 * amax.unsqueeze(-1)).all()  # the row-amax bound
    # Tighter per value: half an e4m3 ulp (2^-4 relative), or half the subnormal step 2^-9 * scale.
    assert (err <= 2**-4 * x.abs() + 2**-10 * scale.unsqueeze(-1) * (1 + 1e-6)).all()
    assert (scale[amax == 0] == 1.0).all()


def _check_int4_roundtrip(x, group):
    packed, params = quantize_int4(x, group)
    out = dequantize_int4(packed, params)
    scale = params[..., 0].float().repeat_interleave(group, dim=-1)
    assert torch.isfinite(out).all()
    err = (out - x).abs()
    # scale / 2, plus fp32 rounding of code * scale + min.
    assert (err <= scale / 2 + 2e-7 * (x.abs() + scale * 15)).all(), float((err - scale / 2).max())
    zero_groups = (x.view(*x.shape[:-1], -1, group) == 0).all(-1)
    assert (out.view(*x.shape[:-1], -1, group)[zero_groups] == 0).all()
    assert (params[zero_groups] == 0).all()


@settings(max_examples=15, deadline=None)
@given(rows())
def test_fp8_quantize_dequantize_error_bound(x):
    _check_fp8_roundtrip(x)


@settings(max_examples=15, deadline=None)
@given(rows(max_abs=6e4), st.sampled_from([32, 64]))
def test_int4_quantize_dequantize_error_bound(x, group):
    _check_int4_roundtrip(x, int4_group_size(x.shape[-1], group))


def test_int4_packing_layout_and_saturation():
    x = torch.arange(8.0).view(1, 8)  # min 0, scale 7/15 -> codes 0, 2, 4, 6, 9, 11, 13, 15
    packed, params = quantize_int4(x, 8)
    assert params.dtype == torch.float16 and params[0, 0, 1] == 0
    assert packed.tolist() == [[0 | 2 << 4, 4 | 6 << 4, 9 | 11 << 4, 13 | 15 << 4]]  # element 2i low, 2i+1 high
    big = torch.tensor([[-1e6, 1e6, 0.0, 1.0]])  # beyond float16: clamped to +-65504, no inf / NaN
    out = dequantize_int4(*quantize_int4(big, 4))
    assert torch.isfinite(out).all() and out[0, 0] == -65504 and out[0, 1] >= 65504


def test_int4_group_sizes():
    assert [int4_group_size(64, g) for g in (32, 64)] == [32, 64]
    assert [int4_group_size(32, g) for g in (32, 64)] == [32, 32]
    assert int4_group_size(40, 32) == 8
    with pytest.raises(ValueError, match="head_dim"):
        int4_group_size(33, 32)


# ----------------------------------------------------------------------- cache writes


@st.composite
def write_problems(draw):
    scheme = draw(st.sampled_from(["fp8", "int4"]))
    x = draw(rows())
    n, kv_heads, head_dim = x.shape
    page_size = draw(st.sampled_from([8, 16, 32]))
    num_blocks = draw(st.integers(1, 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    n = min(n, num_blocks * page_size)
    slots = torch.randperm(num_blocks * page_size, generator=gen)[:n]
    slots[torch.rand(n, generator=gen) < draw(st.sampled_from([0.0, 0.3]))] = -1
    # k / v as strided views of one buffer, in the source dtype; v = shuffled k values.
    fused = torch.stack([x[:n], x[:n].flip(0).roll(1, dims=-1)], dim=1).to(draw(st.sampled_from([torch.float32,
                                                                                                  torch.bfloat16])))
    cache = get_scheme(scheme).allocate(num_blocks, page_size, kv_heads, head_dim)
    for t in cache.tensors():  # garbage everywhere: unwritten slots must keep it
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen,
                                                dtype=torch.uint8))
    return scheme, fused[:, 0], fused[:, 1], cache, slots


@settings(max_examples=12, deadline=None)
@given(write_problems())
def test_triton_write_matches_ref_bit_exact(p):
    scheme, k, v, cache, slots = p
    ref, tri = WRITERS[scheme]
    expected = [t.clone() for t in cache.tensors()]
    ref(k, v, *expected, slots)
    tri(k, v, *cache.tensors(), slots)
    for name, got, want in zip(("k_cache", "v_cache", "k_scale", "v_scale"), cache.tensors(), expected):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


@settings(max_examples=40, deadline=None)
@given(write_problems())
def test_cpp_write_matches_ref_bit_exact(p):
    """The C++ write (float32 rows; what compiled CPU graphs call through the native op) stores
    the reference's bytes: every value class of ``rows`` (outliers, e4m3 limits, zero rows and
    groups, constant rows), padding slots, garbage in unwritten slots. Other row dtypes go to the
    reference."""
    from specgraph.kernels import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.fail(f"the C++ CPU kernels did not build: {cpu_kernels.build_error()}")
    scheme, k, v, cache, slots = p
    run, takes = cpu_kernels._quant_cache_write(scheme)
    assert takes(k, v, *cache.tensors(), slots) == (k.dtype == torch.float32)
    expected = [t.clone() for t in cache.tensors()]
    WRITERS[scheme][0](k, v, *expected, slots)
    native = [t.clone() for t in cache.tensors()]
    getattr(torch.ops.specgraph_cpu, f"cache_write_{scheme}")(k, v, *native, slots)
    if k.dtype == torch.float32:
        run(k, v, *cache.tensors(), slots)
    else:
        WRITERS[scheme][0](k, v, *cache.tensors(), slots)
    for name, got, nat, want in zip(("k_cache", "v_cache", "k_scale", "v_scale"), cache.tensors(), native, expected):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
        assert torch.equal(nat.view(torch.uint8), want.view(torch.uint8)), name


@settings(max_examples=10, deadline=None)
@given(write_problems())
def test_ref_write_stores_the_quantized_rows(p):
    """Each written slot holds quantize(row); other slots keep their bytes."""
    scheme, k, v, cache, slots = p
    before = [t.clone() for t in cache.tensors()]
    WRITERS[scheme][0](k, v, *cache.tensors(), slots)
    written = slots >= 0
    flat = [t.view(-1, *t.shape[2:]) for t in cache.tensors()]
    for x, data, params in ((k, flat[0], flat[2]), (v, flat[1], flat[3])):
        if scheme == "fp8":
            q, s = quantize_fp8(x[written])
            assert torch.equal(data[slots[written]].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(params[slots[written]], s)
        else:
            group = x.shape[-1] // params.shape[-2]
            q, s = quantize_int4(x[written], group)
            assert torch.equal(data[slots[written]], q) and torch.equal(params[slots[written]], s)
    untouched = torch.ones(flat[0].shape[0], dtype=torch.bool)
    untouched[slots[written]] = False
    for got, old in zip(cache.tensors(), before):
        assert torch.equal(got.view(-1, *got.shape[2:]).view(torch.uint8)[untouched],
                           old.view(-1, *old.shape[2:]).view(torch.uint8)[untouched])


@pytest.mark.parametrize("scheme", ["fp8", "int4"])
@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_write_padding_only_and_int32_slots(scheme, impl):
    write = WRITERS[scheme][impl == "triton"]
    cache = get_scheme(scheme).allocate(2, 8, 1, 32)
    before = [t.clone() for t in cache.tensors()]
    k = torch.full((3, 1, 32), 2.0)
    write(k, k, *cache.tensors(), torch.full((3,), -1))
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(cache.tensors(), before))
    write(k, -k, *cache.tensors(), torch.tensor([15, -1, 0], dtype=torch.int32))
    deq = dequantize_fp8 if scheme == "fp8" else dequantize_int4
    assert (deq(cache.k_cache[1, 7], cache.k_scale[1, 7]) == 2).all()
    assert (deq(cache.v_cache[0, 0], cache.v_scale[0, 0]) == -2).all()
    assert (deq(cache.k_cache[0, 1:], cache.k_scale[0, 1:]) == 0).all()  # untouched slots dequantize to 0


@pytest.mark.parametrize("impl", [0, 1], ids=["ref", "triton"])
def test_write_bad_arguments_raise_value_error(impl):
    fp8, int4 = QUANT_SCHEMES["fp8"].allocate(2, 8, 2, 32), QUANT_SCHEMES["int4"].allocate(2, 8, 2, 32)
    k = torch.zeros(2, 2, 32)
    slots = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="fp8 cache dtype"):
        WRITERS["fp8"][impl](k, k, *int4.tensors(), slots)
    with pytest.raises(ValueError, match="int4 cache dtype"):
        WRITERS["int4"][impl](k, k, *fp8.tensors(), slots)
    with pytest.raises(ValueError, match="k_scale"):
        WRITERS["fp8"][impl](k, k, fp8.k_cache, fp8.v_cache, fp8.k_scale.double(), fp8.v_scale, slots)
    with pytest.raises(ValueError, match="v_scale"):
        WRITERS["int4"][impl](k, k, int4.k_cache, int4.v_cache, int4.k_scale,
                               torch.zeros(2, 8, 2, 3, 2, dtype=torch.float16), slots)  # 32 % 3 groups
    with pytest.raises(ValueError, match="kv_heads, head_dim"):
        WRITERS["fp8"][impl](torch.zeros(2, 1, 32), torch.zeros(2, 1, 32), *fp8.tensors(), slots)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        WRITERS["int4"][impl](k, k, *int4.tensors(), torch.zeros(3, dtype=torch.long))


# --------------------------------------------------------------------------- registry


def test_registry_bytes_per_token_and_smollm2_budget():
    layers, kv_heads, head_dim = 30, 3, 64  # SmolLM2-135M
    float32_bytes = layers * 2 * kv_heads * head_dim * 4
    assert float32_bytes == 46080
    per_token = {name: layers * s.bytes_per_token(kv_heads, head_dim) for name, s in QUANT_SCHEMES.items()}
    assert per_token == {"fp8": 12240, "int4": 6840}
    assert per_token["int4"] / float32_bytes <= 0.15  # the int4 budget: 0.1484x
    for name, scheme in QUANT_SCHEMES.items():
        for kv_heads, head_dim, page_size in ((3, 64, 16), (2, 32, 8), (1, 128, 32)):
            cache = scheme.allocate(5, page_size, kv_heads, head_dim)
            assert cache.nbytes == 5 * page_size * scheme.bytes_per_token(kv_heads, head_dim), (name, head_dim)
        assert scheme.write_op is getattr(torch.ops.specgraph, f"cache_write_{name}")
        assert scheme.attention_op is getattr(torch.ops.specgraph, f"paged_attention_{name}")
    with pytest.raises(ValueError, match="valid: \\['fp8', 'int4'\\]"):
        get_scheme("int8")
