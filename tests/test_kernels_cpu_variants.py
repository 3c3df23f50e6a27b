"""The C++ CPU attention kernel with the attention variants (sliding window, soft cap, ALiBi slopes).

``paged_attention_short`` and the native op ``specgraph_cpu::paged_attention`` against the torch
reference ``paged_attention_ref`` (itself fuzzed against a float64 dense loop in
``test_kernels_paged_attention.py``), the registry picking the C++ kernel for variant calls, and a
windowed decode over a long context that must read only its window's pages.
"""
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernels_paged_attention import (
    ATOL,
    RTOL,
    Batch,
    Variant,
    batches,
    make_batch,
    naive_dense_attention,
    variants,
)

from specgraph.kernels.paged_attention import paged_attention_ref
from specgraph.kernels.registry import dispatch, select

F32 = dict(atol=ATOL[torch.float32], rtol=RTOL[torch.float32])


def _cpp():
    from specgraph.kernels import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.fail(f"the C++ CPU attention kernel did not build: {cpu_kernels.build_error()}")
    return cpu_kernels


def _float32(b: Batch) -> Batch:
    return dataclasses.replace(b, q=b.q.float(), k_cache=b.k_cache.float(), v_cache=b.v_cache.float(),
                               dense_k=[k.float() for k in b.dense_k], dense_v=[v.float() for v in b.dense_v])


def _slopes(num_heads: int) -> torch.Tensor:
    return torch.tensor([2.0 ** -(8 * (h + 1) / num_heads) for h in range(num_heads)])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_cpp_kernel_with_a_variant_matches_ref(data):
    """Any stream (decodes, chunks, prefills, empty sequences, shared pages), any window (1 included),
    soft cap and ALiBi slopes, each on or off."""
    b = _float32(data.draw(batches()))
    variant = data.draw(variants(b.q.shape[1]))
    expected = paged_attention_ref(*b.args(), *variant.args())
    out = _cpp().paged_attention_short_cpp(*b.args(), *variant.args())
    assert out.dtype == torch.float32 and out.shape == b.q.shape
    torch.testing.assert_close(out, expected, **F32)


