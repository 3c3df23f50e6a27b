"""Generation under KV-pool pressure with prefix caching on (the default): every request finishes
exactly as the uncached greedy loop, for every proposer, and the pool ends holding no live blocks."""
import pytest

import specgraph
from models import NanoGPT, make_family, random_prompts, tiny_llama, uncached_greedy


def _draft_model(family):
    return NanoGPT(layers=1).eval() if family == "nanogpt" else tiny_llama(layers=1, seed=1)


@pytest.mark.parametrize("family", ["nanogpt", "llama"])
def test_sixteen_requests_on_a_twelve_block_pool_finish_exactly(family):
    # 16 prompts of 3..40 tokens, 30 new tokens each: each fits the 11 usable blocks alone, not together
    model = make_family(family)
    lengths = [3 + (i * 37) % 38 for i in range(16)]
    prompts = random_prompts(family, lengths, seed=5)
    want = [uncached_greedy(model, p, 30) for p in prompts]
    for draft in (None, "ngram", "layer_skip:1", _draft_model(family)):
        engine = specgraph.Engine(model, page_size=8, num_blocks=12, max_num_seqs=8, draft=draft)
        got = [r.token_ids for r in engine.generate(prompts, max_new_tokens=30, ignore_eos=True)]
        name = draft if isinstance(draft, str) or draft is None else "draft model"
        assert got == want, f"{family} with draft={name}"
        assert engine.stats["preemptions"] > 0, name
        assert engine.stats["kv_pool_usage"] == 0.0, name
        engine.kv.check_invariants()


def test_long_shared_prefix_with_forked_samples_under_pressure():
    model = make_family("llama")
    shared = random_prompts("llama", (37,), seed=9)[0]
    prompts = [shared + s for s in random_prompts("llama", (1, 2, 3, 4, 5, 6), seed=10)]
    engine = specgraph.Engine(model, page_size=8, num_blocks=14, max_num_seqs=8)
    results = engine.generate(prompts, max_new_tokens=16, n=3, ignore_eos=True)
    for i, p in enumerate(prompts):
        want = uncached_greedy(model, p, 16)
        assert [r.token_ids for r in results[3 * i:3 * i + 3]] == [want] * 3
    stats = engine.stats
    assert stats["forks"] > 0 and stats["cow_copies"] > 0 and stats["preemptions"] > 0
    assert stats["prefix_cache_hit_rate"] > 0.5
    assert stats["kv_pool_usage"] == 0.0


def test_request_that_can_never_fit_is_refused_with_the_numbers():
    engine = specgraph.Engine(make_family("nanogpt"), page_size=8, num_blocks=12)
    with pytest.raises(ValueError, match=r"needs 12 blocks .* the pool has 11"):
        engine.submit([1] * 60, max_new_tokens=30)
    assert not engine.has_unfinished()


def test_forked_samples_equal_the_same_samples_run_alone():
    """n samples share the prompt's blocks; sample j draws like a lone request seeded seed + j."""
    model = make_family("sdpa_gqa")
    prompt = random_prompts("sdpa_gqa", (29,), seed=4)[0]
    engine = specgraph.Engine(model, page_size=8, num_blocks=32)
    forked = engine.submit(prompt, max_new_tokens=12, temperature=1.0, seed=11, n=3, ignore_eos=True)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats["forks"] == 2 and engine.stats["cow_copies"] >= 1
    alone = []
    for j in range(3):
        (r,) = engine.submit(prompt, max_new_tokens=12, temperature=1.0, seed=11 + j, ignore_eos=True)
        while engine.has_unfinished():
            engine.step()
        alone.append(r.output_ids)
    assert [r.output_ids for r in forked] == alone
    assert len({tuple(a) for a in alone}) > 1  # the samples differ
