"""paging: the KV cache is addressed through block tables and slot mappings.

Invariant: outputs are unchanged for any block-table assignment (blocks anywhere in the pool,
in any order, shared between sequences for a common prefix): attention reads a sequence's
position ``j`` from ``block_tables[s, j // page_size]`` and the new K/V is written to
``slot_mapping[i]``, wherever the runtime placed them.

Before / after::

    specgraph.contiguous_cache_write(k, v, kc, vc, cache_rows, qsl, positions)
    o = specgraph.contiguous_attention(q, kc, vc, cache_rows, seq_lens, qsl, positions, scale)
    ->
    specgraph.cache_write(k, v, kc, vc, slot_mapping)                   # kc: [blocks, page, KVH, D]
    o = specgraph.paged_attention(q, kc, vc, block_tables, seq_lens, qsl, positions, scale, *variant)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..compiler.passes import PassContext, PassResult
from ..compiler.signature import Role
from .graph_utils import fake_like, refresh_meta

specgraph = torch.ops.specgraph


def sample_paging(T: int, page_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A scrambled block table for one sequence of T tokens (block 0 stays the null block)."""
    n_blocks = -(-T // page_size)
    num_blocks = 2 * n_blocks + 1
    gen = torch.Generator().manual_seed(seed)
    table = (torch.randperm(num_blocks - 1, generator=gen)[:n_blocks] + 1).to(torch.int32)
    pos = torch.arange(T)
    slots = table.long()[pos // page_size] * page_size + pos % page_size
    return table.view(1, -1), slots, num_blocks


def paging(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    g = gm.graph
    page = ctx.options.page_size
    sig = ctx.signature
    rows = sig.input(gm, Role.CACHE_ROWS)
    tables = sig.add(gm, "block_tables", fake_like(gm, (1, 1), torch.int32), Role.BLOCK_TABLES)
    slot_mapping = sig.add(gm, "slot_mapping", sig.input(gm, Role.POSITIONS).meta["val"].clone(), Role.SLOTS)
    matched = 0
    for node in list(g.nodes):
        if node.op != "call_function":
            continue
        if node.target == specgraph.contiguous_cache_write.default:
            k, v, kc, vc, _rows, _qsl, _pos = node.args
            with g.inserting_before(node):
                g.call_function(specgraph.cache_write.default, (k, v, kc, vc, slot_mapping))
            g.erase_node(node)
            matched += 1
        elif node.target == specgraph.contiguous_attention.default:
            q, kc, vc, _rows, seq_lens, qsl, pos, scale, *variant = node.args
            with g.inserting_before(node):
                new = g.call_function(specgraph.paged_attention.default,
                                      (q, kc, vc, tables, seq_lens, qsl, pos, scale, *variant))
            node.replace_all_uses_with(new)
            g.erase_node(node)
    sig.remove(gm, rows)
    caches = [c for parts in sig.caches(gm).values() for c in parts.values()]
    for c in caches:
        val = c.meta["val"]
        c.meta["val"] = fake_like(gm, (1, page, *val.shape[2:]), val.dtype)
    if "positions" in ctx.sample_inputs:
        T = int(ctx.sample_inputs["positions"].numel())
        table, slots, num_blocks = sample_paging(T, page)
        ctx.sample_inputs.pop("cache_rows", None)
        ctx.sample_inputs.update(block_tables=table, slot_mapping=slots)
        for c in caches:
            value = ctx.sample_inputs[c.name]
            ctx.sample_inputs[c.name] = value.new_zeros(num_blocks, page, *value.shape[2:])
    refresh_meta(gm)
    return PassResult(matched=matched)
