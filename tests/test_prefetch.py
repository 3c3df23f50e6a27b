"""The C++ linears' prefetch distances (``kernels/prefetch.py``): chosen among the candidates by timing,
set process-wide, and bad distances named. (That a distance changes no result is fuzzed beside each
kernel: ``test_kernels_panel_linear.py``, ``test_quantize_weights.py``.)"""
from __future__ import annotations

import pytest
import torch

from specgraph.kernels import cpu_kernels, prefetch
from specgraph.kernels.quant_linear import quantize_weight


@pytest.fixture
def module():
    module = cpu_kernels.load()
    if module is None:
        pytest.fail(f"the C++ CPU kernels did not build: {cpu_kernels.build_error()}")
    panel, quant = module.set_panel_prefetch(0, 16), module.set_quant_prefetch(2048)
    yield module
    module.set_panel_prefetch(*panel)
    module.set_quant_prefetch(quant)


def test_the_panel_kernel_distances_are_chosen_by_timing_and_set(module):
    (single, multi), line = prefetch.choose_panel_prefetch([torch.randn(200, 64), torch.randn(64, 200)], repeats=1)
    assert single in prefetch.PANEL_DISTANCES and multi in prefetch.PANEL_DISTANCES
    assert module.set_panel_prefetch(0, 0) == [single, multi]  # the choice was set
    assert f"-> {single} ahead for 1 row, {multi} for more" in line and "4 rows" in line and "8 rows" in line
    assert prefetch.choose_panel_prefetch([])[0] == (0, 0)


def test_the_quantized_kernel_distance_is_chosen_by_timing_and_set(module):
    linears = [(*quantize_weight(torch.randn(96, 64), scheme), scheme) for scheme in ("int8", "int4", "fp8")]
    ahead, line = prefetch.choose_quant_prefetch(linears, repeats=1)
    assert ahead in prefetch.QUANT_DISTANCES
    assert module.set_quant_prefetch(2048) == ahead
    assert f"-> {ahead} bytes ahead" in line and "1 row " in line
    assert prefetch.choose_quant_prefetch([])[0] == 2048


def test_bad_distances_are_named(module):
    with pytest.raises(RuntimeError, match="distances must be >= 0"):
        module.set_panel_prefetch(-1, 0)
    with pytest.raises(RuntimeError, match="distance must be >= 0 bytes"):
        module.set_quant_prefetch(-5)
