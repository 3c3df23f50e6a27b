"""quantize_weights: linears over constant weights read those weights quantized (``weight_dtype``).

Invariant: every rewritten linear computes ``quant_linear_ref(x, Q(W), b)``, i.e.
``x @ dequantize(Q(W)).T + b`` (for int4 with ``x`` on its per-32 int8 grid;
``kernels/quant_linear.py``), where ``Q(W)`` is ``quantize_weight(W)`` (nearest codes) or, with
``options.weight_calibration``, GPTQ's codes in the same format and scales
(``compiler/calibration.py``); nothing else in the graph changes. The check is
``tests/test_quantize_weights.py``: the rewritten graph equals the original run through the
reference op over the quantized weights (and the compile-time self-check compares the program with
the cache-free graph holding the same codes).

Before / after (int8)::

    y = aten.linear(x, w, b)                      # w: float [N, K] constant
    ->
    y = specgraph.quant_linear(x, w_int8, w_int8_scale, b, "int8")
                                                  # w_int8: int8 [N, K], w_int8_scale: float32 [N]

Which linears: ``aten.linear`` (and ``aten.addmm(b, x, w)``, GPT-2's Conv1D, whose ``w`` is
stored transposed) whose weight is a float ``get_attr`` constant of two dims; for
int4 also an input size divisible by 32 (the input rounding's block) and by the group.
Others stay float and are counted in the pass log (``kept_float``). Bias stays float. A weight
read by several linears (a tied LM head shares the embedding's) is quantized once per scheme.

The LM head (the linear that computes the logits the analysis found) stays 8-bit under int4 and fp8
(:data:`HEAD_SCHEME`): it is the layer whose error reaches the logits undiluted. On SmolLM2
(perplexity over 1,024 tokens of prose, every other linear in the scheme) an int4 head costs
+6.7% against +0.9% with an int8 one, an fp8 head +5.2% against +2.0%; llama.cpp's 4-bit files
keep their output matrix at 6 bits or more for the same reason. It is a fifth of SmolLM2's
weight bytes.

The embedding lookup keeps its float table: it reads one row per token (a few KB per step, not
a bandwidth cost), and quantizing it would add a rounding error to every token's input for no
speed. A tied LM head therefore gets its own quantized copy of the table (the LM head streams all
of it every step: on SmolLM2 it is a fifth of the weights).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from ..compiler.calibration import context_calibration
from ..compiler.passes import PassContext, PassResult
from ..kernels.quant_linear import ACT_BLOCK, ACT_QUANT_SCHEMES, WEIGHT_SCHEMES, dequantize_weight, quantize_weight
from .graph_utils import attr_value

if TYPE_CHECKING:
    from ..compiler.calibration import Calibration

INT4_GROUP = 32  # columns per (scale, min) pair of an int4 weight
HEAD_SCHEME = {"int4": "int8", "fp8": "int8"}  # the LM head's scheme where it differs (module docstring)


def lm_head_name(logits: fx.Node | None) -> str | None:
    """The name of the linear that computes the logits: the logits node itself, or the nearest linear
    up its first-argument chain (a soft cap or a scale may follow it); None when there is none."""
    node = logits
    for _ in range(8):
        if not isinstance(node, fx.Node) or node.op != "call_function":
            return None
        if node.target in (torch.ops.aten.linear.default, torch.ops.specgraph.quant_linear.default):
            return node.name
        node = node.args[0] if node.args else None
    return None


def quantize_linears(gm: fx.GraphModule, scheme: str, lm_head: str | None = None, group: int = INT4_GROUP,
                     calibration: "Calibration | None" = None) -> tuple[int, int]:
    """Rewrite ``gm``'s constant-weight linears to ``specgraph::quant_linear`` in ``scheme`` (the node
    named ``lm_head`` in ``HEAD_SCHEME``'s). With ``calibration``, int8 and fp8 weights get GPTQ's
    codes (``compiler/calibration.py``), else the nearest ones. Returns ``(rewritten, kept_float)``."""
    if scheme not in WEIGHT_SCHEMES:
        raise ValueError(f"unknown weight scheme {scheme!r}; valid: {', '.join(WEIGHT_SCHEMES)}")
    quantized: dict[tuple, tuple[str, str | None]] = {}  # (weight, scheme, transposed) -> (data, scales) targets
    rewritten = kept = 0
    body_scheme = scheme
    for node in list(gm.graph.nodes):
        matched = constant_weight_linear(gm, node)
        if matched is None:
            continue
        x, w_node, bias, transposed = matched
        w = attr_value(gm, w_node.target)
        w = w.t() if transposed else w
        k = w.shape[1]
        scheme = HEAD_SCHEME.get(body_scheme, body_scheme) if node.name == lm_head else body_scheme
        if scheme in ACT_QUANT_SCHEMES and (k % ACT_BLOCK or (scheme == "int4" and k % group)):
            kept += 1
            continue
        key = (w_node.target, scheme, transposed)
        if key not in quantized:
            parts = node.meta.get("fused_from") or [(w_node.target, w.shape[0])]
            data, scales = _quantize(w, scheme, group, parts, calibration)
            stem = w_node.target.replace(".", "_") + f"_{scheme}" + ("_t" if transposed else "")
            gm.register_buffer(stem, data.to(w.device))
            if scales is not None:
                gm.register_buffer(stem + "_scale", scales.to(w.device))
            quantized[key] = (stem, stem + "_scale" if scales is not None else None)
        data_target, scale_target = quantized[key]
        with gm.graph.inserting_before(node):
            data_node = gm.graph.get_attr(data_target)
            scale_node = gm.graph.get_attr(scale_target) if scale_target is not None else None
        node.target = torch.ops.specgraph.quant_linear.default
        node.args, node.kwargs = (x, data_node, scale_node, bias, scheme), {}
        if not w_node.users:
            gm.graph.erase_node(w_node)
        rewritten += 1
    return rewritten, kept  # (each rewritten node keeps its output's metadata: same shape and dtype)


def _quantize(w: torch.Tensor, scheme: str, group: int, parts: list[tuple[str, int]],
              calibration: "Calibration | None") -> tuple[torch.Tensor, torch.Tensor | None]:
    """``w``'s codes and scales: calibrated when every part (``(weight name, rows)``, stacked in
    order) has statistics, else rounded to nearest."""
    solved = calibration.quantize(parts, w, scheme) if calibration is not None else None
    if solved is not None:
        return solved[0].to(w.device), solved[1].to(w.device)
    return quantize_weight(w, scheme, group)


def constant_weight_linear(gm: fx.GraphModule, node: fx.Node):
    """``(x, weight node, bias, transposed)`` when ``node`` is a linear over a float constant weight:
    ``aten.linear(x, w[, b])`` (``w [N, K]``) or ``aten.addmm(b, x, w)`` with ``w [K, N]`` (GPT-2's
    Conv1D); else None."""
    if node.op != "call_function":
        return None
    if node.target == torch.ops.aten.linear.default and not node.kwargs:
        x, w_node, bias, transposed = node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else None, False
    elif node.target == torch.ops.aten.addmm.default and not node.kwargs and len(node.args) == 3:
        bias, x, w_node = node.args
        transposed = True
        if not (isinstance(bias, fx.Node) and bias.op == "get_attr"
                and isinstance(attr_value(gm, bias.target), torch.Tensor) and attr_value(gm, bias.target).dim() == 1):
            return None
    else:
        return None
    if not (isinstance(w_node, fx.Node) and w_node.op == "get_attr"):
        return None
    w = attr_value(gm, w_node.target)
    if not (isinstance(w, torch.Tensor) and w.dim() == 2 and w.is_floating_point()):
        return None
    return x, w_node, bias, transposed


def dequantize_linears(gm: fx.GraphModule) -> int:
    """The float view of a quantized graph: each ``quant_linear`` -> ``aten.linear`` over its weight
    dequantized to float32 (no input rounding). Self-checks use it to compare structure exactly."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.specgraph.quant_linear.default:
            continue
        x, data_node, scale_node, bias, scheme = node.args
        data = attr_value(gm, data_node.target)
        scales = attr_value(gm, scale_node.target) if scale_node is not None else None
        name = data_node.target.replace(".", "_") + "_dequantized"
        if not hasattr(gm, name):
            gm.register_buffer(name, dequantize_weight(data, scales, scheme))
        with gm.graph.inserting_before(node):
            w_node = gm.graph.get_attr(name)
        node.target = torch.ops.aten.linear.default
        node.args = (x, w_node, bias)
        count += 1
    gm.graph.eliminate_dead_code()
    return count


def quantize_weights(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """The pass: ``ctx.options.weight_dtype`` decides the scheme (``"auto"``: nothing to do)."""
    scheme = ctx.options.weight_scheme
    if scheme is None:
        return PassResult(modified=False)
    head = lm_head_name(ctx.analysis.logits) if ctx.analysis is not None else None
    calibration = context_calibration(ctx)
    rewritten, kept = quantize_linears(gm, scheme, head, calibration=calibration)
    info = {"kept_float": kept} if kept else {}
    if calibration is not None:
        info["calibration_tokens"] = calibration.tokens
    return PassResult(modified=rewritten > 0, matched=rewritten, info=info,
                      check_atol=float("inf"))  # lossy by design: tests/test_quantize_weights.py states the bounds
