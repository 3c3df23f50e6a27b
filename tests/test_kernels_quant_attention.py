"""Quantized KV cache, part 2: paged attention over fp8 / int4 caches.

* Triton (interpreter) == torch ref, on the float test's ragged batches (decodes, chunked
  prefills, full prefills, empty sequences, shared prefix pages, GQA 1..4, page sizes
  8/16/32, head_dim 32/64, fp32 and bf16 queries); unwritten slots hold garbage bytes
  (NaN patterns included) that must never be read; also with the score modifiers (sliding
  window, soft cap, ALiBi).
* ref == naive dense attention over the dequantized K/V (same math), and ref within a
  rigorous quantization-error bound of float attention over the original K/V.
* The ref dequantizes only the slots of the sequences it attends over, never the pool.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (conftest does it too)

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specgraph.kernels import get_scheme
from specgraph.kernels import quant_paged_attention as qpa
from specgraph.kernels.attention_kernel import paged_attention_kernel
from specgraph.kernels.quant import (
    INT4_GROUPS,
    dequantize_fp8,
    dequantize_int4,
    int4_group_size,
    quantize_fp8,
    quantize_int4,
)
from specgraph.kernels.quant_cache_write import cache_write_fp8_ref, cache_write_int4_ref
from specgraph.kernels.triton_helpers import is_interpreted
from test_kernels_paged_attention import MIXED, Batch, batches, make_batch, naive_dense_attention, variants

if not is_interpreted(paged_attention_kernel):
    raise RuntimeError("specgraph.kernels was imported before TRITON_INTERPRET=1 was set: the Triton kernels would not run in the interpreter")

ATTENTION = {
    "fp8": (qpa.paged_attention_fp8_ref, qpa.paged_attention_fp8_triton),
    "int4": (qpa.paged_attention_int4_ref, qpa.paged_attention_int4_triton),
}
WRITE = {"fp8": cache_write_fp8_ref, "int4": cache_write_int4_ref}
# Triton vs ref: both dequantize exactly alike; they differ by fp32 summation order, and
# for bf16 q by the kernel's bf16 matmul operands (dequantized K/V and probabilities).
ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def roundtrip(scheme: str, x: torch.Tensor, role: int) -> torch.Tensor:
    """dequantize(quantize(x)) as the cache stores it; ``role`` 0 = keys, 1 = values."""
    if scheme == "fp8":
        return dequantize_fp8(*quantize_fp8(x))
    return dequantize_int4(*quantize_int4(x, int4_group_size(x.shape[-1], INT4_GROUPS[role])))


@dataclasses.dataclass
class QuantBatch:
    scheme: str
    float_batch: Batch  # the same problem over the float cache and the original dense K/V
    cache: tuple  # (k_cache, v_cache, k_scale, v_scale)

    def args(self):
        b = self.float_batch
        return (b.q, *self.cache, b.block_tables, b.seq_lens, b.query_start_loc, b.positions, b.scale)

    def dequantized_batch(self) -> Batch:
        """The float batch with every dense K/V row replaced by its quantization round trip."""
        b = self.float_batch
        return dataclasses.replace(b, dense_k=[roundtrip(self.scheme, k.float(), 0) for k in b.dense_k],
                                   dense_v=[roundtrip(self.scheme, v.float(), 1) for v in b.dense_v])


def quantize_batch(b: Batch, scheme: str, seed: int = 0) -> QuantBatch:
    """Write every sequence's dense K/V through the reference quantized write (shared pages are
    rewritten with identical rows, which quantize identically)."""
    num_blocks, page_size, kv_heads, head_dim = b.k_cache.shape
    cache = get_scheme(scheme).allocate(num_blocks, page_size, kv_heads, head_dim).tensors()
    gen = torch.Generator().manual_seed(seed)
    for t in cache:  # garbage bytes (NaN / inf patterns included) in every unwritten slot
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen, dtype=torch.uint8))
    for s, seq_len in enumerate(b.seq_lens.tolist()):
        j = torch.arange(seq_len)
        slots = b.block_tables[s, j // page_size].long() * page_size + j % page_size
        WRITE[scheme](b.dense_k[s], b.dense_v[s], *cache, slots)
    return QuantBatch(scheme, b, cache)


def error_bound(qb: QuantBatch) -> torch.Tensor:
    """Per (token, head) bound on |attention(quantized K/V) - attention(K/V)|.

    With logits perturbed by at most d (d = max_j |q . dk_j| * scale), every softmax weight
    moves by a factor in [e^-2d, e^2d], so sum_j |dp_j| <= e^2d - 1, and
    |o' - o| <= max_j |dv_j| + max_j |v_j| (e^2d - 1).
    """
    b, deq = qb.float_batch, qb.dequantized_batch()
    num_tokens, num_heads, _ = b.q.shape
    group = num_heads // b.k_cache.shape[2]
    bound = torch.zeros(num_tokens, num_heads, dtype=torch.float64)
    starts = b.query_start_loc.tolist()
    for s in range(len(starts) - 1):
        for i in range(starts[s], starts[s + 1]):
            p = int(b.positions[i])
            for h in range(num_heads):
                kvh = h // group
                k, v = b.dense_k[s][: p + 1, kvh].double(), b.dense_v[s][: p + 1, kvh].double()
                dk, dv = deq.dense_k[s][: p + 1, kvh].double() - k, deq.dense_v[s][: p + 1, kvh].double() - v
                d = (dk @ b.q[i, h].double()).abs().max() * b.scale
                bound[i, h] = dv.abs().max() + v.abs().max() * torch.expm1(2 * d)
    return bound


@settings(max_examples=10, deadline=None)
@given(batches(), st.sampled_from(["fp8", "int4"]))
def test_triton_matches_ref(b, scheme):
    qb = quantize_batch(b, scheme)
    ref, tri = ATTENTION[scheme]
    expected = ref(*qb.args())
    out = tri(*qb.args())
    assert out.dtype == b.q.dtype and out.shape == b.q.shape
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL[b.q.dtype], rtol=RTOL[b.q.dtype])


@settings(max_examples=15, deadline=None)
@given(st.data(), st.sampled_from(["fp8", "int4"]))
def test_triton_with_window_softcap_alibi_matches_ref(data, scheme):
    """The score modifiers (sliding window, soft cap, ALiBi) over quantized caches, fp32 and bf16 q."""
    b = data.draw(batches())
    variant = data.draw(variants(b.q.shape[1]))
    qb = quantize_batch(b, scheme)
    ref, tri = ATTENTION[scheme]
    expected = ref(*qb.args(), *variant.args())
    out = tri(*qb.args(), *variant.args())
    assert out.dtype == b.q.dtype and out.shape == b.q.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL[b.q.dtype], rtol=RTOL[b.q.dtype])


@settings(max_examples=10, deadline=None)
@given(batches(), st.sampled_from(["fp8", "int4"]))
def test_ref_matches_dense_attention_on_dequantized_kv_and_error_bound(b, scheme):
    qb = quantize_batch(b, scheme)
    out = ATTENTION[scheme][0](*qb.args()).double()
    dtype = b.q.dtype
    torch.testing.assert_close(out, naive_dense_attention(qb.dequantized_batch()), atol=ATOL[dtype], rtol=RTOL[dtype])
    err = (out - naive_dense_attention(b)).abs().amax(-1)  # [N, H]
    slack = 1e-5 if dtype == torch.float32 else 2e-2 * (1 + out.abs().amax(-1))  # bf16 output rounding
    assert (err <= error_bound(qb) + slack).all(), float((err - error_bound(qb)).max())


@pytest.mark.parametrize("scheme", ["fp8", "int4"])
@pytest.mark.parametrize("page_size", [8, 16])
def test_mixed_batch_with_shared_blocks(scheme, page_size):
    """Chunked prefill sharing 2 pages with seq 0, a decode sharing 1, an empty sequence; GQA 3."""
    qb = quantize_batch(make_batch(0, page_size, kv_heads=2, group=3, head_dim=32, dtype=torch.float32, seqs=MIXED),
                        scheme)
    ref, tri = ATTENTION[scheme]
    expected = ref(*qb.args())
    torch.testing.assert_close(expected.double(), naive_dense_attention(qb.dequantized_batch()), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(tri(*qb.args()), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme", ["fp8", "int4"])
def test_head_dim_128_and_fp16_query(scheme):
    b = make_batch(1, 32, kv_heads=1, group=4, head_dim=128, dtype=torch.float32, seqs=[(70, 3, 0), (40, 1, 1)])
    qb = quantize_batch(b, scheme)
    ref, tri = ATTENTION[scheme]
    torch.testing.assert_close(tri(*qb.args()), ref(*qb.args()), atol=2e-5, rtol=1e-5)
    qb.float_batch = dataclasses.replace(b, q=b.q.half())
    out = tri(*qb.args())
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, ref(*qb.args()), atol=2e-3, rtol=2e-3)


def test_quantization_error_is_small_in_practice():
    """Typical (not worst-case) relative output error on Gaussian K/V (measured 0.035 / 0.12)."""
    b = make_batch(3, 16, kv_heads=2, group=2, head_dim=64, dtype=torch.float32, seqs=[(90, 20, 0), (60, 1, 0)])
    exact = naive_dense_attention(b)
    rel = {}
    for scheme in ("fp8", "int4"):
        out = ATTENTION[scheme][0](*quantize_batch(b, scheme).args()).double()
        rel[scheme] = float((out - exact).norm() / exact.norm())
    assert rel["fp8"] < 0.05 and rel["int4"] < 0.2 and rel["fp8"] < rel["int4"] / 2, rel


@pytest.mark.parametrize("scheme", ["fp8", "int4"])
def test_ref_dequantizes_only_the_slots_it_reads(scheme, monkeypatch):
    name = f"dequantize_{scheme}"
    real, rows = getattr(qpa, name), []
    monkeypatch.setattr(qpa, name, lambda data, params: rows.append(data.shape[0]) or real(data, params))
    # 40 blocks in the pool; seq 1 (12 tokens) has no queries this step, so nothing of it is read.
    b = make_batch(2, 8, kv_heads=1, group=2, head_dim=32, dtype=torch.float32,
                   seqs=[(20, 2, 0), (12, 0, 0), (9, 1, 0)])
    qb = quantize_batch(b, scheme)
    assert qb.cache[0].shape[0] * 8 >= 40
    ATTENTION[scheme][0](*qb.args())
    # seqs 0 and 2 (2 and 1 queries) are attended as one padded batch: their slots only, each padded
    # to the longer one's 20 keys (K then V); seq 1 and the rest of the pool are never dequantized
    assert rows == [2 * 20, 2 * 20]


@pytest.mark.parametrize("impl", [0, 1], ids=["ref", "triton"])
def test_bad_arguments_raise_value_error(impl):
    fp8 = get_scheme("fp8").allocate(3, 8, 2, 32).tensors()
    int4 = get_scheme("int4").allocate(3, 8, 2, 32).tensors()
    q = torch.randn(2, 4, 32)
    meta = (torch.zeros(1, 2, dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
            torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 1]), 1.0)
    with pytest.raises(ValueError, match="fp8 cache dtype"):
        ATTENTION["fp8"][impl](q, *int4, *meta)
    with pytest.raises(ValueError, match="int4 cache dtype"):
        ATTENTION["int4"][impl](q, *fp8, *meta)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        ATTENTION["fp8"][impl](torch.randn(2, 3, 32), *fp8, *meta)
    with pytest.raises(ValueError, match="head_dim"):
        ATTENTION["int4"][impl](torch.randn(2, 4, 64), *int4, *meta)
    with pytest.raises(ValueError, match="positions"):
        ATTENTION["int4"][impl](q, *int4, *meta[:3], meta[3].float(), 1.0)


def _cpp():
    from specgraph.kernels import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.fail(f"the C++ CPU attention kernel did not build: {cpu_kernels.build_error()}")
    return cpu_kernels


def _float_q(qb: QuantBatch) -> QuantBatch:
    qb.float_batch = dataclasses.replace(qb.float_batch, q=qb.float_batch.q.float())
    return qb


@settings(max_examples=25, deadline=None)
@given(st.data(), st.sampled_from(["fp8", "int4"]), st.booleans())
def test_cpp_kernel_matches_ref(data, scheme, with_variant):
    """The C++ kernel over quantized caches (any query counts, float32 q; garbage in unwritten slots,
    shared pages, GQA, page sizes, head dims), with and without the score modifiers, against the
    torch reference; and the native op compiled graphs call, whichever path it takes."""
    b = data.draw(batches())
    variant = data.draw(variants(b.q.shape[1])).args() if with_variant else ()
    qb = _float_q(quantize_batch(b, scheme))
    expected = ATTENTION[scheme][0](*qb.args(), *variant)
    run, _ = _cpp()._quant_attention(scheme)
    for out in (run(*qb.args(), *variant), getattr(torch.ops.specgraph_cpu, f"paged_attention_{scheme}")(
            *qb.args(), *variant)):
        assert out.dtype == torch.float32 and out.shape == b.q.shape
        torch.testing.assert_close(out, expected, atol=ATOL[torch.float32], rtol=RTOL[torch.float32])


@pytest.mark.parametrize("scheme", ["fp8", "int4"])
def test_cpu_dispatch_runs_the_cpp_kernel_for_float_queries_over_quantized_caches(scheme):
    from specgraph.kernels.registry import select

    _cpp()
    decodes = _float_q(quantize_batch(make_batch(1, 8, kv_heads=2, group=3, head_dim=32, dtype=torch.float32,
                                                 seqs=[(37, 1, 0), (20, 2, 0)]), scheme))
    assert select(f"paged_attention_{scheme}", *decodes.args()).name == "cpp"
    prefill = _float_q(quantize_batch(make_batch(2, 8, kv_heads=2, group=3, head_dim=32, dtype=torch.float32,
                                                 seqs=[(37, 30, 0), (20, 1, 0)]), scheme))
    assert select(f"paged_attention_{scheme}", *prefill.args()).name == "cpp"  # prefill chunks too
    half = quantize_batch(make_batch(3, 8, kv_heads=2, group=3, head_dim=32, dtype=torch.bfloat16,
                                     seqs=[(37, 1, 0)]), scheme)
    assert select(f"paged_attention_{scheme}", *half.args()).name == "reference"  # bf16 q: the torch path
    with pytest.raises(ValueError, match="cache dtype"):  # a malformed cache: the layout check names it
        other = "int4" if scheme == "fp8" else "fp8"
        select(f"paged_attention_{scheme}", decodes.float_batch.q,
               *get_scheme(other).allocate(3, 8, 2, 32).tensors(), *decodes.args()[5:])
