"""The batch-invariant CPU linear (``kernels/panel_linear.py``): values against the torch reference, and
each row bitwise independent of the others (row count, tiling, threads), fuzzed with hypothesis."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specgraph.kernels import prefetch
from specgraph.kernels.panel_linear import pack_panels_ref, packed, panel_linear_ref


def _ops():
    from specgraph.kernels import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.fail(f"the C++ CPU kernels did not build: {cpu_kernels.build_error()}")
    return torch.ops.specgraph_cpu


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_panel_linear_matches_the_reference_and_each_row_is_independent_of_the_others(data):
    ops = _ops()
    n = data.draw(st.integers(1, 200), label="n")
    k = data.draw(st.integers(1, 160), label="k")
    m = data.draw(st.integers(1, 150), label="m")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if data.draw(st.booleans(), label="bias") else None
    panels = ops.pack_panels(w)
    assert torch.equal(panels, pack_panels_ref(w))
    threads = data.draw(st.sampled_from([1, 2, 3]), label="threads")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = ops.panel_linear(x, panels, bias, n)
        torch.testing.assert_close(y, panel_linear_ref(x, panels, bias, n), atol=2e-5 * k ** 0.5, rtol=1e-5)
        # any subset of the rows, in any order, alone or beside others: bitwise the same rows
        rows = data.draw(st.lists(st.integers(0, m - 1), min_size=1, max_size=min(m, 20)), label="rows")
        assert torch.equal(ops.panel_linear(x[rows], panels, bias, n), y[rows])
        assert torch.equal(ops.panel_linear(x[rows[0]], panels, bias, n), y[rows[0]])  # a 1-d input: one row
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(ops.panel_linear(x, panels, bias, n), y)
        # prefetching (any distance, past the panel's end included) changes no bit
        ahead = data.draw(st.sampled_from([0, 1, 8, 16, 32, 500]), label="ahead")
        with prefetch.distances(panel=(ahead, ahead, ahead)):
            assert torch.equal(ops.panel_linear(x, panels, bias, n), y)
            assert torch.equal(ops.panel_linear(x[rows[:1]], panels, bias, n), y[rows[:1]])
    finally:
        torch.set_num_threads(before)


def test_panel_linear_keeps_leading_dims_and_empty_inputs():
    ops = _ops()
    w, x = torch.randn(70, 9), torch.randn(2, 3, 9)
    y = ops.panel_linear(x, ops.pack_panels(w), None, 70)
    assert y.shape == (2, 3, 70)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w))
    assert ops.panel_linear(torch.randn(0, 9), ops.pack_panels(w), None, 70).shape == (0, 70)


def test_bad_panel_linear_inputs_are_named():
    ops = _ops()
    w = torch.randn(70, 9)
    panels = ops.pack_panels(w)
    for args, match in (((torch.randn(3, 8), panels, None, 70), "panel_linear"),  # K differs
                        ((torch.randn(3, 9).double(), panels, None, 70), "float32"),
                        ((torch.randn(3, 9), panels, None, 200), "panel_linear"),  # n does not fit the panels
                        ((torch.randn(3, 9), panels, torch.randn(69), 70), "bias")):
        with pytest.raises(RuntimeError, match=match):
            ops.panel_linear(*args)
    with pytest.raises(RuntimeError, match="float32 weight"):
        ops.pack_panels(w.half())


def test_a_weight_is_packed_once_per_process():
    _ops()
    w = torch.randn(70, 9)
    assert packed(w) is packed(w)
    assert torch.equal(packed(w), pack_panels_ref(w))
    assert packed(torch.randn(70, 9)) is not packed(w)
