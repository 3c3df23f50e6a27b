"""Token trees in attention (kernels/tree_mask.py): the torch reference and the Triton kernel (interpreter),
float and quantized caches, fuzzed against the float64 rule over the steps of tests/tree_steps.py (random
trees mixed with chains, decodes and prefill chunks, with and without the score modifiers); the C++
kernel's are in test_kernels_tree_cpp.py."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (conftest does it too)

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specgraph.kernels import quant_paged_attention as qpa
from specgraph.kernels.paged_attention import paged_attention_ref, paged_attention_triton
from specgraph.kernels.tree_mask import ancestor_mask, causal_rows, mask_words, unpack
from tree_steps import make_step, quantize, steps, variants


F32 = dict(atol=2e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(steps(max_tokens=40), st.data())
def test_float_kernels_follow_the_tree_rule(step, data):
    variant = data.draw(variants(step.q.shape[1]))
    want = step.expected(step.tree_mask, window=variant[0], softcap=variant[1], alibi_slopes=variant[2])
    for impl in (paged_attention_ref, paged_attention_triton):
        got = impl(*step.args(), *variant, tree_mask=step.tree_mask)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, **F32, msg=lambda m: f"{impl.__name__}: {m}")


@settings(max_examples=12, deadline=None)
@given(steps(max_tokens=30), st.sampled_from(["fp8", "int4"]), st.data())
def test_quantized_kernels_follow_the_tree_rule(step, scheme, data):
    variant = data.draw(variants(step.q.shape[1]))
    cache, keys, values = quantize(step, scheme)
    want = step.expected(step.tree_mask, keys, values, window=variant[0], softcap=variant[1], alibi_slopes=variant[2])
    for impl in (getattr(qpa, f"paged_attention_{scheme}_ref"), getattr(qpa, f"paged_attention_{scheme}_triton")):
        got = impl(step.q, *cache, *step.meta(), *variant, tree_mask=step.tree_mask)
        torch.testing.assert_close(got.double(), want, **F32, msg=lambda m: f"{impl.__name__}: {m}")


def test_a_chain_mask_is_the_causal_rule():
    """A chain's ancestor rows (and all-ones rows) change nothing: trees extend the causal rule."""
    step = make_step(3, 4, kv_heads=1, group=2, head_dim=16, words=1,
                     seqs=[("chain", 9, 7), ("causal", 4, 1), ("causal", 0, 3)])
    plain = paged_attention_ref(*step.args())
    for impl in (paged_attention_ref, paged_attention_triton):
        for mask in (step.tree_mask, causal_rows(*step.tree_mask.shape)):
            torch.testing.assert_close(impl(*step.args(), tree_mask=mask), plain, atol=2e-6, rtol=1e-6)


def test_siblings_do_not_see_each_other():
    """Two siblings at one position: each output is the chain answer of its own branch."""
    step = make_step(1, 4, kv_heads=1, group=1, head_dim=16, words=1, seqs=[("chain", 5, 3)])
    step = dataclasses.replace(step, tree_mask=ancestor_mask([-1, 0, 0], 1), positions=torch.tensor([5, 6, 6]))
    out = paged_attention_ref(*step.args(), tree_mask=step.tree_mask)
    for branch in (1, 2):  # a 2-token chain: the root, then this branch's node
        keep = list(range(6)) + [5 + branch]
        k, v = step.dense_k[0][keep], step.dense_v[0][keep]
        probs = torch.softmax(k[:, 0] @ step.q[branch, 0] * step.scale, 0)
        torch.testing.assert_close(out[branch, 0], probs @ v[:, 0], atol=1e-5, rtol=1e-5)


def test_mask_layout_and_errors():
    rows = ancestor_mask([-1, 0, 0, 2], 1)
    assert unpack(rows, 4).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
    assert mask_words(32) == 1 and mask_words(33) == 2
    wide = ancestor_mask(list(range(-1, 39)), 2)  # a 40-node chain crosses a word
    assert unpack(wide, 40).all(dim=0).tolist()[:1] == [True] and bool(unpack(wide, 40)[39].all())
    with pytest.raises(ValueError, match="parents"):
        ancestor_mask([-1, 2, 0], 1)
    with pytest.raises(ValueError, match="does not fit"):
        ancestor_mask(list(range(-1, 40)), 1)
    q = torch.randn(3, 2, 16)
    kc = torch.zeros(2, 4, 1, 16)
    meta = (torch.tensor([[0]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
            torch.tensor([0, 3], dtype=torch.int32), torch.arange(3))
    with pytest.raises(ValueError, match="tree_mask must be int32"):
        paged_attention_ref(q, kc, kc, *meta, 0.1, tree_mask=torch.zeros(3, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="tree_mask must be int32"):
        paged_attention_ref(q, kc, kc, *meta, 0.1, tree_mask=torch.zeros(2, 1, dtype=torch.int32))
