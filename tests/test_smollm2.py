"""End to end on the real SmolLM2-135M-Instruct (slow: loads and compiles the 30-layer model once)."""
import os
import sys

import pytest
import torch

import specgraph

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
from prompts import PROMPTS  # noqa: E402  (the 6 benchmark prompts: 3 code, 3 chat)

pytestmark = pytest.mark.slow
NEW_TOKENS = 128


@pytest.fixture(scope="module")
def smollm2():
    torch.manual_seed(0)
    model, tok = specgraph.load_model("smollm2-135m-instruct")
    # the generated-code lowering (the default outside tests): what users run
    engine = specgraph.Engine(model, tokenizer=tok, page_size=16, max_num_seqs=8, lowering="inductor")
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               for _, p in PROMPTS]
    return model, tok, engine, prompts


def _hf_greedy(model, tok, prompt, n):
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True,
                             pad_token_id=tok.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def test_greedy_equals_hugging_face_on_benchmark_prompts(smollm2):
    model, tok, engine, prompts = smollm2
    batch = engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)  # batch of 6
    alone = engine.generate(prompts[:1], max_new_tokens=8, ignore_eos=True)  # batch 1: another step shape
    for prompt, result in zip(prompts, batch):
        assert result.token_ids == _hf_greedy(model, tok, prompt, NEW_TOKENS)
    assert alone[0].token_ids == batch[0].token_ids[:8]
    assert engine.stats["recompiles"] == 0


def test_speculation_greedy_equals_plain(smollm2):
    """Token trees (static and dynamic, n-gram and layer_skip drafts) and chains of 4 at batch 1 and 4 keep plain
    greedy's tokens (the eager lowering: its tokens must equal the generated code's; test_inductor_lowering runs
    tree masks through the generated code on small models, at a tenth of the compile time), and so does the
    controller's choice of shapes. One engine per draft runs them all: a tree engine verifies chains as narrow trees."""
    model, tok, engine, prompts = smollm2
    plain = engine.generate(prompts[:4], max_new_tokens=32, ignore_eos=True)
    for draft, tree in (("ngram", "static:3,2,1"), ("layer_skip:6", "dynamic:8")):
        spec = specgraph.Engine(model, tokenizer=tok, page_size=16, draft=draft, draft_tree=tree, adaptive=False,
                                num_draft_tokens=4, lowering="eager")
        # None: chains of num_draft_tokens; adaptive (the n-gram draft's default): the controller's choices
        runs = [(tree, False), (None, False)] + ([(tree, True)] if draft == "ngram" else [])
        for shape, adaptive in runs:
            spec.draft_tree, spec.adaptive = shape, adaptive
            spec.reset_stats()
            for batch in (prompts[:1], prompts[:4]):
                got = spec.generate(batch, max_new_tokens=32, ignore_eos=True)
                assert [r.token_ids for r in got] == [r.token_ids for r in plain[:len(batch)]], (draft, shape, batch)
            assert spec.stats["draft_tokens"] > 0 and spec.stats["recompiles"] == 0
            if not adaptive:
                assert (spec.stats["tree_nodes_verified"] > 0) == (shape is not None), spec.stats


def test_shipped_eagle_head_is_found_accepts_and_keeps_greedy_output(smollm2):
    """draft="eagle" picks the head shipped for SmolLM2 (by its fingerprint) with its default tree, and with
    adaptive=False drafts whichever of that tree and its chains it timed fastest; greedy output equals plain
    decoding at batch 1 and 4, on chains and trees; the head's drafts are accepted (a trained head)."""
    model, tok, engine, prompts = smollm2
    plain = engine.generate(prompts[:4], max_new_tokens=40, ignore_eos=True)
    spec = specgraph.Engine(model, tokenizer=tok, page_size=16, draft="eagle", adaptive=False, lowering="eager")
    assert spec.default_tree == "static:2,1,1" and spec.proposer.name == "eagle"
    rates = spec.draft_shape_rates
    assert set(rates) == {"static:2,1,1", "chain 1", "chain 2", "chain 3"}
    assert (spec.draft_tree or f"chain {spec.num_draft_tokens}") == max(rates, key=rates.get)
    spec.num_draft_tokens = 4  # (None below: chains of 4, whatever the choice set)
    for tree in ("static:2,1,1", "static:2,1", None):
        spec.draft_tree = tree
        for batch in (prompts[:1], prompts[:4]):
            got = spec.generate(batch, max_new_tokens=40, ignore_eos=True)
            assert [r.token_ids for r in got] == [r.token_ids for r in plain[:len(batch)]], (tree, len(batch))
        assert spec.stats["mean_accepted_tokens"] > 1.5, spec.stats  # (an untrained head: about 1.0)


def test_score_matches_uncached_logits_for_chunk_sizes(smollm2):
    model, tok, engine, prompts = smollm2
    ids = tok(prompts[0] + "def merge_intervals(intervals):", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    ref = logp[:-1].gather(1, torch.tensor(ids[1:]).view(-1, 1)).view(-1)
    for chunk in (1, 7, None):
        torch.testing.assert_close(engine.score(ids, chunk_size=chunk), ref, atol=2e-4, rtol=1e-4)


def test_prefix_cache_hit_keeps_output(smollm2):
    model, tok, engine, prompts = smollm2
    shared = "You are a terse assistant. " * 20
    a = tok.apply_chat_template([{"role": "system", "content": shared}, {"role": "user", "content": "Hi"}],
                                tokenize=False, add_generation_prompt=True)
    b = tok.apply_chat_template([{"role": "system", "content": shared}, {"role": "user", "content": "2+2?"}],
                                tokenize=False, add_generation_prompt=True)
    engine.generate(a, max_new_tokens=4)
    r = engine.generate(b, max_new_tokens=16, ignore_eos=True)[0]
    assert r.cached_tokens >= 96
    assert r.token_ids == _hf_greedy(model, tok, b, 16)


@pytest.mark.parametrize("kv_dtype", ["fp8", "int4"])
def test_quantized_cache_sizes_and_scores(smollm2, kv_dtype):
    model, tok, engine, prompts = smollm2
    quant = specgraph.Engine(model, tokenizer=tok, kv_dtype=kv_dtype)  # same default memory budget
    base = engine
    ratio = quant.stats["kv_bytes_per_token"] / base.stats["kv_bytes_per_token"]
    assert ratio <= (0.27 if kv_dtype == "fp8" else 0.15)
    # the hot pages (every running sequence's window plus a prefill chunk, in float32) take a share
    hot = quant.stats["kv_hot_blocks"] * quant.page_size * quant.stats["kv_hot_bytes_per_token"]
    cold_bytes = (256 << 20) - hot
    assert quant.stats["kv_pool_tokens"] >= 0.95 * cold_bytes / quant.stats["kv_bytes_per_token"]
    assert quant.stats["kv_pool_tokens"] >= 0.7 * base.stats["kv_pool_tokens"] / ratio
    ids = tok(prompts[3], add_special_tokens=False)["input_ids"]
    nll_q = -quant.score(ids, chunk_size=16).mean()
    nll_f = -base.score(ids, chunk_size=16).mean()
    # a ~50-token text: a loose regression bound; benchmarks/bench_kv_quant.py measures accuracy
    assert abs(float(nll_q - nll_f)) < (0.05 if kv_dtype == "fp8" else 0.1)
