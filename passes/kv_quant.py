"""kv_quant: the paged KV cache is stored as FP8 (e4m3) or INT4; attention dequantizes inside.

Invariant: outputs equal those of the float cache up to the quantization error of K and V
(checked with a loose tolerance on sample inputs); nothing else changes. Only the pages attention
reads are dequantized, inside the kernel (the Triton kernels dequantize tiles in registers; the
CPU reference dequantizes the gathered pages of one sequence): no full-precision copy of the
cache ever exists. Schemes (``kernels/quant.py``): FP8 with one float32 scale per token and kv
head; INT4 packed two per byte with a float16 (scale, min) per group along head_dim.

Before / after::

    specgraph.cache_write(k, v, k_cache_0, v_cache_0, slot_mapping)
    o = specgraph.paged_attention(q, k_cache_0, v_cache_0, block_tables, ...)
    ->
    specgraph.cache_write_fp8(k, v, k_cache_0, v_cache_0, k_scale_0, v_scale_0, slot_mapping)
    o = specgraph.paged_attention_fp8(q, k_cache_0, v_cache_0, k_scale_0, v_scale_0, block_tables, ...)

With a hot window (``options.kv_hot_cold``: fp8 / int4 with ``kv_hot_window > 0``, or ``adaptive``)
the cache is hot/cold (``kernels/hot_cold.py``): new inputs ``k_hot_0, v_hot_0`` hold float pages,
the runtime keeps every written slot in them and quantizes whole pages as they leave the window::

    specgraph.cache_write(k, v, k_hot_0, v_hot_0, slot_mapping)
    o = specgraph.paged_attention_mixed(q, k_hot_0, v_hot_0, k_cache_0, v_cache_0, k_scale_0, v_scale_0, ...)

Its invariant is the float cache's exactly while every page is hot (the compile-time self-check
runs so); demoted pages add their scheme's quantization error.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..compiler.passes import PassContext, PassResult
from ..kernels.quant import get_scheme
from ..compiler.signature import Role
from .graph_utils import refresh_meta

specgraph = torch.ops.specgraph


def kv_quant(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    kind = ctx.options.kv_cold_scheme
    if kind is None:
        return PassResult(modified=False)
    scheme = get_scheme(kind)
    hot_cold = ctx.options.kv_hot_cold
    g = gm.graph
    page = ctx.options.page_size
    sig = ctx.signature
    layers = {}
    for layer, parts in sig.caches(gm).items():
        kc, vc = parts["k"], parts["v"]
        kv_heads, head_dim = kc.meta["val"].shape[2:]
        float_val = kc.meta["val"]
        fake = scheme.allocate(1, page, kv_heads, head_dim, device="meta")
        with gm.meta["fake_mode"]:
            fakes = [torch.empty(t.shape, dtype=t.dtype) for t in fake.tensors()]
            hot_fake = torch.empty(float_val.shape, dtype=float_val.dtype)
        kc.meta["val"], vc.meta["val"] = fakes[0], fakes[1]
        ks = sig.add(gm, f"k_scale_{layer}", fakes[2], Role.CACHE, layer, "k_scale")
        vs = sig.add(gm, f"v_scale_{layer}", fakes[3], Role.CACHE, layer, "v_scale")
        hot = None
        if hot_cold:
            hot = (sig.add(gm, f"k_hot_{layer}", hot_fake, Role.CACHE, layer, "k_hot"),
                   sig.add(gm, f"v_hot_{layer}", hot_fake.clone(), Role.CACHE, layer, "v_hot"))
        layers[kc] = (vc, ks, vs, hot)
    matched = 0
    for node in list(g.nodes):
        if node.op != "call_function":
            continue
        if node.target == specgraph.cache_write.default:
            k, v, kc, vc, slots = node.args
            _, ks, vs, hot = layers[kc]
            if hot is not None:  # writes go to the hot pages, as they are
                node.update_arg(2, hot[0])
                node.update_arg(3, hot[1])
            else:
                with g.inserting_before(node):
                    g.call_function(scheme.write_op.default, (k, v, kc, vc, ks, vs, slots))
                g.erase_node(node)
            matched += 1
        elif node.target == specgraph.paged_attention.default:
            q, kc, vc, *rest = node.args
            _, ks, vs, hot = layers[kc]
            with g.inserting_before(node):
                if hot is not None:
                    new = g.call_function(specgraph.paged_attention_mixed.default, (q, *hot, kc, vc, ks, vs, *rest))
                else:
                    new = g.call_function(scheme.attention_op.default, (q, kc, vc, ks, vs, *rest))
            node.replace_all_uses_with(new)
            g.erase_node(node)
    ctx.kv_scheme = scheme
    if "positions" in ctx.sample_inputs:
        for kc, (vc, ks, vs, hot) in layers.items():
            sample = ctx.sample_inputs[kc.name]
            num_blocks, _, kv_heads, head_dim = sample.shape
            cache = scheme.allocate(num_blocks, page, kv_heads, head_dim)
            for name, t in zip((kc.name, vc.name, ks.name, vs.name), cache.tensors()):
                ctx.sample_inputs[name] = t
            if hot is not None:  # every sample page hot: ids below num_blocks
                ctx.sample_inputs[hot[0].name], ctx.sample_inputs[hot[1].name] = sample.clone(), sample.clone()
    sig.input(gm, Role.SLOTS)  # the pass runs after paging
    refresh_meta(gm)
    return PassResult(matched=matched, info={"scheme": kind, "hot_cold": hot_cold})
