"""Token trees in attention (kernels/tree_mask.py): the torch reference and the Triton kernel (interpreter),
float and quantized caches, fuzzed against the float64 rule over random trees mixed with decodes and
prefill chunks, with and without the score modifiers."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (conftest does it too)

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specgraph.kernels import quant_paged_attention as qpa
from specgraph.kernels.paged_attention import paged_attention_ref, paged_attention_triton
from specgraph.kernels.quant import allocate_fp8, allocate_int4, dequantize_fp8, dequantize_int4
from specgraph.kernels.quant_cache_write import cache_write_fp8_ref, cache_write_int4_ref
from specgraph.kernels.tree_mask import (ancestor_mask, causal_rows, dense_tree_attention, depths, mask_words,
                                         random_tree, unpack)


def tree_step(kinds, gen, kv_heads, group, head_dim, page_size, words, max_children=3):
    """A step of sequences of ``kinds`` ("tree:N", "decode", "prefill:N") with random committed contexts:
    q, per-sequence K/V by cache index, a scrambled paged cache holding them, and the metadata."""
    H = kv_heads * group
    seqs = []
    for kind in kinds:
        name, _, arg = kind.partition(":")
        committed = int(torch.randint(0, 40, (1,), generator=gen))
        if name == "tree":
            parents = random_tree(int(arg), gen, max_children)
            rows = ancestor_mask(parents, words)
            pos = [committed + d for d in depths(parents)]
        else:
            n = 1 if name == "decode" else int(arg)
            committed = max(committed, 1) if name == "decode" else committed
            rows = causal_rows(n, words)
            pos = list(range(committed, committed + n))
        seqs.append((committed, pos, rows))
    lens = [c + len(p) for c, p, _ in seqs]
    blocks_per = [-(-n // page_size) for n in lens]
    num_blocks = sum(blocks_per) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    keys, values, slots = [], [], []
    at = 0
    for s, n in enumerate(lens):
        tables[s, :blocks_per[s]] = torch.tensor(perm[at:at + blocks_per[s]], dtype=torch.int32)
        at += blocks_per[s]
        keys.append(torch.randn(n, kv_heads, head_dim, generator=gen))
        values.append(torch.randn(n, kv_heads, head_dim, generator=gen))
        j = torch.arange(n)
        slots.append(tables[s].long()[j // page_size] * page_size + j % page_size)
    qsl = [0]
    for _, p, _ in seqs:
        qsl.append(qsl[-1] + len(p))
    return dict(
        q=torch.randn(qsl[-1], H, head_dim, generator=gen), keys=keys, values=values, slots=slots,
        num_blocks=num_blocks, block_tables=tables, seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        positions=torch.tensor([x for _, p, _ in seqs for x in p], dtype=torch.int64),
        tree_mask=torch.cat([r for *_, r in seqs]))


def float_cache(step, page_size):
    kv_heads, head_dim = step["keys"][0].shape[1:]
    kc = torch.full((step["num_blocks"], page_size, kv_heads, head_dim), float("nan"))
    vc = kc.clone()
    for k, v, sl in zip(step["keys"], step["values"], step["slots"]):
        kc.view(-1, kv_heads, head_dim)[sl] = k
        vc.view(-1, kv_heads, head_dim)[sl] = v
    return kc, vc


def quant_cache(step, page_size, scheme):
    """The step's K/V written into an fp8 / int4 cache; the per-sequence K/V become what it stores."""
    kv_heads, head_dim = step["keys"][0].shape[1:]
    if scheme == "fp8":
        cache = allocate_fp8(step["num_blocks"], page_size, kv_heads, head_dim)
        write = cache_write_fp8_ref
    else:
        cache = allocate_int4(step["num_blocks"], page_size, kv_heads, head_dim)
        write = cache_write_int4_ref
    tensors = cache.tensors()
    for k, v, sl in zip(step["keys"], step["values"], step["slots"]):
        write(k, v, *tensors, sl)
    deq = []
    for k, v, sl in zip(step["keys"], step["values"], step["slots"]):
        kc, vc, ks, vs = (t.flatten(0, 1).index_select(0, sl) for t in tensors)
        if scheme == "fp8":
            deq.append((dequantize_fp8(kc, ks), dequantize_fp8(vc, vs)))
        else:
            deq.append((dequantize_int4(kc, ks), dequantize_int4(vc, vs)))
    return tensors, [k for k, _ in deq], [v for _, v in deq]


KINDS = st.lists(st.sampled_from(["tree:1", "tree:3", "tree:6", "tree:11", "decode", "prefill:5", "prefill:19"]),
                 min_size=1, max_size=4)


