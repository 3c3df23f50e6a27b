"""The order of the built-in passes, in one place.

Phase 1 (every capture): make the graph canonical and find out what it is.
    normalize   drop no-ops and dead code
    annotate    attention sites, positions, embedding, logits; sympy shapes in node meta
Phase 2 (decoder programs): turn the cache-free graph into an incremental, paged decoder.
    positions   token positions become a program input (no more arange over the sequence)
    kv_cache    each attention site writes its new K/V to a cache and attends over the cache
    paging      the cache is addressed through block tables and slot mappings
    rotate_kv   (kv_dtype fp8/int4) attention in a Hadamard-rotated basis, spreading K's outlier channels
    kv_quant    (kv_dtype fp8/int4) quantize on write, dequantize inside attention
    tree_mask   (tree_nodes > 0) attention takes the step's token-tree mask
    cleanup     dead mask construction and aranges removed
    select_logits  the LM head runs only on the rows whose logits are needed
    hidden_states  (hidden_states) the LM head's input, every token's, becomes an output too (a draft head's features)
    fuse_linears   linears reading one input (q/k/v, gate/up) become one linear over stacked weights
    quantize_weights  (weight_dtype bfloat16/int8/fp8/int4) linears read quantized weights
The backend's own (cache-free) graph runs phase 1 and quantize_weights.
"""
from __future__ import annotations

from .passes import GraphPass
from ..passes.annotate import annotate
from ..passes.normalize import normalize

CAPTURE_PASSES = [GraphPass(normalize, "normalize"), GraphPass(annotate, "annotate")]


def backend_passes() -> list[GraphPass]:
    from ..passes.quantize_weights import quantize_weights

    return CAPTURE_PASSES + [GraphPass(quantize_weights, "quantize_weights")]


def decoder_passes() -> list[GraphPass]:
    from ..passes.cleanup import cleanup
    from ..passes.fuse_linears import fuse_linears
    from ..passes.hidden_states import hidden_states
    from ..passes.kv_cache import kv_cache
    from ..passes.kv_quant import kv_quant
    from ..passes.paging import paging
    from ..passes.positions import positions
    from ..passes.quantize_weights import quantize_weights
    from ..passes.rotate_kv import rotate_kv
    from ..passes.select_logits import select_logits
    from ..passes.tree_mask import tree_mask

    return CAPTURE_PASSES + [GraphPass(positions, "positions"), GraphPass(kv_cache, "kv_cache"),
                             GraphPass(paging, "paging"), GraphPass(rotate_kv, "rotate_kv"),
                             GraphPass(kv_quant, "kv_quant", check_atol=0.25), GraphPass(tree_mask, "tree_mask"),
                             GraphPass(cleanup, "cleanup"),
                             GraphPass(select_logits, "select_logits"), GraphPass(hidden_states, "hidden_states"),
                             GraphPass(fuse_linears, "fuse_linears"),
                             GraphPass(quantize_weights, "quantize_weights")]
