"""kv_cache: every attention site writes its new K/V into a cache and attends over the cache.

Invariant: for a token stream holding whole sequences (a prefill into an empty cache), the
outputs are unchanged; for any stream, each token attends exactly to the K/V of positions
``0..position`` of its own sequence, wherever those were computed.

The cache here is contiguous, one row per sequence (``[rows, max_len, kv_heads, head_dim]``);
``paging`` then addresses it through block tables. New inputs: ``cache_rows [S]``,
``seq_lens [S]``, ``query_start_loc [S+1]`` and ``k_cache_<l>``/``v_cache_<l>`` per layer.

Before / after (one site)::

    o = aten.scaled_dot_product_attention(q, repeat(k), repeat(v), mask, is_causal=...)   # [1, H, N, D]
    ->
    specgraph.contiguous_cache_write(k^T [N, KVH, D], v^T, k_cache_0, v_cache_0, cache_rows, qsl, positions)
    o = specgraph.contiguous_attention(q^T [N, H, D], k_cache_0, v_cache_0, cache_rows, seq_lens, qsl,
                                       positions, scale, window, softcap, alibi_slopes) -> [1, H, N, D]
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import kernels  # noqa: F401  (registers the specgraph:: ops)
from ..compiler.passes import PassContext, PassResult
from ..kernels import contiguous  # noqa: F401
from ..compiler.signature import Role
from .graph_utils import fake_like, refresh_meta, remove_dead_code

aten = torch.ops.aten
specgraph = torch.ops.specgraph


def cache_dtype(ctx: PassContext, model_dtype: torch.dtype) -> torch.dtype:
    kv = ctx.options.kv_dtype
    if kv == "auto":
        return model_dtype
    if ctx.options.kv_cold_scheme is not None:
        return model_dtype  # a float cache here; the kv_quant pass swaps in the quantized layout
    return getattr(torch, kv)


def _tokens_major(g: fx.Graph, x: fx.Node, heads: int, head_dim: int) -> fx.Node:
    """[1, heads, N, D] -> [N, heads, D] (contiguous)."""
    t = g.call_function(aten.transpose.int, (x, 1, 2))
    return g.call_function(aten.reshape.default, (t, [-1, heads, head_dim]))


def _variant(gm: fx.GraphModule, site) -> tuple:
    """The site's proved score modifiers as the attention op's trailing arguments (ALiBi slopes: a buffer)."""
    slopes = None
    if site.alibi_slopes is not None:
        name = f"alibi_slopes_{site.layer}"
        gm.register_buffer(name, site.alibi_slopes.to(site.q.meta["val"].device))
        slopes = gm.graph.get_attr(name)
    return site.window, site.softcap, slopes


def kv_cache(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    analysis = ctx.analysis
    g = gm.graph
    sig = ctx.signature
    positions = sig.input(gm, Role.POSITIONS)
    n_seq = 1
    rows = sig.add(gm, "cache_rows", fake_like(gm, (n_seq,), torch.int32), Role.CACHE_ROWS)
    seq_lens = sig.add(gm, "seq_lens", fake_like(gm, (n_seq,), torch.int32), Role.SEQ_LENS)
    qsl = sig.add(gm, "query_start_loc", fake_like(gm, (n_seq + 1,), torch.int32), Role.QUERY_START)
    T = int(ctx.sample_inputs["positions"].numel()) if "positions" in ctx.sample_inputs else 1
    for site in analysis.sites:
        dtype = cache_dtype(ctx, site.q.meta["val"].dtype)
        shape = (n_seq, T, site.kv_heads, site.head_dim)
        kc = sig.add(gm, f"k_cache_{site.layer}", fake_like(gm, shape, dtype), Role.CACHE, site.layer, "k")
        vc = sig.add(gm, f"v_cache_{site.layer}", fake_like(gm, shape, dtype), Role.CACHE, site.layer, "v")
        with g.inserting_before(site.output):
            k = _tokens_major(g, site.k, site.kv_heads, site.head_dim)
            v = _tokens_major(g, site.v, site.kv_heads, site.head_dim)
            q = _tokens_major(g, site.q, site.heads, site.head_dim)
            g.call_function(specgraph.contiguous_cache_write.default, (k, v, kc, vc, rows, qsl, positions))
            o = g.call_function(specgraph.contiguous_attention.default,
                                (q, kc, vc, rows, seq_lens, qsl, positions, site.scale,
                                 *_variant(gm, site)))
            o = g.call_function(aten.unsqueeze.default, (o, 0))
            o = g.call_function(aten.transpose.int, (o, 1, 2))
            if len(site.output.meta["val"].shape) == 3:  # [B * heads, T, D], as Bloom's bmm gives it
                o = g.call_function(aten.flatten.using_ints, (o, 0, 1))
        site.output.replace_all_uses_with(o)
        o.meta["attention_site"] = site.layer  # the self-check compares it with the cache-free graph's
    remove_dead_code(g)
    if "positions" in ctx.sample_inputs:
        ctx.sample_inputs.update(
            cache_rows=torch.zeros(1, dtype=torch.int32), seq_lens=torch.tensor([T], dtype=torch.int32),
            query_start_loc=torch.tensor([0, T], dtype=torch.int32))
        for site in analysis.sites:
            dtype = cache_dtype(ctx, site.q.meta["val"].dtype)
            for prefix in ("k", "v"):
                ctx.sample_inputs[f"{prefix}_cache_{site.layer}"] = torch.zeros(
                    1, T, site.kv_heads, site.head_dim, dtype=dtype)
    refresh_meta(gm)
    lossy = any(cache_dtype(ctx, s.q.meta["val"].dtype) != s.q.meta["val"].dtype for s in analysis.sites)
    return PassResult(matched=len(analysis.sites), check_atol=0.05 if lossy else None)
