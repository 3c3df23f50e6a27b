"""rotate_kv: attention runs in a rotated basis per head, so outlier channels of K spread out.

Invariant: outputs are unchanged (up to float rounding): for an orthonormal ``R``,
``(q R)(k R)^T = q k^T`` and ``softmax(.) (v R) R^T = softmax(.) v``. Used before ``kv_quant``
(the idea of QuaRot, arXiv 2404.00456, applied to the KV cache only, as a graph rewrite: no
kernel changes):

* INT4: SmolLM2's keys have a few channels about 8x larger than the median, and one
  (scale, min) per group of channels spends its 16 levels on them; after a Hadamard rotation
  every channel carries a share of the outliers, so the same bits lose less.
* FP8: e4m3's error is relative per element, so the logit error ``sum_i q_i k_i d_i`` is
  dominated by the channels where q and k are both large (SmolLM2's outlier channels are large
  in both); rotated, those products spread over all channels and their rounding errors
  average out. Measured on SmolLM2 (``benchmarks/bench_kv_quant.py``, 5,246 tokens, chunk 16):
  perplexity +1.19% over float32 without the rotation, +0.66% with it.

Before / after::

    specgraph.cache_write(k, v, kc, vc, slot_mapping)
    o = specgraph.paged_attention(q, kc, vc, ...)
    ->
    specgraph.cache_write(k @ R, v @ R, kc, vc, slot_mapping)
    o = specgraph.paged_attention(q @ R, kc, vc, ...) @ R^T
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from ..compiler.passes import PassContext, PassResult
from .graph_utils import refresh_meta

aten = torch.ops.aten
specgraph = torch.ops.specgraph


def orthonormal_rotation(dim: int) -> torch.Tensor:
    """A normalized Hadamard matrix for powers of two, else a seeded random orthonormal one."""
    if dim & (dim - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return h / math.sqrt(dim)
    q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=torch.Generator().manual_seed(0)))
    return q


def rotate_kv(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    if ctx.options.kv_cold_scheme is None:
        return PassResult(modified=False)
    g = gm.graph
    rotations: dict[int, tuple[fx.Node, fx.Node]] = {}

    def rotation(like: torch.Tensor) -> tuple[fx.Node, fx.Node]:
        """The rotation (and its transpose) for ``like``'s head size, in its dtype, on its device."""
        head_dim = like.shape[-1]
        if head_dim not in rotations:
            r = orthonormal_rotation(head_dim).to(like.device, like.dtype)
            gm.register_buffer(f"kv_rotation_{head_dim}", r)
            gm.register_buffer(f"kv_rotation_{head_dim}_t", r.t().contiguous())
            first = next(n for n in g.nodes if n.op != "placeholder")
            with g.inserting_before(first):
                rotations[head_dim] = (g.get_attr(f"kv_rotation_{head_dim}"), g.get_attr(f"kv_rotation_{head_dim}_t"))
        return rotations[head_dim]

    matched = 0
    for node in list(g.nodes):
        if node.op != "call_function":
            continue
        if node.target == specgraph.cache_write.default:
            k, v = node.args[:2]
            r, _ = rotation(k.meta["val"])
            with g.inserting_before(node):
                node.update_arg(0, g.call_function(aten.matmul.default, (k, r)))
                node.update_arg(1, g.call_function(aten.matmul.default, (v, r)))
            matched += 1
        elif node.target == specgraph.paged_attention.default:
            q = node.args[0]
            r, rt = rotation(q.meta["val"])
            with g.inserting_before(node):
                node.update_arg(0, g.call_function(aten.matmul.default, (q, r)))
            with g.inserting_after(node):
                back = g.call_function(aten.matmul.default, (node, rt))
            node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
    refresh_meta(gm)
    return PassResult(matched=matched)