VARIANTS = {
    "window": lambda h: Variant(window=5),
    "window1": lambda h: Variant(window=1),
    "softcap": lambda h: Variant(softcap=0.5),
    "alibi": lambda h: Variant(alibi_slopes=_slopes(h)),
    "all": lambda h: Variant(window=9, softcap=30.0, alibi_slopes=_slopes(h)),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_cpp_kernel_with_a_variant_matches_the_dense_loop(name):
    """Each modifier alone and all together on a fixed mixed stream, against the float64 loop."""
    b = make_batch(0, 8, kv_heads=2, group=3, head_dim=32, dtype=torch.float32,
                   seqs=[(37, 5, 0), (45, 12, 2), (50, 1, 1), (20, 0, 0)])
    variant = VARIANTS[name](b.q.shape[1])
    out = _cpp().paged_attention_short_cpp(*b.args(), *variant.args())
    torch.testing.assert_close(out.double(), naive_dense_attention(b, variant), **F32)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_native_op_runs_a_variant_in_the_cpp_kernel(name):
    """``torch.ops.specgraph_cpu.paged_attention`` with a variant: decodes, a 2-token verify and a
    prefill chunk run the C++ kernel (the registry picks "cpp" too), equal to the reference."""
    _cpp()
    decodes = make_batch(6, 8, kv_heads=2, group=3, head_dim=32, dtype=torch.float32,
                         seqs=[(37, 1, 0), (20, 2, 0), (9, 1, 0)])
    prefill = make_batch(7, 8, kv_heads=2, group=3, head_dim=32, dtype=torch.float32,
                         seqs=[(37, 30, 0), (20, 1, 0)])
    for b, impl in ((decodes, "cpp"), (prefill, "cpp")):
        variant = VARIANTS[name](b.q.shape[1])
        expected = paged_attention_ref(*b.args(), *variant.args())
        got = torch.ops.specgraph_cpu.paged_attention(*b.args(), *variant.args())
        torch.testing.assert_close(got, expected, **F32)
        assert select("paged_attention", *b.args(), *variant.args()).name == impl
        torch.testing.assert_close(dispatch("paged_attention", *b.args(), *variant.args()), expected, **F32)
        torch.testing.assert_close(torch.ops.specgraph.paged_attention(*b.args(), *variant.args()), expected, **F32)


def test_native_op_converts_slopes_of_another_float_dtype():
    _cpp()
    b = make_batch(8, 16, kv_heads=1, group=4, head_dim=64, dtype=torch.float32, seqs=[(70, 1, 0), (33, 1, 0)])
    slopes = _slopes(b.q.shape[1])
    expected = paged_attention_ref(*b.args(), 0, 0.0, slopes)
    torch.testing.assert_close(torch.ops.specgraph_cpu.paged_attention(*b.args(), 0, 0.0, slopes.double()),
                               expected, **F32)
    torch.testing.assert_close(_cpp().paged_attention_short_cpp(*b.args(), 0, 0.0, slopes.double()), expected, **F32)


@pytest.mark.parametrize("softcap, alibi", [(0.0, False), (30.0, True)])
def test_windowed_decodes_over_a_long_context_read_only_the_window(softcap, alibi):
    """Decodes (and a 2-token verify) at ~2,000 keys with a 16-key window: equal to the reference,
    and the kernel never touches the pages before the window: block-table entries there that point
    outside the cache (which the kernel rejects wherever it reads) change nothing."""
    cpu = _cpp()
    page = 16
    b = make_batch(9, page, kv_heads=2, group=3, head_dim=32, dtype=torch.float32,
                   seqs=[(2000, 1, 0), (1999, 1, 0), (1500, 2, 0)])
    variant = Variant(window=16, softcap=softcap, alibi_slopes=_slopes(b.q.shape[1]) if alibi else None)
    expected = paged_attention_ref(*b.args(), *variant.args())
    torch.testing.assert_close(cpu.paged_attention_short_cpp(*b.args(), *variant.args()), expected, **F32)
    torch.testing.assert_close(torch.ops.specgraph_cpu.paged_attention(*b.args(), *variant.args()), expected, **F32)
    assert select("paged_attention", *b.args(), *variant.args()).name == "cpp"

    # the lowest key any token of sequence s sees is positions.min() - window + 1
    tables = b.block_tables.clone()
    starts = b.query_start_loc.tolist()
    for s in range(len(starts) - 1):
        first_key = int(b.positions[starts[s]:starts[s + 1]].min()) - variant.window + 1
        tables[s, : first_key // page] = b.k_cache.shape[0] + 5
    assert (tables[:, :90] != b.block_tables[:, :90]).all()
    out = cpu.paged_attention_short_cpp(b.q, b.k_cache, b.v_cache, tables, *b.args()[4:], *variant.args())
    torch.testing.assert_close(out, expected, **F32)
    # without the window the kernel reads those pages, and says so
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu.paged_attention_short_cpp(b.q, b.k_cache, b.v_cache, tables, *b.args()[4:])


def test_window_wider_than_the_context_is_the_plain_attention():
    cpu = _cpp()
    b = make_batch(10, 8, kv_heads=2, group=2, head_dim=32, dtype=torch.float32, seqs=[(30, 3, 0), (12, 1, 0)])
    torch.testing.assert_close(cpu.paged_attention_short_cpp(*b.args(), 31, 0.0, None),
                               cpu.paged_attention_short_cpp(*b.args()), atol=0, rtol=0)


def test_an_invalid_variant_raises_value_error():
    """The registry's test validates the variant (``check_variant``); the native op hands an invalid
    one to the dispatcher, which says why."""
    _cpp()
    b = make_batch(11, 8, kv_heads=2, group=3, head_dim=32, dtype=torch.float32, seqs=[(20, 1, 0)])
    for bad, match in (((-1, 0.0, None), "window"), ((0, -2.0, None), "softcap"),
                       ((0, 0.0, torch.ones(5)), "alibi_slopes")):
        with pytest.raises(ValueError, match=match):
            select("paged_attention", *b.args(), *bad)
        with pytest.raises(ValueError, match=match):
            torch.ops.specgraph_cpu.paged_attention(*b.args(), *bad)


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_a_tokens_attention_is_bitwise_the_same_in_any_step(data):
    """Batch invariance: a token's output row is bitwise the same whether it is a decode on its own, one
    row of a verify or of a prefill chunk, beside other sequences or not, on 1, 2 or 4 threads (few work
    items split their keys by chunk, or a long step's its query heads, over threads, which changes no row's
    arithmetic), and equals the reference; with a window, soft cap or ALiBi too."""
    threads = data.draw(st.sampled_from([1, 2, 4]))
    kv_heads, group = data.draw(st.sampled_from([(1, 3), (1, 8), (3, 3), (2, 4)]))
    lens = data.draw(st.lists(st.integers(1, 700), min_size=1, max_size=3))
    seqs = [(n, data.draw(st.integers(1, min(n, 40))), 0) for n in lens]  # (over 16 tokens: another split)
    b = _float32(make_batch(data.draw(st.integers(0, 2**31 - 1)), data.draw(st.sampled_from([8, 16])),
                            kv_heads=kv_heads, group=group, head_dim=data.draw(st.sampled_from([32, 64, 128])),
                            dtype=torch.float32, seqs=seqs))
    variant = data.draw(st.sampled_from([Variant(), Variant(window=24), Variant(softcap=30.0),
                                         Variant(alibi_slopes=_slopes(b.q.shape[1]))]))
    run = _cpp().paged_attention_short_cpp
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = run(*b.args(), *variant.args())
        torch.testing.assert_close(out, paged_attention_ref(*b.args(), *variant.args()), **F32)
        starts = b.query_start_loc.tolist()
        for s in range(len(seqs)):
            for i in range(starts[s], starts[s + 1]):  # token i alone: a decode at its position
                p = int(b.positions[i])
                alone = run(b.q[i:i + 1], b.k_cache, b.v_cache, b.block_tables[s:s + 1],
                            torch.tensor([p + 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                            b.positions[i:i + 1], *b.args()[7:], *variant.args())
                assert torch.equal(alone[0], out[i]), (s, i, (alone[0] - out[i]).abs().max())
    finally:
        torch.set_num_threads(before)
