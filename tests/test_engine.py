"""Engine: greedy equals the uncached argmax loop, batching, prefix caching, pool exhaustion, score."""
import pytest
import torch

import specgraph
from models import FAMILIES, make_family, uncached_greedy
from models import random_prompts as _prompts


def _logits(out):
    return getattr(out, "logits", out)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_uncached_loop_and_batch_equals_alone(family):
    model = make_family(family)
    engine = specgraph.Engine(model, num_blocks=48, page_size=8, max_tokens_per_step=24)  # chunked prefills
    prompts = _prompts(family, (3, 17, 30))
    batch = engine.generate(prompts, max_new_tokens=10, ignore_eos=True)
    for p, r in zip(prompts, batch):
        assert r.token_ids == uncached_greedy(model, p, 10)
        assert engine.generate(p, max_new_tokens=10, ignore_eos=True)[0].token_ids == r.token_ids
    assert engine.stats["target_forwards"] >= 10


def test_prefix_cache_reuses_blocks_and_keeps_outputs():
    model = make_family("llama")
    engine = specgraph.Engine(model, num_blocks=64, page_size=8)
    shared = _prompts("llama", (40,))[0]
    a, b = shared + [1, 2, 3], shared + [4, 5]
    cold_b = uncached_greedy(model, b, 6)
    engine.generate(a, max_new_tokens=6, ignore_eos=True)
    r = engine.generate(b, max_new_tokens=6, ignore_eos=True)[0]
    assert r.cached_tokens == 40  # five full blocks of the shared prefix
    assert r.token_ids == cold_b
    assert engine.stats["prefix_cache_hit_rate"] > 0


def test_pool_exhaustion_preempts_and_finishes_every_request():
    model = make_family("sdpa_gqa")
    # 12 usable blocks of 4 tokens = 48 slots; 6 requests of up to 10 + 12 tokens cannot all fit
    engine = specgraph.Engine(model, num_blocks=13, page_size=8, max_num_seqs=6, prefix_caching=False)
    prompts = _prompts("sdpa_gqa", (10, 9, 8, 7, 10, 6), seed=3)
    results = engine.generate(prompts, max_new_tokens=12, ignore_eos=True)
    assert engine.stats["preemptions"] > 0
    for p, r in zip(prompts, results):
        assert r.token_ids == uncached_greedy(model, p, 12)
    assert engine.kv.usage == 0.0


def test_request_larger_than_pool_is_a_clear_error():
    engine = specgraph.Engine(make_family("llama"), num_blocks=4, page_size=8)
    with pytest.raises(ValueError, match="KV pool exhausted"):
        engine.generate([1] * 30, max_new_tokens=10)


@pytest.mark.parametrize("chunk", [1, 7, None])
def test_score_matches_uncached_log_softmax(chunk):
    model = make_family("gpt2")
    engine = specgraph.Engine(model, num_blocks=32, page_size=8)
    ids = _prompts("gpt2", (37,))[0]
    got = engine.score(ids, chunk_size=chunk)
    with torch.no_grad():
        logp = torch.log_softmax(_logits(model(torch.tensor([ids])))[0], -1)
    ref = logp[:-1].gather(1, torch.tensor(ids[1:]).view(-1, 1)).view(-1)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_sampling_is_seeded_and_independent_per_sequence():
    engine = specgraph.Engine(make_family("llama"), num_blocks=32, page_size=8)
    p = [5, 6, 7, 8]
    a = engine.generate([p, p], max_new_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    b = engine.generate([p, p], max_new_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert a[0].token_ids != a[1].token_ids


def test_bad_prompt_ids_are_rejected():
    engine = specgraph.Engine(make_family("llama"), num_blocks=16, page_size=8)
    with pytest.raises(ValueError, match=r"\[0, 128\)"):
        engine.generate([3, 999], max_new_tokens=2)
