"""Token-tree attention steps for the kernel tests (tests/test_kernels_tree*.py): a paged float32 cache with
scrambled block tables (unused entries pointing outside the cache, NaN in every unwritten slot), a mix of
random trees, chains, decodes and prefill chunks, and each sequence's K/V by cache index for the float64
rule (``dense_tree_attention``); hypothesis strategies for steps and score modifiers; quantized copies."""
import dataclasses

import torch
from hypothesis import strategies as st

from specgraph.kernels import get_scheme
from specgraph.kernels.quant import dequantize_fp8, dequantize_int4
from specgraph.kernels.quant_cache_write import cache_write_fp8_ref, cache_write_int4_ref
from test_kernels_paged_attention import Batch
from specgraph.kernels.tree_mask import ancestor_mask, causal_rows, dense_tree_attention, depths, random_tree

WRITE = {"fp8": cache_write_fp8_ref, "int4": cache_write_int4_ref}
DEQUANTIZE = {"fp8": dequantize_fp8, "int4": dequantize_int4}


@dataclasses.dataclass
class Step(Batch):
    """A Batch (float32 cache; ``dense_k`` / ``dense_v``: each sequence's K/V by cache index) with its tree mask."""

    tree_mask: torch.Tensor  # [N, W] int32

    def meta(self):
        return (self.block_tables, self.seq_lens, self.query_start_loc, self.positions, self.scale)

    def slots(self, s: int) -> torch.Tensor:
        page = self.k_cache.shape[1]
        j = torch.arange(int(self.seq_lens[s]))
        return self.block_tables[s, j // page].long() * page + j % page

    def expected(self, tree_mask=None, keys=None, values=None, window=0, softcap=0.0, alibi_slopes=None):
        return dense_tree_attention(self.q, keys or self.dense_k, values or self.dense_v, self.positions, self.seq_lens,
                                    self.query_start_loc, self.scale, tree_mask, window, softcap, alibi_slopes)


def make_step(seed, page_size, kv_heads, group, head_dim, words, seqs) -> Step:
    """``seqs``: per sequence ``(kind, committed, n)``: ``n`` new tokens after ``committed`` keys, a
    random tree ("tree"), a chain's ancestor rows ("chain") or rows of all bits ("causal": decodes,
    prefill chunks)."""
    gen = torch.Generator().manual_seed(seed)
    lens = [c + n for _, c, n in seqs]
    pages = [-(-L // page_size) for L in lens]
    num_blocks = sum(pages) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(pages) + 1
    # scrambled block ids; unused entries point outside the cache (the kernel rejects any it reads)
    block_tables = torch.tensor([[free.pop() for _ in range(p)] + [num_blocks + 7] * (max_blocks - p) for p in pages],
                                dtype=torch.int32)
    k_cache = torch.full((num_blocks, page_size, kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    keys, values, positions, rows = [], [], [], []
    for s, ((kind, committed, n), L) in enumerate(zip(seqs, lens)):
        keys.append(torch.randn(L, kv_heads, head_dim, generator=gen))
        values.append(torch.randn(L, kv_heads, head_dim, generator=gen))
        j = torch.arange(L)
        slots = block_tables[s, j // page_size].long() * page_size + j % page_size
        k_cache.view(-1, kv_heads, head_dim)[slots] = keys[s]
        v_cache.view(-1, kv_heads, head_dim)[slots] = values[s]
        parents = random_tree(n, gen) if kind == "tree" and n else list(range(-1, n - 1))
        positions += [committed + d for d in depths(parents)]
        rows.append(causal_rows(n, words) if kind == "causal" else ancestor_mask(parents, words))
    q = torch.randn(len(positions), kv_heads * group, head_dim, generator=gen)
    query_start_loc = torch.tensor([0] + [n for _, _, n in seqs]).cumsum(0).to(torch.int32)
    return Step(q, k_cache, v_cache, block_tables, torch.tensor(lens, dtype=torch.int32), query_start_loc,
                torch.tensor(positions, dtype=torch.int64), head_dim**-0.5, keys, values, torch.cat(rows))


@st.composite
def steps(draw, max_tokens=80):
    words = draw(st.sampled_from([1, 2]))
    seqs, budget = [], max_tokens
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["tree", "tree", "chain", "decode", "prefill", "empty"]))
        n = {"tree": draw(st.integers(1, 32 * words)), "chain": draw(st.integers(1, 12)), "decode": 1,
             "prefill": draw(st.integers(1, 70)), "empty": 0}[kind]
        n = min(n, budget)
        budget -= n
        committed = draw(st.integers(0 if n else 1, 40))
        seqs.append(("causal" if kind in ("decode", "prefill", "empty") else kind, committed, n))
    return make_step(seed=draw(st.integers(0, 2**31 - 1)), page_size=draw(st.integers(1, 16)),
                     kv_heads=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 2, 4])),
                     head_dim=draw(st.sampled_from([16, 24, 64])), words=words, seqs=seqs)


def alibi_slopes_for(num_heads: int) -> torch.Tensor:
    return torch.tensor([2.0 ** -(8 * (h + 1) / num_heads) for h in range(num_heads)])


@st.composite
def variants(draw, num_heads: int):
    """(window, softcap, alibi_slopes), each on or off (window 1 included)."""
    return (draw(st.sampled_from([0, 0, 1, 3, 8, 17, 40])), draw(st.sampled_from([0.0, 0.0, 0.5, 30.0])),
            alibi_slopes_for(num_heads) if draw(st.booleans()) else None)


def quantize(step: Step, scheme: str, seed: int = 0):
    """The step's K/V written through the reference quantized write (garbage bytes, NaN patterns
    included, in every unwritten slot): the cache tensors and each sequence's dequantized K/V."""
    num_blocks, page_size, kv_heads, head_dim = step.k_cache.shape
    cache = get_scheme(scheme).allocate(num_blocks, page_size, kv_heads, head_dim).tensors()
    gen = torch.Generator().manual_seed(seed)
    for t in cache:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen, dtype=torch.uint8))
    keys, values = [], []
    for s in range(len(step.dense_k)):
        slots = step.slots(s)
        WRITE[scheme](step.dense_k[s], step.dense_v[s], *cache, slots)
        k_cache, v_cache, k_scale, v_scale = (t.flatten(0, 1)[slots] for t in cache)
        keys.append(DEQUANTIZE[scheme](k_cache, k_scale))
        values.append(DEQUANTIZE[scheme](v_cache, v_scale))
    return cache, keys, values
