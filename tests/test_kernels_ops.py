"""specgraph:: custom ops: dispatch, fake impls (opcheck) and torch.compile(fullgraph=True)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (conftest does it too)

import dataclasses

import pytest
import torch
from torch._dynamo.testing import AotEagerAndRecordGraphs, EagerAndRecordGraphs

import specgraph.kernels  # noqa: F401  (registers torch.ops.specgraph.*)
import specgraph.kernels.attention_kernel
from specgraph.kernels import registry, triton_kernels_forced, use_triton_kernels
from specgraph.kernels.triton_helpers import is_interpreted

if not is_interpreted(specgraph.kernels.attention_kernel.paged_attention_kernel):
    raise RuntimeError("specgraph.kernels was imported before TRITON_INTERPRET=1 was set: the Triton kernels would not run in the interpreter")

PAGE, KVH, GROUP, D = 8, 2, 2, 32


def make_inputs(seed=0):
    """Two sequences: a 3-token chunk at positions 9..11 and a decode at position 4."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(5, PAGE, KVH, D, generator=gen)
    v_cache = torch.randn(5, PAGE, KVH, D, generator=gen)
    block_tables = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32)
    seq_lens = torch.tensor([12, 5], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 3, 4], dtype=torch.int32)
    positions = torch.tensor([9, 10, 11, 4])
    seq_ids = torch.tensor([0, 0, 0, 1])
    slot_mapping = block_tables[seq_ids, positions // PAGE].long() * PAGE + positions % PAGE
    q = torch.randn(4, KVH * GROUP, D, generator=gen)
    k = torch.randn(4, KVH, D, generator=gen)
    v = torch.randn(4, KVH, D, generator=gen)
    return dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping,
                block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc, positions=positions)


def step(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, positions):
    """One attention layer's cache write + paged attention, as the compiled model calls them."""
    torch.ops.specgraph.cache_write(k, v, k_cache, v_cache, slot_mapping)
    out = torch.ops.specgraph.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                              positions, D**-0.5)
    return out * 2


def test_dispatch_follows_the_registry_rule(monkeypatch):
    """CPU tensors run a CPU implementation unless Triton is forced; every op call goes through
    ``registry.select`` (spies on the registered implementations record which one ran)."""
    calls = []
    for op in ("paged_attention", "cache_write"):
        spied = [dataclasses.replace(i, fn=lambda *a, i=i: calls.append((i.op, i.name)) or i.fn(*a))
                 for i in registry.implementations(op)]
        monkeypatch.setitem(registry._IMPLEMENTATIONS, op, spied)
    x = make_inputs()
    step(**x)
    assert not triton_kernels_forced()
    with use_triton_kernels():
        assert triton_kernels_forced()
        step(**x)
        with use_triton_kernels(False):
            step(**x)
    assert not triton_kernels_forced()
    cpu_names = {"reference", "cpp"}
    assert [op for op, _ in calls] == ["cache_write", "paged_attention"] * 3
    assert calls[0][1] in cpu_names and calls[1][1] in cpu_names
    assert calls[2:4] == [("cache_write", "triton"), ("paged_attention", "triton")]
    assert calls[4][1] in cpu_names and calls[5][1] in cpu_names


def test_registry_lists_implementations_and_names_an_unknown_op():
    with pytest.raises(KeyError, match="no implementation registered for specgraph::no_such_op"):
        registry.select("no_such_op")
    impls = registry.implementations("cache_write")
    assert {i.name for i in impls} == {"reference", "triton", "cpp"} and impls[-1].name == "reference"
    x = make_inputs()
    args = (x["k"], x["v"], x["k_cache"], x["v_cache"], x["slot_mapping"])
    assert registry.select("cache_write", *args).name == "cpp"  # same-dtype rows on CPU
    assert registry.select("cache_write", x["k"].bfloat16(), x["v"].bfloat16(), *args[2:]).name == "reference"


def test_opcheck_fake_impls():
    x = make_inputs()
    torch.library.opcheck(torch.ops.specgraph.cache_write.default,
                          (x["k"], x["v"], x["k_cache"], x["v_cache"], x["slot_mapping"]))
    torch.library.opcheck(torch.ops.specgraph.paged_attention.default,
                          (x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"],
                           x["query_start_loc"], x["positions"], D**-0.5))


def _targets(gm: torch.fx.GraphModule) -> str:
    """Called ops; aot wraps the mutating cache_write as ``auto_functionalized_v2(op, ...)``."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    return " ".join(f"{n.target}({n.args[0]})" if "auto_functionalized" in str(n.target) else str(n.target)
                    for n in calls)


@pytest.mark.parametrize("aot", [False, True], ids=["eager", "aot_eager"])
@pytest.mark.parametrize("force_triton", [False, True], ids=["ref", "triton"])
def test_torch_compile_fullgraph(aot, force_triton):
    torch._dynamo.reset()
    backend = AotEagerAndRecordGraphs() if aot else EagerAndRecordGraphs()
    eager_inputs, compiled_inputs = make_inputs(), make_inputs()
    expected = step(**eager_inputs)
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    with use_triton_kernels(force_triton):
        out = compiled(**compiled_inputs)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    # The mutation reached the caller's cache (aot_eager functionalizes it, then copies back).
    torch.testing.assert_close(compiled_inputs["k_cache"], eager_inputs["k_cache"], atol=0, rtol=0)
    torch.testing.assert_close(compiled_inputs["v_cache"], eager_inputs["v_cache"], atol=0, rtol=0)
    assert not torch.equal(compiled_inputs["k_cache"], make_inputs()["k_cache"])
    # One graph holding both ops (the fake impls let them be traced, not graph-broken).
    graphs = backend.fw_graphs if aot else backend.graphs
    assert len(backend.graphs) == 1 and len(graphs) == 1
    targets = _targets(graphs[0])
    assert "specgraph.paged_attention" in targets and "specgraph.cache_write" in targets, targets
