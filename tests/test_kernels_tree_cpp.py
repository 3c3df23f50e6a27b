"""The C++ CPU attention kernel with token trees (``tree_mask``, rule in ``kernels/tree_mask.py``).

``paged_attention_short`` and the quantized kernel (fp8, int4) fuzzed against the float64 rule
(``dense_tree_attention``; for quantized caches fed the K/V the cache dequantizes to) over steps that
mix random trees with decodes, chains and prefill chunks (rows of all bits), GQA 1/2/4, page sizes
1..16, scrambled block tables whose unused entries point outside the cache, NaN / garbage in every
unwritten slot, masks of 1 or 2 words (trees past 32 nodes, prefill chunks past 32 * W tokens), with
and without a window, a soft cap and ALiBi. Positions follow the tree: node m at base + depth(m).
Without a mask the kernel runs the chain rule; a chain's mask gives the no-mask outputs.
"""
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specgraph.kernels.tree_mask import ancestor_mask, causal_rows
from tree_steps import alibi_slopes_for, make_step, quantize, steps, variants

F32 = dict(atol=2e-5, rtol=1e-5)  # float32 kernel vs the float64 rule (test_kernels_paged_attention's)


def _cpp():
    from specgraph.kernels import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.fail(f"the C++ CPU attention kernel did not build: {cpu_kernels.build_error()}")
    return cpu_kernels


@settings(max_examples=60, deadline=None)
@given(steps(), st.data())
def test_cpp_kernel_with_a_tree_matches_the_rule(step, data):
    variant = data.draw(variants(step.q.shape[1]))
    out = _cpp().paged_attention_short_cpp(*step.args(), *variant, step.tree_mask)
    assert out.dtype == torch.float32 and out.shape == step.q.shape and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), step.expected(step.tree_mask, window=variant[0], softcap=variant[1],
                                                           alibi_slopes=variant[2]), **F32)


@settings(max_examples=30, deadline=None)
@given(steps(max_tokens=50), st.sampled_from(["fp8", "int4"]), st.data())
def test_quantized_cpp_kernel_with_a_tree_matches_the_rule_on_dequantized_kv(step, scheme, data):
    variant = data.draw(variants(step.q.shape[1]))
    cache, keys, values = quantize(step, scheme)
    run, takes = _cpp()._quant_attention(scheme)
    out = run(step.q, *cache, *step.meta(), *variant, step.tree_mask)
    assert out.dtype == torch.float32 and out.shape == step.q.shape and torch.isfinite(out).all()
    expected = step.expected(step.tree_mask, keys, values, window=variant[0], softcap=variant[1],
                             alibi_slopes=variant[2])
    torch.testing.assert_close(out.double(), expected, **F32)
    takes(step.q, *cache, *step.meta(), *variant, step.tree_mask)  # validates; a tree declines nothing


@settings(max_examples=30, deadline=None)
@given(steps(), st.data())
def test_no_mask_is_the_chain_rule_and_a_chain_mask_changes_nothing(step, data):
    """Without a mask the kernel runs the chain rule (the positions are the keys' indices); over
    chains and causal rows (positions base + m) the mask gives the same outputs: bit for bit without
    a window (same keys, same order), and to float32 rounding with one (a tree token's range starts at
    its first new key at the latest, the chain's at its window)."""
    variant = data.draw(variants(step.q.shape[1]))
    chains = dataclasses.replace(step, positions=torch.cat([
        torch.arange(int(step.seq_lens[s]) - n, int(step.seq_lens[s]))
        for s, n in enumerate(step.query_start_loc.diff().tolist())]))
    words = step.tree_mask.shape[1]
    mask = torch.cat([ancestor_mask(list(range(-1, n - 1)), words) if n <= 32 * words else causal_rows(n, words)
                      for n in step.query_start_loc.diff().tolist()])
    cpp = _cpp().paged_attention_short_cpp
    plain = cpp(*chains.args(), *variant)
    torch.testing.assert_close(plain.double(), chains.expected(None, window=variant[0], softcap=variant[1],
                                                               alibi_slopes=variant[2]), **F32)
    for rows in (mask, causal_rows(*mask.shape)):
        got = cpp(*chains.args(), *variant, rows)
        if variant[0] == 0:
            assert torch.equal(got, plain)
        else:
            torch.testing.assert_close(got, plain, atol=1e-6, rtol=1e-6)


def test_large_trees_and_long_chunks_use_the_second_word_and_the_fallback():
    """A 50-node tree and a 40-node tree (two words), a 70-token prefill chunk (keys past 64 bits: the
    causal rule), a decode; the float and quantized kernels, every variant."""
    seqs = [("tree", 30, 50), ("causal", 5, 70), ("tree", 0, 40), ("causal", 60, 1)]
    step = make_step(3, 16, kv_heads=2, group=2, head_dim=32, words=2, seqs=seqs)
    assert step.positions[:50].max() < 30 + 49  # the tree is not a chain
    cpu = _cpp()
    for variant in ((0, 0.0, None), (9, 0.0, None), (0, 30.0, alibi_slopes_for(4)), (17, 0.5, alibi_slopes_for(4))):
        out = cpu.paged_attention_short_cpp(*step.args(), *variant, step.tree_mask)
        torch.testing.assert_close(out.double(), step.expected(step.tree_mask, window=variant[0], softcap=variant[1],
                                                               alibi_slopes=variant[2]), **F32)
        for scheme in ("fp8", "int4"):
            cache, keys, values = quantize(step, scheme)
            out = cpu._quant_attention(scheme)[0](step.q, *cache, *step.meta(), *variant, step.tree_mask)
            expected = step.expected(step.tree_mask, keys, values, window=variant[0], softcap=variant[1],
                                     alibi_slopes=variant[2])
            torch.testing.assert_close(out.double(), expected, **F32)


