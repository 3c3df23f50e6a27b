"""Quantized KV cache, part 3: the specgraph:: ops (dispatch, fake impls, torch.compile)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (conftest does it too)

import dataclasses

import pytest
import torch
from torch._dynamo.testing import AotEagerAndRecordGraphs

import specgraph.kernels  # noqa: F401  (registers torch.ops.specgraph.*)
import specgraph.kernels.attention_kernel
from specgraph.kernels import QUANT_SCHEMES, registry, use_triton_kernels
from specgraph.kernels.triton_helpers import is_interpreted

if not is_interpreted(specgraph.kernels.attention_kernel.paged_attention_kernel):
    raise RuntimeError("specgraph.kernels was imported before TRITON_INTERPRET=1 was set: the Triton kernels would not run in the interpreter")

PAGE, KVH, GROUP, D = 8, 2, 2, 64
SCHEMES = sorted(QUANT_SCHEMES)


def make_inputs(scheme: str, seed: int = 0) -> dict:
    """Two sequences (a 3-token chunk at positions 9..11, a decode at 4) over a prefilled cache."""
    gen = torch.Generator().manual_seed(seed)
    cache = QUANT_SCHEMES[scheme].allocate(5, PAGE, KVH, D)
    block_tables = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32)
    history = torch.arange(2 * PAGE)
    for row in block_tables:  # positions 0..15 of both sequences
        slots = row[history // PAGE].long() * PAGE + history % PAGE
        k, v = torch.randn(2, 2 * PAGE, KVH, D, generator=gen)
        QUANT_SCHEMES[scheme].write_op(k, v, *cache.tensors(), slots)
    positions = torch.tensor([9, 10, 11, 4])
    seq_ids = torch.tensor([0, 0, 0, 1])
    return dict(
        q=torch.randn(4, KVH * GROUP, D, generator=gen), k=torch.randn(4, KVH, D, generator=gen),
        v=torch.randn(4, KVH, D, generator=gen), k_cache=cache.k_cache, v_cache=cache.v_cache,
        k_scale=cache.k_scale, v_scale=cache.v_scale,
        slot_mapping=block_tables[seq_ids, positions // PAGE].long() * PAGE + positions % PAGE,
        block_tables=block_tables, seq_lens=torch.tensor([12, 5], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32), positions=positions,
    )


def make_step(scheme: str):
    write, attend = QUANT_SCHEMES[scheme].write_op, QUANT_SCHEMES[scheme].attention_op

    def step(q, k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, block_tables, seq_lens, query_start_loc,
             positions):
        """One attention layer: quantized cache write, then attention over the quantized cache."""
        write(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
        out = attend(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, positions, D**-0.5)
        return out * 2

    return step


@pytest.mark.parametrize("scheme", SCHEMES)
def test_dispatch_cpu_uses_the_cpp_kernels_unless_triton_is_forced(scheme, monkeypatch):
    """On CPU (float32, a decode-sized step) the C++ write and attention take the calls; inside
    ``use_triton_kernels()`` the Triton kernels (in the interpreter)."""
    from specgraph.kernels import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.fail(f"the C++ CPU kernels did not build: {cpu_kernels.build_error()}")
    x = make_inputs(scheme)
    calls = []
    for op in (f"cache_write_{scheme}", f"paged_attention_{scheme}"):
        spied = [dataclasses.replace(i, fn=lambda *a, i=i: calls.append(f"{i.op.split('_')[0]}:{i.name}") or i.fn(*a))
                 for i in registry.implementations(op)]
        monkeypatch.setitem(registry._IMPLEMENTATIONS, op, spied)
    step = make_step(scheme)
    step(**x)
    with use_triton_kernels():
        step(**x)
    assert calls == ["cache:cpp", "paged:cpp", "cache:triton", "paged:triton"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_opcheck_fake_impls(scheme):
    x = make_inputs(scheme)
    cache = (x["k_cache"], x["v_cache"], x["k_scale"], x["v_scale"])
    # test_schema compares tensors with allclose, which has no float8 CPU kernel; int4 runs it
    # on the same signature (and the compile test checks the fp8 mutations end to end).
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    kw = {"test_utils": utils} if scheme == "fp8" else {}
    torch.library.opcheck(QUANT_SCHEMES[scheme].write_op.default, (x["k"], x["v"], *cache, x["slot_mapping"]), **kw)
    torch.library.opcheck(QUANT_SCHEMES[scheme].attention_op.default,
                          (x["q"], *cache, x["block_tables"], x["seq_lens"], x["query_start_loc"], x["positions"],
                           D**-0.5), **kw)


@pytest.mark.parametrize("force_triton", [False, True], ids=["ref", "triton"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_torch_compile_fullgraph_aot(scheme, force_triton):
    torch._dynamo.reset()
    step = make_step(scheme)
    backend = AotEagerAndRecordGraphs()
    eager_inputs, compiled_inputs = make_inputs(scheme), make_inputs(scheme)
    expected = step(**eager_inputs)
    with use_triton_kernels(force_triton):
        out = torch.compile(step, backend=backend, fullgraph=True)(**compiled_inputs)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    # All four mutated tensors reached the caller (functionalized, then copied back), bit for bit.
    fresh = make_inputs(scheme)
    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
        assert torch.equal(compiled_inputs[name].view(torch.uint8), eager_inputs[name].view(torch.uint8)), name
        assert not torch.equal(compiled_inputs[name].view(torch.uint8), fresh[name].view(torch.uint8)), name
    assert len(backend.graphs) == 1 and len(backend.fw_graphs) == 1
    targets = " ".join(str(n.args[0]) if "auto_functionalized" in str(n.target) else str(n.target)
                       for n in backend.fw_graphs[0].graph.nodes if n.op == "call_function")
    assert f"specgraph.cache_write_{scheme}" in targets and f"specgraph.paged_attention_{scheme}" in targets, targets
