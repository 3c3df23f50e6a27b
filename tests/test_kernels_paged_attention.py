"""paged_attention: Triton (interpreter) == torch ref == naive dense attention.

Batches are ragged streams of decodes (1 token at seq_len - 1), chunked prefills
(positions start > 0), full prefills and empty sequences, over random non-contiguous
block tables with blocks shared between sequences (prefix caching); the score modifiers
(sliding window, soft cap, ALiBi) are drawn on top.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (conftest does it too)

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton.runtime.interpreter import InterpretedFunction

from specgraph.kernels.attention_kernel import paged_attention_kernel
from specgraph.kernels.cache_write import cache_write_ref
from specgraph.kernels.paged_attention import paged_attention_ref, paged_attention_triton
from specgraph.kernels.registry import dispatch, select

if not isinstance(paged_attention_kernel, InterpretedFunction):
    raise RuntimeError("specgraph.kernels was imported before TRITON_INTERPRET=1 was set: the Triton kernels would not run in the interpreter")

ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@dataclasses.dataclass
class Batch:
    """One attention problem, both paged (kernel inputs) and dense (for the naive reference)."""

    q: torch.Tensor  # [N, H, D]
    k_cache: torch.Tensor  # [num_blocks, page_size, KVH, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    positions: torch.Tensor  # [N] int64
    scale: float
    dense_k: list  # per sequence [seq_len, KVH, D], cache dtype
    dense_v: list

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.positions, self.scale)


def make_batch(seed, page_size, kv_heads, group, head_dim, dtype, seqs) -> Batch:
    """``seqs``: per sequence ``(seq_len, num_queries, shared_pages)``; the queries are the
    last ``num_queries`` positions and the first ``shared_pages`` pages are seq 0's blocks."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [L for L, _, _ in seqs]
    num_queries = [n for _, n, _ in seqs]
    shared = [sh for _, _, sh in seqs]
    num_seqs = len(seqs)

    # Dense K/V per sequence; a shared prefix is a copy of seq 0's.
    dense_k = [torch.randn(L, kv_heads, head_dim, generator=gen).to(dtype) for L in seq_lens]
    dense_v = [torch.randn(L, kv_heads, head_dim, generator=gen).to(dtype) for L in seq_lens]
    for s in range(1, num_seqs):
        n = shared[s] * page_size
        assert n <= min(seq_lens[0], seq_lens[s])
        dense_k[s][:n] = dense_k[0][:n]
        dense_v[s][:n] = dense_v[0][:n]

    # Random non-contiguous block ids; shared pages reuse seq 0's ids.
    pages = [-(-L // page_size) for L in seq_lens]
    num_blocks = sum(pages) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(pages) + 1
    rows = []
    for s in range(num_seqs):
        row = [rows[0][j] if j < shared[s] else free.pop() for j in range(pages[s])]
        # Pad with garbage ids: the kernels must never read past seq_len.
        row += torch.randint(0, num_blocks, (max_blocks - pages[s],), generator=gen).tolist()
        rows.append(row)
    block_tables = torch.tensor(rows, dtype=torch.int32)

    # Fill the cache through cache_write_ref (shared slots written once: -1 for the copies); every
    # unwritten slot holds NaN, which must never reach an output (0 * NaN = NaN in probs @ V).
    k_cache = torch.full((num_blocks, page_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full((num_blocks, page_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    for s in range(num_seqs):
        j = torch.arange(seq_lens[s])
        slots = block_tables[s, j // page_size].long() * page_size + j % page_size
        slots[: shared[s] * page_size] = -1
        cache_write_ref(dense_k[s], dense_v[s], k_cache, v_cache, slots)

    positions = torch.cat([torch.arange(L - n, L) for L, n in zip(seq_lens, num_queries)]).long()
    query_start_loc = torch.tensor([0] + num_queries).cumsum(0).to(torch.int32)
    q = torch.randn(sum(num_queries), kv_heads * group, head_dim, generator=gen).to(dtype)
    return Batch(q, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32),
                 query_start_loc, positions, head_dim**-0.5, dense_k, dense_v)


@st.composite
def batches(draw, head_dims=st.sampled_from([32, 64]), max_tokens=40, max_context=96,
            groups=st.sampled_from([1, 2, 3, 4])):
    page_size = draw(st.sampled_from([8, 16, 32]))
    seqs, budget = [], max_tokens
    for s in range(draw(st.integers(1, 3))):
        seq_len = draw(st.integers(1, max_context))
        kind = draw(st.sampled_from(["decode", "chunk", "prefill", "empty"]))
        n = {"decode": 1, "chunk": draw(st.integers(1, seq_len)), "prefill": seq_len, "empty": 0}[kind]
        n = min(n, budget)
        budget -= n
        shared = 0 if s == 0 else draw(st.integers(0, min(seqs[0][0], seq_len) // page_size))
        seqs.append((seq_len, n, shared))
    return make_batch(
        seed=draw(st.integers(0, 2**31 - 1)),
        page_size=page_size,
        kv_heads=draw(st.integers(1, 2)),
        group=draw(groups),
        head_dim=draw(head_dims),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        seqs=seqs,
    )


@dataclasses.dataclass(frozen=True)
class Variant:
    """The score modifiers every attention kernel takes (``paged_attention.py``, "variant")."""

    window: int = 0
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None

    def args(self):
        return (self.window, self.softcap, self.alibi_slopes)


@st.composite
def variants(draw, num_heads: int):
    """A sliding window (any width, 1 included), a soft cap, ALiBi slopes, each on or off."""
    slopes = None
    if draw(st.booleans()):
        slopes = torch.tensor([2.0 ** -(8 * (h + 1) / num_heads) for h in range(num_heads)])
    return Variant(window=draw(st.sampled_from([0, 0, 1, 3, 8, 17, 40])),
                   softcap=draw(st.sampled_from([0.0, 0.0, 0.5, 30.0])), alibi_slopes=slopes)


def naive_dense_attention(b: Batch, variant: Variant = Variant()) -> torch.Tensor:
    """Per token, per head, float64 softmax over contiguous keys 0..position (the variant's keys and
    scores: ``window``, ``softcap``, ``alibi_slopes``)."""
    num_tokens, num_heads, _ = b.q.shape
    group = num_heads // b.k_cache.shape[2]
    out = torch.zeros(b.q.shape, dtype=torch.float64)
    starts = b.query_start_loc.tolist()
    for s in range(len(starts) - 1):
        for i in range(starts[s], starts[s + 1]):
            p = int(b.positions[i])
            first = max(0, p - variant.window + 1) if variant.window else 0
            for h in range(num_heads):
                k = b.dense_k[s][first: p + 1, h // group].double()
                v = b.dense_v[s][first: p + 1, h // group].double()
                scores = k @ b.q[i, h].double() * b.scale
                if variant.softcap:
                    scores = variant.softcap * torch.tanh(scores / variant.softcap)
                if variant.alibi_slopes is not None:
                    scores = scores + float(variant.alibi_slopes[h]) * torch.arange(first - p, 1).double()
                out[i, h] = torch.softmax(scores, dim=0) @ v
    return out


@settings(max_examples=15, deadline=None)
@given(batches())
def test_ref_matches_naive_dense(b):
    out = paged_attention_ref(*b.args())
    assert out.dtype == b.q.dtype and out.shape == b.q.shape
    dtype = b.q.dtype
    torch.testing.assert_close(out.double(), naive_dense_attention(b), atol=ATOL[dtype], rtol=RTOL[dtype])


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_ref_with_window_softcap_alibi_matches_naive_dense(data):
    b = data.draw(batches())
    variant = data.draw(variants(b.q.shape[1]))
    out = paged_attention_ref(*b.args(), *variant.args())
    dtype = b.q.dtype
    torch.testing.assert_close(out.double(), naive_dense_attention(b, variant), atol=ATOL[dtype], rtol=RTOL[dtype])


@settings(max_examples=15, deadline=None)
@given(batches())
def test_triton_matches_ref(b):
    expected = paged_attention_ref(*b.args())
    out = paged_attention_triton(*b.args())
    assert out.dtype == b.q.dtype and out.shape == b.q.shape
    dtype = b.q.dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL[dtype], rtol=RTOL[dtype])


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_triton_with_window_softcap_alibi_matches_ref(data):
    """Every combination of the score modifiers, fp32 and bf16 caches (windows of 1 key and wider
    than the context included)."""
    b = data.draw(batches())
    variant = data.draw(variants(b.q.shape[1]))
    expected = paged_attention_ref(*b.args(), *variant.args())
    out = paged_attention_triton(*b.args(), *variant.args())
    assert out.dtype == b.q.dtype and out.shape == b.q.shape
    dtype = b.q.dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL[dtype], rtol=RTOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_window_past_the_first_key_tiles(dtype):
    """Long sequences, where a window skips whole 64-key tiles (its keys start at any offset), with
    the cap and ALiBi; against the float64 dense loop too."""
    b = make_batch(2, 16, kv_heads=1, group=2, head_dim=32, dtype=dtype, seqs=[(150, 6, 0), (140, 1, 0)])
    for variant in (Variant(window=20), Variant(window=64, softcap=5.0),
                    Variant(window=75, alibi_slopes=torch.tensor([0.25, 0.0625]))):
        expected = paged_attention_ref(*b.args(), *variant.args())
        torch.testing.assert_close(paged_attention_triton(*b.args(), *variant.args()).float(), expected.float(),
                                   atol=ATOL[dtype], rtol=RTOL[dtype])
        torch.testing.assert_close(expected.double(), naive_dense_attention(b, variant), atol=ATOL[dtype],
                                   rtol=RTOL[dtype])


def test_triton_token_without_visible_keys_gets_zeros():
    """A position past seq_len (bad input) whose window lies beyond the cached keys: no tile runs,
    output 0 rather than NaN."""
    b = make_batch(3, 8, kv_heads=1, group=1, head_dim=32, dtype=torch.float32, seqs=[(66, 1, 0)])
    b.positions[0] = 100  # window 31: keys 70..100, all past seq_len 66
    out = paged_attention_triton(*b.args(), 31)
    assert torch.equal(out, torch.zeros_like(out))


# Fixed batches so that every run covers each feature, whatever hypothesis draws:
# a chunked prefill sharing 2 pages with seq 0, a decode sharing 1, an empty sequence.
MIXED = [(37, 5, 0), (45, 12, 2), (50, 1, 1), (20, 0, 0)]


@pytest.mark.parametrize("page_size", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_with_shared_blocks(page_size, dtype):
    b = make_batch(0, page_size, kv_heads=2, group=3, head_dim=32, dtype=dtype, seqs=MIXED)
    expected = paged_attention_ref(*b.args())
    torch.testing.assert_close(expected.double(), naive_dense_attention(b), atol=ATOL[dtype], rtol=RTOL[dtype])
    torch.testing.assert_close(paged_attention_triton(*b.args()).float(), expected.float(),
                               atol=ATOL[dtype], rtol=RTOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dim_128(dtype):
    b = make_batch(1, 32, kv_heads=1, group=4, head_dim=128, dtype=dtype, seqs=[(70, 3, 0), (40, 1, 1)])
    torch.testing.assert_close(paged_attention_triton(*b.args()).float(), paged_attention_ref(*b.args()).float(),
                               atol=ATOL[dtype], rtol=RTOL[dtype])


def test_odd_head_dim_and_fp16_query_on_fp32_cache():
    """head_dim 40 (BLOCK_D padding) and q.dtype != cache dtype: output follows q.dtype."""
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(6, 8, 2, 40, generator=gen)
    v_cache = torch.randn(6, 8, 2, 40, generator=gen)
    block_tables = torch.tensor([[4, 1, 5], [2, 0, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([19, 7], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 3, 4], dtype=torch.int32)
    positions = torch.tensor([16, 17, 18, 6])
    q = torch.randn(4, 6, 40, generator=gen).half()
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, 40**-0.5)
    out = paged_attention_triton(*args)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, paged_attention_ref(*args), atol=2e-3, rtol=2e-3)


def test_scale_is_applied():
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(2, 16, 1, 32, generator=gen)
    v_cache = torch.randn(2, 16, 1, 32, generator=gen)
    args = (torch.randn(1, 2, 32, generator=gen), k_cache, v_cache, torch.tensor([[1, 0]], dtype=torch.int32),
            torch.tensor([20], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), torch.tensor([19]))
    for scale in (0.05, 1.0):
        torch.testing.assert_close(paged_attention_triton(*args, scale), paged_attention_ref(*args, scale),
                                   atol=2e-5, rtol=1e-5)
    assert not torch.allclose(paged_attention_ref(*args, 0.05), paged_attention_ref(*args, 1.0))


@pytest.mark.parametrize("impl", [paged_attention_ref, paged_attention_triton])
def test_bad_arguments_raise_value_error(impl):
    q = torch.randn(2, 4, 32)
    cache = torch.zeros(3, 8, 3, 32)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.tensor([2], dtype=torch.int32)
    qsl = torch.tensor([0, 2], dtype=torch.int32)
    pos = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        impl(q, cache, cache, tables, lens, qsl, pos, 1.0)
    cache = torch.zeros(3, 8, 2, 32)
    with pytest.raises(ValueError, match="query_start_loc"):
        impl(q, cache, cache, tables, lens, qsl[:1], pos, 1.0)
    with pytest.raises(ValueError, match="cache dtype"):
        impl(q, cache.double(), cache.double(), tables, lens, qsl, pos, 1.0)
    with pytest.raises(ValueError, match="positions"):
        impl(q, cache, cache, tables, lens, qsl, pos.float(), 1.0)


def test_attention_plan_is_built_once_per_step():
    """Every layer of a step passes the same metadata tensors: the plan is reused; new tensors
    (the next step) or an in-place change of one rebuild it."""
    from specgraph.kernels import attention_plan as ap

    tables = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32)
    lens = torch.tensor([12, 5], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    pos = torch.tensor([11, 4])
    first = ap.plan_for(tables, lens, qsl, pos, 8, 2)
    assert ap.plan_for(tables, lens, qsl, pos, 8, 2) is first
    assert ap.plan_for(tables.clone(), lens, qsl, pos, 8, 2) is not first
    again = ap.plan_for(tables, lens, qsl, pos, 8, 2)
    tables[0, 1] = 4
    rebuilt = ap.plan_for(tables, lens, qsl, pos, 8, 2)
    assert rebuilt is not again
    (grp,) = rebuilt  # two decodes share one padded group: 12 keys each, seq 1's last 7 are padding,
    # read from its first slot (16) and masked
    assert grp.slots.tolist()[:12] == [24 + i for i in range(8)] + [32, 33, 34, 35]
    assert grp.slots.tolist()[12:] == [16, 17, 18, 19, 20] + [16] * 7
    assert grp.mask is not None and grp.mask[1, 0, :, 5:].any().item() is False


def _cpp():
    from specgraph.kernels import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.fail(f"the C++ CPU attention kernel did not build: {cpu_kernels.build_error()}")
    return cpu_kernels


@settings(max_examples=25, deadline=None)
@given(batches(head_dims=st.sampled_from([32, 48, 64, 128]), groups=st.sampled_from([1, 3, 5, 8])))
def test_cpp_cpu_kernel_matches_ref(b):
    """The C++ kernel (any query counts, float32) against the torch reference; head sizes and GQA groups
    that take each of its paths (heads of a kv head in one or several passes over the V rows, and the
    per-head loop for other head sizes)."""
    b = dataclasses.replace(b, q=b.q.float(), k_cache=b.k_cache.float(), v_cache=b.v_cache.float())
    expected = paged_attention_ref(*b.args())
    out = _cpp().paged_attention_short_cpp(*b.args())
    assert out.dtype == torch.float32 and out.shape == b.q.shape
    torch.testing.assert_close(out, expected, atol=ATOL[torch.float32], rtol=RTOL[torch.float32])


def test_cpu_dispatch_runs_every_float32_step_in_the_cpp_kernel():
    """Decodes, verifies and prefill chunks at any context: the C++ kernel (it was measured as fast as
    the torch path or faster at every size, and one kernel for every step keeps a token's attention
    the same whichever step computes it); bfloat16 runs the torch path."""
    _cpp()

    def check(batch, expected: str, why: str) -> None:
        assert select("paged_attention", *batch.args()).name == expected, why
        torch.testing.assert_close(dispatch("paged_attention", *batch.args()), paged_attention_ref(*batch.args()))

    check(make_batch(1, 8, kv_heads=2, group=3, head_dim=32, dtype=torch.float32, seqs=[(37, 1, 0), (20, 3, 0)]),
          "cpp", "decodes and short verifies")
    check(make_batch(2, 8, kv_heads=2, group=3, head_dim=32, dtype=torch.float32, seqs=[(37, 30, 0), (20, 1, 0)]),
          "cpp", "a prefill chunk beside a decode")
    check(make_batch(4, 16, kv_heads=1, group=2, head_dim=32, dtype=torch.float32, seqs=[(1100, 8, 0)]),
          "cpp", "8 queries over 1,100 keys")
    check(make_batch(5, 16, kv_heads=1, group=2, head_dim=32, dtype=torch.bfloat16, seqs=[(40, 2, 0)]),
          "reference", "bfloat16: the torch path")


@pytest.mark.parametrize("case", ["decodes", "prefill", "bf16"])
def test_native_op_runs_the_cpp_kernel_or_falls_back_to_the_registry(case):
    """``torch.ops.specgraph_cpu.paged_attention`` (what compiled CPU graphs call) equals the reference
    whether it runs the C++ kernel (float32: decodes, prefill chunks) or hands the call to
    ``specgraph::paged_attention`` (bfloat16)."""
    _cpp()
    seqs = {"decodes": [(37, 1, 0), (20, 2, 0)], "prefill": [(37, 30, 0), (20, 1, 0)], "bf16": [(37, 1, 0)]}[case]
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    b = make_batch(6, 8, kv_heads=2, group=3, head_dim=32, dtype=dtype, seqs=seqs)
    got = torch.ops.specgraph_cpu.paged_attention(*b.args())
    torch.testing.assert_close(got, paged_attention_ref(*b.args()), atol=ATOL[dtype], rtol=RTOL[dtype])
    assert select("paged_attention", *b.args()).name == ("reference" if case == "bf16" else "cpp")



def test_cpp_cpu_kernel_rejects_a_block_outside_the_cache():
    cpu = _cpp()
    b = make_batch(3, 8, kv_heads=1, group=2, head_dim=32, dtype=torch.float32, seqs=[(20, 1, 0)])
    tables = b.block_tables.clone()
    tables[0, 1] = b.k_cache.shape[0] + 5
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu.paged_attention_short_cpp(b.q, b.k_cache, b.v_cache, tables, *b.args()[4:])