def test_a_token_that_sees_nothing_outputs_zero():
    """A prefill token whose row has no bit (not even its own) sees no key: output 0, never NaN; a
    row with only its own bit sees only itself."""
    step = make_step(4, 4, kv_heads=1, group=2, head_dim=16, words=1, seqs=[("causal", 0, 5), ("tree", 3, 4)])
    mask = step.tree_mask.clone()
    mask[2] = 0
    mask[3] = 1 << 3
    for variant in ((0, 0.0, None), (2, 30.0, alibi_slopes_for(2))):
        out = _cpp().paged_attention_short_cpp(*step.args(), *variant, mask)
        assert torch.isfinite(out).all() and (out[2] == 0).all()
        torch.testing.assert_close(out[3], step.dense_v[0][3, 0].expand(2, -1))
        torch.testing.assert_close(out.double(), step.expected(mask, window=variant[0], softcap=variant[1],
                                                               alibi_slopes=variant[2]), **F32)


def test_native_ops_run_a_tree_in_the_cpp_kernel():
    """The native ops run the kernel on a tree verify (same outputs as the direct calls, the mask made
    contiguous), and the registry's tests take it; so they do on a long one (prefill-sized), and a bad
    mask goes to the dispatcher (whose check names it)."""
    cpu = _cpp()
    step = make_step(5, 8, kv_heads=2, group=2, head_dim=32, words=1,
                     seqs=[("tree", 20, 9), ("causal", 30, 1), ("tree", 7, 5)])
    loose = torch.cat([step.tree_mask, step.tree_mask], 1)[:, ::2]  # not contiguous
    assert not loose.is_contiguous()
    expected = cpu.paged_attention_short_cpp(*step.args(), 0, 0.0, alibi_slopes_for(4), step.tree_mask)
    assert torch.equal(torch.ops.specgraph_cpu.paged_attention(*step.args(), 0, 0.0, alibi_slopes_for(4), loose), expected)
    assert cpu._cpp_takes(*step.args(), 0, 0.0, alibi_slopes_for(4), step.tree_mask)
    for scheme in ("fp8", "int4"):
        cache, _, _ = quantize(step, scheme)
        run, takes = cpu._quant_attention(scheme)
        expected = run(step.q, *cache, *step.meta(), 3, 0.0, None, step.tree_mask)
        native = getattr(torch.ops.specgraph_cpu, f"paged_attention_{scheme}")
        assert torch.equal(native(step.q, *cache, *step.meta(), 3, 0.0, None, loose), expected)
        assert takes(step.q, *cache, *step.meta(), 3, 0.0, None, step.tree_mask)

    long = make_step(8, 8, kv_heads=2, group=2, head_dim=32, words=2, seqs=[("tree", 40, 30), ("causal", 100, 20)])
    assert cpu._cpp_takes(*long.args(), 9, 0.0, alibi_slopes_for(4), long.tree_mask)
    got = torch.ops.specgraph_cpu.paged_attention(*long.args(), 9, 0.0, alibi_slopes_for(4), long.tree_mask)
    torch.testing.assert_close(got.double(), long.expected(long.tree_mask, window=9, alibi_slopes=alibi_slopes_for(4)), **F32)
    for scheme in ("fp8", "int4"):
        cache, keys, values = quantize(long, scheme)
        got = getattr(torch.ops.specgraph_cpu, f"paged_attention_{scheme}")(long.q, *cache, *long.meta(), 9, 0.0,
                                                                            alibi_slopes_for(4), long.tree_mask)
        torch.testing.assert_close(got.double(), long.expected(long.tree_mask, keys, values, window=9,
                                                               alibi_slopes=alibi_slopes_for(4)), **F32)
    with pytest.raises(ValueError, match="tree_mask"):
        torch.ops.specgraph_cpu.paged_attention(*step.args(), 0, 0.0, None, step.tree_mask.long())


def test_a_bad_tree_mask_is_named():
    cpu = _cpp()
    step = make_step(6, 8, kv_heads=1, group=2, head_dim=16, words=1, seqs=[("tree", 4, 3)])
    for bad in (step.tree_mask.long(), step.tree_mask[:2], step.tree_mask[:, 0],
                torch.zeros(3, 0, dtype=torch.int32)):
        with pytest.raises(RuntimeError, match="tree_mask"):
            cpu.paged_attention_short_cpp(*step.args(), 0, 0.0, None, bad)
        with pytest.raises(ValueError, match="tree_mask"):
            cpu._cpp_takes(*step.args(), 0, 0.0, None, bad)
    with pytest.raises(RuntimeError, match="not contiguous"):
        cpu.load().paged_attention_short(*step.args(), 0, 0.0, None, torch.zeros(3, 2, dtype=torch.int32)[:, ::2])


def test_the_window_bounds_new_keys_by_position():
    """The rule holds for positions past the cache indices too (a tree whose positions run ahead of its
    nodes' indices): a new key is in a token's window by its position, not its index."""
    step = make_step(7, 4, kv_heads=1, group=2, head_dim=16, words=1, seqs=[("tree", 6, 12), ("causal", 9, 3)])
    shifted = dataclasses.replace(step, positions=step.positions + 6)
    for window in (2, 5):
        out = _cpp().paged_attention_short_cpp(*shifted.args(), window, 0.0, alibi_slopes_for(2), step.tree_mask)
        torch.testing.assert_close(out.double(), shifted.expected(step.tree_mask, window=window,
                                                                  alibi_slopes=alibi_slopes_for(2)), **F32)
