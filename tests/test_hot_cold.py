"""Hot/cold KV caches: float pages for each sequence's newest tokens, fp8 / int4 pages for older ones.

* Kernels: attention over mixed tables (Triton under the interpreter, C++, torch reference) equals
  float attention over a cache whose cold pages hold their dequantized rows; a demoted page holds
  the bytes a direct quantized write stores.
* Pass: the compiled program reads demoted pages exactly as the kernels do; all-hot it is exact.
* KV manager: pages leave the window at commit (window policy) or only under pressure (adaptive),
  tables and prefix-cache keys follow, cold pages are never written.
* Engine: outputs, prefix hits on cold pages, and a pool under pressure that serves more long
  requests than float32 with no preemption where float32 preempts.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (conftest does it too)

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specgraph
from models import tiny_llama, uncached_greedy
from specgraph.compiler.options import BackendOptions
from specgraph.compiler.program import AttentionMetadata, compile_decoder
from specgraph.kernels import cpu_kernels, get_scheme
from specgraph.kernels.hot_cold import (
    allocate_mixed,
    demote_blocks,
    hot_tensors,
    paged_attention_mixed_ref,
    paged_attention_mixed_triton,
)
from specgraph.kernels.paged_attention import paged_attention_ref
from specgraph.kernels.quant import dequantize_fp8, dequantize_int4
from specgraph.runtime.kv_manager import KVCacheManager
from test_kernels_paged_attention import MIXED, batches, make_batch

DEQUANTIZE = {"fp8": dequantize_fp8, "int4": dequantize_int4}


def make_mixed(b, scheme: str, cold_mask: list[bool]):
    """The float batch's cache as hot pages, its used blocks where ``cold_mask`` says moved to cold pages
    (block tables rewritten), and the float cache those cold pages dequantize to."""
    num_blocks, page, kv_heads, head_dim = b.k_cache.shape
    layer = allocate_mixed(num_blocks, num_blocks, page, kv_heads, head_dim, b.q.dtype, scheme)
    layer[4].copy_(b.k_cache)
    layer[5].copy_(b.v_cache)
    used = sorted({int(x) for x in b.block_tables.flatten().tolist()} - {0})
    src = [blk for blk, cold in zip(used, cold_mask) if cold]
    dst = [num_blocks + i for i in range(len(src))]
    demote_blocks(*layer[4:], *layer[:4], src, dst)
    tables = b.block_tables.clone()
    for s, d in zip(src, dst):
        tables[b.block_tables == s] = d
    deq = DEQUANTIZE[scheme]
    dense_k = torch.cat([layer[4].float(), deq(layer[0], layer[2])])
    dense_v = torch.cat([layer[5].float(), deq(layer[1], layer[3])])
    return layer, tables, dense_k, dense_v


def _args(b, layer, tables):
    return (b.q, *layer[4:], *layer[:4], tables, b.seq_lens, b.query_start_loc, b.positions, b.scale)


@settings(max_examples=12, deadline=None)
@given(batches(), st.sampled_from(["fp8", "int4"]), st.lists(st.booleans(), min_size=12, max_size=12))
def test_mixed_attention_matches_float_attention_over_dequantized_pages(b, scheme, cold_mask):
    b.q, b.k_cache, b.v_cache = b.q.float(), b.k_cache.float(), b.v_cache.float()
    layer, tables, dense_k, dense_v = make_mixed(b, scheme, cold_mask)
    want = paged_attention_ref(b.q, dense_k, dense_v, tables, b.seq_lens, b.query_start_loc, b.positions, b.scale)
    ref = paged_attention_mixed_ref(*_args(b, layer, tables))
    torch.testing.assert_close(ref, want, atol=1e-6, rtol=1e-6)
    tri = paged_attention_mixed_triton(*_args(b, layer, tables))
    torch.testing.assert_close(tri, want, atol=2e-5, rtol=1e-5)
    if cpu_kernels.load() is not None:
        cpp = cpu_kernels.paged_attention_mixed_cpp(*_args(b, layer, tables))
        torch.testing.assert_close(cpp, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme", ["fp8", "int4"])
def test_mixed_attention_in_bf16_and_with_a_tree_mask(scheme):
    b = make_batch(3, 8, kv_heads=2, group=3, head_dim=32, dtype=torch.bfloat16, seqs=MIXED)
    layer, tables, dense_k, dense_v = make_mixed(b, scheme, [True, False] * 8)
    want = paged_attention_ref(b.q.float(), dense_k, dense_v, tables, b.seq_lens, b.query_start_loc, b.positions,
                               b.scale)
    tri = paged_attention_mixed_triton(*_args(b, layer, tables))
    torch.testing.assert_close(tri.float(), want, atol=3e-2, rtol=3e-2)
    # a tree mask that hides every new key but the token's own: the C++ and reference paths agree
    b = make_batch(4, 8, kv_heads=2, group=2, head_dim=32, dtype=torch.float32, seqs=[(30, 4, 0), (21, 3, 0)])
    layer, tables, _, _ = make_mixed(b, scheme, [True, True, False, True, False, True, True])
    n = b.q.shape[0]
    mask = torch.zeros(n, 1, dtype=torch.int32)
    starts = b.query_start_loc.tolist()
    for s in range(len(starts) - 1):
        for t in range(starts[s], starts[s + 1]):
            mask[t, 0] = 1 << (t - starts[s])
    ref = paged_attention_mixed_ref(*_args(b, layer, tables), tree_mask=mask)
    tri = paged_attention_mixed_triton(*_args(b, layer, tables), tree_mask=mask)
    torch.testing.assert_close(tri, ref, atol=2e-5, rtol=1e-5)
    if cpu_kernels.load() is not None:
        cpp = cpu_kernels.paged_attention_mixed_cpp(*_args(b, layer, tables), tree_mask=mask)
        torch.testing.assert_close(cpp, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme", ["fp8", "int4"])
def test_a_demoted_page_holds_what_a_direct_quantized_write_stores(scheme):
    torch.manual_seed(0)
    page, kv_heads, head_dim = 8, 2, 32
    layer = allocate_mixed(4, 3, page, kv_heads, head_dim, torch.float32, scheme)
    layer[4].normal_()
    layer[5].normal_()
    demote_blocks(*layer[4:], *layer[:4], [2, 3], [6, 4])  # hot 2 -> cold page 2, hot 3 -> cold page 0
    direct = get_scheme(scheme).allocate(3, page, kv_heads, head_dim).tensors()
    for src, cold in ((2, 2), (3, 0)):
        slots = cold * page + torch.arange(page)
        get_scheme(scheme).write_op(layer[4][src], layer[5][src], *direct, slots)
    for got, want in zip(layer[:4], direct):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(ValueError, match="not hot sources"):
        demote_blocks(*layer[4:], *layer[:4], [5], [4])
    assert hot_tensors(layer) == layer[4:] and hot_tensors(layer[:2]) == layer[:2]


def test_mixed_layout_errors_name_the_tensor():
    layer = allocate_mixed(3, 2, 8, 2, 32, torch.float32, "fp8")
    q = torch.randn(1, 4, 32)
    meta = (torch.tensor([[1]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0]))
    with pytest.raises(ValueError, match="k_hot must be a float"):
        paged_attention_mixed_ref(q, layer[4][:, :4].contiguous(), layer[5], *layer[:4], *meta, 1.0)
    with pytest.raises(ValueError, match="cold KV pages must be"):
        paged_attention_mixed_ref(q, *layer[4:], layer[4], *layer[1:4], *meta, 1.0)


# ------------------------------------------------------------------------------ compiler


@pytest.mark.parametrize("kv", ["fp8", "int4"])
def test_program_reads_demoted_pages_like_the_float_program_reads_their_dequantized_rows(kv):
    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    mixed = compile_decoder(model, BackendOptions(kv_dtype=kv, page_size=8, lowering="eager"))
    assert mixed.hot_cold
    ids = torch.randint(0, 128, (40,))
    cache = mixed.new_kv_cache(8, num_cold=6)
    first = AttentionMetadata.build([([1, 2, 3, 4, 5], 0, 40)], 8, [list(range(40))])
    with torch.no_grad():
        torch.testing.assert_close(mixed(ids, first, cache), model(ids[None])[0][0], atol=1e-5, rtol=1e-5)  # all hot
    for layer in cache:
        demote_blocks(*layer[4:], *layer[:4], [1, 3], [8, 11])
    tail = AttentionMetadata.build([([8, 2, 11, 4, 5], 32, 8)], 8, [list(range(8))])
    got = mixed(ids[32:], tail, cache)
    # the same program with pages 1 and 3 hot again, holding the cold pages' dequantized rows
    # (the cache is in rotate_kv's basis, so the float program is not the comparison)
    as_hot = []
    for layer in cache:
        k, v = layer[4].clone(), layer[5].clone()
        for hot, cold in ((1, 0), (3, 3)):
            k[hot] = DEQUANTIZE[kv](layer[0][cold], layer[2][cold])
            v[hot] = DEQUANTIZE[kv](layer[1][cold], layer[3][cold])
        as_hot.append((*layer[:4], k, v))
    want = mixed(ids[32:], AttentionMetadata.build([([1, 2, 3, 4, 5], 32, 8)], 8, [list(range(8))]), as_hot)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_hot_window_options_are_checked():
    assert BackendOptions(kv_dtype="int4").hot_window_tokens == 32
    assert BackendOptions(kv_dtype="int4", kv_hot_window=20, page_size=16).hot_window_tokens == 32  # whole pages
    assert not BackendOptions(kv_dtype="fp8", kv_hot_window=0).kv_hot_cold
    assert BackendOptions(kv_dtype="adaptive").kv_cold_scheme == "fp8"
    with pytest.raises(ValueError, match="kv_hot_window applies to"):
        BackendOptions(kv_dtype="auto", kv_hot_window=16)
    with pytest.raises(ValueError, match="needs a hot window"):
        BackendOptions(kv_dtype="adaptive", kv_hot_window=0)
    with pytest.raises(ValueError, match="kv_hot_window must be"):
        BackendOptions(kv_dtype="fp8", kv_hot_window=-1)


# ---------------------------------------------------------------------------- KV manager


def test_window_policy_demotes_committed_pages_behind_the_window_and_keys_follow():
    kv = KVCacheManager(num_blocks=10, page_size=4, num_cold=10, hot_window=4, demote="window")
    tokens = list(range(100, 118))  # 18 tokens: 4 full pages + 2
    kv.add_sequence(0, tokens)
    kv.allocate(0, 18)
    kv.commit(0, tokens)
    table = kv.block_table(0)
    # written 18 -> 4 full pages; the window keeps the last full page hot: pages 0..2 go cold
    assert [kv.block_pool.is_cold(b) for b in table] == [True, True, True, False, False]
    demotions = kv.take_demotions()
    assert [d for _, d in demotions] == table[:3] and kv.take_demotions() == []
    kv.check_invariants()
    # a new prompt with the same first 12 tokens hits the cold pages through the moved keys
    assert kv.add_sequence(1, tokens[:13] + [7]) == 12
    assert kv.block_table(1) == table[:3]
    assert kv.block_pool.ref_count(table[0]) == 2
    kv.check_invariants()


def test_pressure_policy_demotes_only_when_the_hot_pool_is_short_longest_sequence_first():
    kv = KVCacheManager(num_blocks=7, page_size=4, num_cold=8, hot_window=4, demote="pressure")
    for sid, n in ((0, 16), (1, 8)):
        kv.add_sequence(sid, list(range(n)))
        kv.allocate(sid, n)
        kv.commit(sid, list(range(n)))
    assert kv.take_demotions() == [] and kv.block_pool.num_free_blocks == 0  # 6 hot blocks, no pressure yet
    long_table = kv.block_table(0)
    assert kv.allocate(1, 1) == []  # needs one block: the longest sequence's oldest page goes cold
    [(src, dst)] = kv.take_demotions()
    assert src == long_table[0] and kv.block_table(0)[0] == dst and kv.block_pool.is_cold(dst)
    kv.check_invariants()
    # nothing behind any window left to demote once the cold pool is full: allocation fails cleanly
    kv2 = KVCacheManager(num_blocks=4, page_size=4, num_cold=0 + 1, hot_window=4, demote="pressure")
    kv2.add_sequence(0, list(range(12)))
    kv2.allocate(0, 12)
    kv2.commit(0, list(range(12)))
    assert kv2.allocate(0, 1) is not None  # one page demoted into the single cold page
    assert kv2.allocate(0, 4) is None
    kv2.check_invariants()


def test_a_truncate_below_the_window_refuses_to_write_into_a_cold_page():
    kv = KVCacheManager(num_blocks=8, page_size=4, num_cold=8, hot_window=4, demote="window")
    kv.add_sequence(0, list(range(16)))
    kv.allocate(0, 16)
    kv.commit(0, list(range(16)))
    kv.truncate(0, 6)  # page 1 (cold) becomes the partial last page
    with pytest.raises(RuntimeError, match="cold block"):
        kv.allocate(0, 1)


# -------------------------------------------------------------------------------- engine


PROMPTS = [list(range(3, 43)), [5, 9, 11] * 15, list(range(60, 90))]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2)


def test_engine_with_every_page_hot_is_exact_and_int4_pages_stay_close(model):
    want = [uncached_greedy(model, p, 16) for p in PROMPTS]
    adaptive = specgraph.Engine(model, kv_dtype="adaptive", page_size=8, num_blocks=40, num_cold_blocks=20,
                                lowering="eager")
    assert [r.token_ids for r in adaptive.generate(PROMPTS, max_new_tokens=16)] == want  # no pressure: all hot
    assert adaptive.stats["kv_demotions"] == 0
    float_engine = specgraph.Engine(model, page_size=8, lowering="eager")
    int4 = specgraph.Engine(model, kv_dtype="int4", kv_hot_window=8, page_size=8, num_blocks=24, num_cold_blocks=40,
                            lowering="eager")
    ids = list(range(5, 85))
    exact, cold = float_engine.score(ids, chunk_size=8), int4.score(ids, chunk_size=8)
    assert int4.stats["kv_demotions"] >= 8
    assert float((exact - cold).abs().max()) < 0.1
    int4.generate(PROMPTS, max_new_tokens=16)
    int4.kv.check_invariants()
    s = int4.stats
    assert s["kv_hot_bytes_per_token"] > s["kv_bytes_per_token"] and s["kv_cold_blocks"] == 40


def test_prefix_hits_on_cold_pages_give_the_same_answer(model):
    engine = specgraph.Engine(model, kv_dtype="fp8", kv_hot_window=8, page_size=8, num_blocks=24,
                              num_cold_blocks=40, lowering="eager")
    prompt = list(range(3, 60))
    first = engine.generate([prompt], max_new_tokens=8)[0].token_ids
    again = engine.generate([prompt], max_new_tokens=8)[0].token_ids
    assert engine.stats["cached_prompt_tokens"] >= 48 and again == first
    engine.kv.check_invariants()


def test_a_pool_under_pressure_serves_long_requests_without_preempting_where_float32_preempts(model):
    prompts = [[(7 * i + j) % 120 + 1 for j in range(72)] for i in range(4)]
    memory = 4 * 11 * 8 * 2 * 2 * 2 * 16 * 4  # about 44 float32 pages of 8 tokens (2 layers, 2 kv heads x 16)
    float_engine = specgraph.Engine(model, page_size=8, kv_cache_memory=memory, max_num_seqs=4, lowering="eager")
    want = [r.token_ids for r in float_engine.generate(prompts, max_new_tokens=24, ignore_eos=True)]
    assert float_engine.stats["preemptions"] > 0
    for kv in ("int4", "adaptive"):
        engine = specgraph.Engine(model, kv_dtype=kv, page_size=8, kv_cache_memory=memory, max_num_seqs=4,
                                  lowering="eager")
        got = [r.token_ids for r in engine.generate(prompts, max_new_tokens=24, ignore_eos=True)]
        assert engine.stats["preemptions"] == 0 and engine.stats["kv_demotions"] > 0, (kv, engine.stats)
        assert engine.stats["kv_pool_tokens"] > float_engine.stats["kv_pool_tokens"]
        assert sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) >= 0.75 * 4 * 24  # quantized: close
        engine.kv.check_invariants()


def test_num_cold_blocks_needs_a_hot_cold_cache(model):
    with pytest.raises(ValueError, match="num_cold_blocks is for a hot/cold cache"):
        specgraph.Engine(model, page_size=8, num_cold_blocks=4, lowering="eager")
