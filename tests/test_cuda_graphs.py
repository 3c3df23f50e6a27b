"""CUDA-graph replay of the bucket steps (compiler/cuda_graphs.py): outputs equal the launched kernels'.

These need a GPU: CI has none, so here they are skipped, and ``benchmarks/gpu_check.py`` runs them
on a CUDA machine (its first section). On CPU the option is inert (last test).
"""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import specgraph
from specgraph.compiler.cuda_graphs import GraphedStep

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_check.py)")


def _tiny(device):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False)
    return LlamaForCausalLM(cfg).eval().to(device)


@cuda
def test_graphed_step_replays_new_inputs_and_writes_the_cache_in_place():
    def step(x, cache, slot):  # writes the cache where `slot` says, returns something of x and the cache
        cache.index_copy_(0, slot, x[:1])
        return (x * 2 + cache.sum(0),)

    dev = torch.device("cuda")
    cache = torch.zeros(4, 3, device=dev)
    graphed = GraphedStep(step, [False, True, False], torch.cuda.graph_pool_handle())
    want_cache = cache.clone()
    for i in range(4):
        x, slot = torch.randn(2, 3, device=dev), torch.tensor([i], device=dev)
        out = graphed(x, cache, slot)[0]
        want = step(x, want_cache, slot)[0]
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(cache, want_cache)
    assert graphed.captures == 1  # the first call ran eagerly, the second captured, the rest replayed
    other = torch.zeros(4, 3, device=dev)  # another cache tensor: captured again, never the freed one written
    graphed(torch.ones(2, 3, device=dev), other, torch.tensor([0], device=dev))
    assert graphed.captures == 2 and other[0].eq(1).all()


@cuda
def test_a_replay_returns_copies_except_of_the_inputs_it_writes_in_place():
    def step(x, cache):
        cache.add_(1)
        return x * 2, cache

    dev = torch.device("cuda")
    cache = torch.zeros(3, device=dev)
    graphed = GraphedStep(step, [False, True])
    outs = [graphed(torch.full((2,), float(i), device=dev), cache) for i in range(4)]
    assert [o[0].tolist() for o in outs] == [[0.0, 0.0], [2.0, 2.0], [4.0, 4.0], [6.0, 6.0]]  # not overwritten
    assert outs[-1][1] is cache and cache.tolist() == [4.0, 4.0, 4.0]


@cuda
def test_engine_with_cuda_graphs_equals_the_eager_lowering_as_batches_change():
    model = _tiny("cuda")
    graphed = specgraph.Engine(model, lowering="inductor", page_size=8, num_blocks=64)
    eager = specgraph.Engine(model, lowering="eager", page_size=8, num_blocks=64)
    assert graphed.stats["cuda_graph_captures"] == len(graphed.program.buckets) > 0
    prompts = [[1, 5, 9, 3, 7], [2, 4, 6, 8, 10, 12, 14], [3] * 20]
    for batch in (prompts[:1], prompts, prompts[1:]):  # decodes of 1, 3 and 2 sequences: one bucket each
        got = [r.token_ids for r in graphed.generate(batch, max_new_tokens=12, ignore_eos=True)]
        want = [r.token_ids for r in eager.generate(batch, max_new_tokens=12, ignore_eos=True)]
        assert got == want
    assert graphed.stats["recompiles"] == 0
    assert graphed.stats["cuda_graph_captures"] == len(graphed.program.buckets)  # replays only


@cuda
def test_speculative_verify_through_cuda_graphs_equals_plain_decoding():
    model = _tiny("cuda")
    spec = specgraph.Engine(model, lowering="inductor", page_size=8, num_blocks=64, draft="ngram",
                            num_draft_tokens=3, adaptive=False)
    plain = specgraph.Engine(model, lowering="eager", page_size=8, num_blocks=64)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2, 3], [7, 8, 7, 8, 7, 8]]
    got = [r.token_ids for r in spec.generate(prompts, max_new_tokens=16, ignore_eos=True)]
    want = [r.token_ids for r in plain.generate(prompts, max_new_tokens=16, ignore_eos=True)]
    assert got == want and spec.stats["recompiles"] == 0


def test_cuda_graphs_are_off_where_there_is_no_cuda():
    """On CPU the bucket steps stay plain compiled code (wrapping them would call into CUDA and fail)."""
    model = _tiny("cpu")
    engine = specgraph.Engine(model, lowering="inductor", page_size=8, num_blocks=16)
    got = [r.token_ids for r in engine.generate([[1, 5, 9, 3]], max_new_tokens=4, ignore_eos=True)]
    want = [r.token_ids for r in specgraph.Engine(model, lowering="eager", page_size=8, num_blocks=16)
            .generate([[1, 5, 9, 3]], max_new_tokens=4, ignore_eos=True)]
    assert got == want and engine.stats["cuda_graph_captures"] == 0 and engine.stats["recompiles"] == 0
    with pytest.raises(ValueError, match="takes 2 inputs"):
        GraphedStep(lambda a, b: a, [False, True])(torch.zeros(1))


def test_a_capture_that_fails_falls_back_to_launching_the_kernels(monkeypatch):
    calls = []

    def step(x, cache):
        calls.append(x)
        return (x + cache,)

    graphed = GraphedStep(step, [False, True])

    def refuse(inputs):
        raise RuntimeError("operation not permitted when stream is capturing\n(details)")

    monkeypatch.setattr(graphed, "_capture", refuse)
    x, cache = torch.ones(2), torch.full((2,), 3.0)
    assert graphed(x, cache)[0].tolist() == [4.0, 4.0]  # the first call runs eagerly
    with pytest.warns(UserWarning, match="launched one by one instead"):
        assert graphed(x, cache)[0].tolist() == [4.0, 4.0]  # the capture fails: the same answer, eagerly
    assert graphed(2 * x, cache)[0].tolist() == [5.0, 5.0] and len(calls) == 3
    assert graphed.captures == 0 and graphed.failure.endswith("when stream is capturing")