def _args(step):
    return (step["block_tables"], step["seq_lens"], step["query_start_loc"], step["positions"])


@settings(max_examples=30, deadline=None)
@given(kinds=KINDS, seed=st.integers(0, 2**16), group=st.sampled_from([1, 2, 4]), page_size=st.sampled_from([1, 4, 16]),
       words=st.sampled_from([1, 2]), variant=st.sampled_from(["plain", "window", "softcap", "alibi"]))
def test_float_kernels_follow_the_tree_rule(kinds, seed, group, page_size, words, variant):
    gen = torch.Generator().manual_seed(seed)
    step = tree_step(kinds, gen, kv_heads=2, group=group, head_dim=16, page_size=page_size, words=words)
    H = 2 * group
    mods = dict(window=4 if variant == "window" else 0, softcap=5.0 if variant == "softcap" else 0.0,
                alibi_slopes=torch.linspace(0.1, 0.9, H) if variant == "alibi" else None)
    scale = 0.25
    want = dense_tree_attention(step["q"], step["keys"], step["values"], step["positions"], step["seq_lens"],
                                step["query_start_loc"], scale, step["tree_mask"], **mods)
    kc, vc = float_cache(step, page_size)
    for impl in (paged_attention_ref, paged_attention_triton):
        got = impl(step["q"], kc, vc, *_args(step), scale, **mods, tree_mask=step["tree_mask"])
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5, msg=lambda m: f"{impl.__name__}: {m}")


@settings(max_examples=12, deadline=None)
@given(kinds=KINDS, seed=st.integers(0, 2**16), group=st.sampled_from([1, 4]), page_size=st.sampled_from([2, 8]),
       scheme=st.sampled_from(["fp8", "int4"]))
def test_quantized_kernels_follow_the_tree_rule(kinds, seed, group, page_size, scheme):
    gen = torch.Generator().manual_seed(seed)
    step = tree_step(kinds, gen, kv_heads=2, group=group, head_dim=32, page_size=page_size, words=1)
    tensors, keys, values = quant_cache(step, page_size, scheme)
    want = dense_tree_attention(step["q"], keys, values, step["positions"], step["seq_lens"],
                                step["query_start_loc"], 0.2, step["tree_mask"])
    ref = getattr(qpa, f"paged_attention_{scheme}_ref")
    triton_impl = getattr(qpa, f"paged_attention_{scheme}_triton")
    for impl in (ref, triton_impl):
        got = impl(step["q"], *tensors, *_args(step), 0.2, tree_mask=step["tree_mask"])
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5, msg=lambda m: f"{impl.__name__}: {m}")


def test_a_chain_mask_is_the_causal_rule():
    """A chain's ancestor rows (and all-ones rows) change nothing: trees extend the causal rule."""
    gen = torch.Generator().manual_seed(3)
    step = tree_step(["prefill:7", "decode", "prefill:3"], gen, kv_heads=1, group=2, head_dim=16, page_size=4,
                     words=1)
    kc, vc = float_cache(step, 4)
    plain = paged_attention_ref(step["q"], kc, vc, *_args(step), 0.3)
    chain = torch.cat([ancestor_mask(list(range(-1, n - 1)), 1) for n in (7, 1, 3)])
    for impl in (paged_attention_ref, paged_attention_triton):
        for mask in (chain, step["tree_mask"]):
            torch.testing.assert_close(impl(step["q"], kc, vc, *_args(step), 0.3, tree_mask=mask), plain,
                                       atol=2e-6, rtol=1e-6)


def test_siblings_do_not_see_each_other():
    """Two siblings at one position with different K/V: each output is the chain answer of its own branch."""
    gen = torch.Generator().manual_seed(1)
    step = tree_step(["tree:3"], gen, kv_heads=1, group=1, head_dim=16, page_size=4, words=1)
    parents = [-1, 0, 0]
    step["tree_mask"] = ancestor_mask(parents, 1)
    committed = int(step["seq_lens"][0]) - 3
    step["positions"] = torch.tensor([committed, committed + 1, committed + 1])
    kc, vc = float_cache(step, 4)
    out = paged_attention_ref(step["q"], kc, vc, *_args(step), 0.3, tree_mask=step["tree_mask"])
    for branch in (1, 2):  # a 2-token chain: the root, then this branch's node
        keep = list(range(committed + 1)) + [committed + branch]
        k, v = step["keys"][0][keep], step["values"][0][keep]
        probs = torch.softmax(k[:, 0] @ step["q"][branch, 0] * 0.3, 0)
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
