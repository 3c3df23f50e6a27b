"""Compile-time self-check: the incremental program must compute what the cache-free graph computes.

The analysis proves what it recognises from the graph: each attention mask and bias for every
length (from their construction), the GQA layout on one sample run. Anything it cannot see (tokens
mixed outside attention, a value that depends on the step's length rather than the positions, a
pass bug) would make the transformed program silently wrong. So after compiling, :func:`self_check` runs the program the way the engine does,
on random token ids: two sequences in one stream, a prefill chunk, a second chunk, decode steps
and a multi-token verify, through a paged cache with the sequences' blocks interleaved. After every
step it compares the logits with the cache-free graph (as captured, before any cache pass) run on
each sequence's whole prefix. On a mismatch it re-runs both with the attention outputs recorded
and raises :class:`UnsupportedModelError` naming the first attention site whose values differ.

Tolerances: float32 caches must agree to float rounding, 16-bit caches to their precision. fp8
and int4 caches are lossy by design, and their noise can hide a subtle pattern error (a window of 8
changes a tiny model's logits by about 2%; int4 by up to 4%). So a program with a quantized cache
is checked twice: its structure through a float twin (the same program with each quantized cache
op swapped for the float one, a float cache, no weight prepacking), exactly; and the quantized
program itself with a tolerance that catches quantization bugs.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.fx as fx

from .analysis import Recorder, UnsupportedModelError, output_nodes, pick_output, sample_inputs
from ..kernels.quant_linear import ACT_QUANT_SCHEMES
from .program import AttentionMetadata, DecoderProgram

#: relative tolerance (of the reference's largest logit) by KV-cache storage. The quantized ones
#: only catch gross quantization bugs (their structure is checked exactly through the float twin):
#: on random ids SmolLM2's fp8 cache moves the logits by up to ~7% of the largest one.
_TOLERANCE = {"float32": 2e-3, "bfloat16": 1e-2, "float16": 5e-3, "fp8": 0.3, "int4": 0.5}
_QUANTIZED = ("fp8", "int4")
#: int4 weights round each linear's input to an int8 grid (``kernels/quant_linear.py``). A value
#: within float rounding of a grid midpoint rounds either way in the program and in the reference,
#: and the flip moves the next layers' inputs by a grid step, which flips more: the two differ by
#: the rounding's own noise (SmolLM2: about 3% of the largest logit), not by float rounding. Like a
#: quantized cache, such a program is checked exactly through a float twin and loosely itself.
_WEIGHT_TOLERANCE = {"int4": 0.3}


@dataclass
class _Step:
    kind: str
    chunks: list[tuple[int, int]]  # per sequence: (start position, new tokens)


# two sequences: chunked prefill, decodes, and a verify of several tokens at once
_SCHEDULE = [_Step("prefill chunk", [(0, 13), (0, 9)]), _Step("second prefill chunk", [(13, 6), (9, 1)]),
             _Step("decode", [(19, 1), (10, 1)]), _Step("decode", [(20, 1), (11, 1)]),
             _Step("multi-token verify", [(21, 5), (12, 3)]), _Step("decode", [(26, 1), (15, 1)])]
_LENGTHS = (27, 16)


def _tolerance(program: DecoderProgram, kv_dtype: str) -> float:
    if kv_dtype == "auto":
        kv_dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(
            program.layers[0].dtype, "float32")
    weights = _WEIGHT_TOLERANCE.get(program.compiled.context.options.weight_scheme, 0.0)
    return max(_TOLERANCE.get(kv_dtype, 2e-3), weights)


class _Reference:
    """The cache-free graph, run on a whole sequence."""

    def __init__(self, gm: fx.GraphModule, analysis):
        self.gm, self.analysis = gm, analysis
        self.ids_node = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == analysis.input_ids.name)
        self.sites = {n.meta["attention_site"]: n for n in gm.graph.nodes if "attention_site" in n.meta}
        self.logits_node = output_nodes(gm.graph)[analysis.logits_index]
        self.device = next(iter(gm.parameters()), torch.empty(0)).device
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}  # shared by the float twin's check and the program's

    def run(self, ids: list[int], record_sites: bool = False) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        if not record_sites and tuple(ids) in self._logits:
            return self._logits[tuple(ids)], {}
        args = sample_inputs(self.gm, self.ids_node, None, self.analysis.vocab_size, len(ids),
                             ids=torch.tensor([ids], device=self.device))
        with torch.no_grad():
            if not record_sites:
                logits = pick_output(self.gm(*args), self.analysis.logits_index)
                self._logits[tuple(ids)] = logits.reshape(len(ids), -1).float().cpu()
                return self._logits[tuple(ids)], {}
            rec = Recorder(self.gm, {self.logits_node} | set(self.sites.values()))
            rec.run(*args)
        logits = rec.values[self.logits_node].reshape(len(ids), -1).float().cpu()
        return logits, {layer: rec.values[n].cpu() for layer, n in self.sites.items()}


def self_check(program: DecoderProgram, kv_dtype: str = "auto", seed: int = 0) -> float:
    """Raise :class:`UnsupportedModelError` if the program disagrees with the cache-free graph.

    Returns the seconds the check took (the float twin's compile included).
    """
    t0 = time.perf_counter()
    ctx = program.compiled.context
    if ctx.cache_free_gm is None:
        raise RuntimeError("self_check needs the cache-free graph the annotate pass keeps")
    from ..passes.quantize_weights import lm_head_name

    scheme, head = ctx.options.weight_scheme, lm_head_name(ctx.analysis.logits)
    reference = _Reference(_with_weights(ctx.cache_free_gm, scheme, head, calibration=ctx.calibration), ctx.analysis)
    lossy = _lossy_parts(ctx.options, kv_dtype)
    if lossy:
        twin_reference = reference
        if scheme in ACT_QUANT_SCHEMES:
            twin_reference = _Reference(_with_weights(ctx.cache_free_gm, scheme, head, dequantized=True,
                                                      calibration=ctx.calibration), ctx.analysis)
        _check(float_twin(program), twin_reference, "auto", seed)
    _check(program, reference, kv_dtype, seed, lossy)
    return time.perf_counter() - t0


def _lossy_parts(options, kv_dtype: str) -> str | None:
    """What moves the program's logits by more than float rounding, in words (None: nothing)."""
    parts = []
    if kv_dtype in _QUANTIZED:
        parts.append(f"the {kv_dtype} KV cache")
    if options.weight_scheme in ACT_QUANT_SCHEMES:
        parts.append(f"the {options.weight_scheme} weights' input rounding")
    return " and ".join(parts) or None


def _with_weights(gm: fx.GraphModule, scheme: str | None, lm_head: str | None, dequantized: bool = False,
                  calibration=None) -> fx.GraphModule:
    """The cache-free graph with the program's weight format (``weight_dtype``) and codes (the same
    ``calibration``), so that the check compares like with like: quantized weights are a chosen
    loss, not the cache passes' business. ``dequantized``: float linears over the quantized
    weights' values (no input rounding)."""
    if scheme is None:
        return gm
    from ..passes.quantize_weights import dequantize_linears, quantize_linears
    from .passes import copy_graph_module

    gm = copy_graph_module(gm)
    quantize_linears(gm, scheme, lm_head, calibration=calibration)
    if dequantized:
        dequantize_linears(gm)
    gm.recompile()
    return gm


def float_twin(program: DecoderProgram) -> DecoderProgram:
    """The quantized program with a float cache and float linears: the same graph, each quantized
    cache write and attention swapped for the float op (see the module doc), and each linear that
    rounds its input (int4) swapped for a float linear over the same weight values. No pass runs again, so it costs a graph
    copy; the Hadamard rotation ``rotate_kv`` inserted stays (orthogonal: exact up to float rounding)."""
    from .backend import CompiledGraph
    from .passes import copy_graph_module
    from .program import _program
    from .signature import DecoderSignature, Role

    ctx = program.compiled.context
    gm = copy_graph_module(program.gm)
    weight_dtype = ctx.options.weight_dtype
    if ctx.options.weight_scheme in ACT_QUANT_SCHEMES:
        from ..passes.quantize_weights import dequantize_linears

        dequantize_linears(gm)
        weight_dtype = "auto"
    options = dataclasses.replace(ctx.options, kv_dtype="auto", kv_hot_window=None, weight_dtype=weight_dtype,
                                  prepack_weights=False,
                                  dump_dir=None, check="off")
    if ctx.kv_scheme is None:
        gm.recompile()
        twin_ctx = dataclasses.replace(ctx, options=options)
        return _program(CompiledGraph(program.compiled.captured, gm, twin_ctx, 0.0), options)
    scheme = ctx.kv_scheme
    signature = DecoderSignature(dict(ctx.signature.specs))
    if ctx.options.kv_hot_cold:  # the hot pages become the float cache; the cold ones go
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target == torch.ops.specgraph.paged_attention_mixed.default:
                node.target, node.args = torch.ops.specgraph.paged_attention.default, (*node.args[:3], *node.args[7:])
        for layer, parts in signature.caches(gm).items():
            for part in ("k", "v", "k_scale", "v_scale"):
                signature.remove(gm, parts[part])
            for part in ("k", "v"):
                signature.declare(parts[f"{part}_hot"], Role.CACHE, layer, part)
        gm.recompile()
        twin_ctx = dataclasses.replace(ctx, options=options, signature=signature, kv_scheme=None)
        return _program(CompiledGraph(program.compiled.captured, gm, twin_ctx, 0.0), options)
    # quantized op -> (float op, where k_scale, v_scale sit among its arguments)
    float_ops = {scheme.write_op.default: (torch.ops.specgraph.cache_write.default, 4),
                 scheme.attention_op.default: (torch.ops.specgraph.paged_attention.default, 3)}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in float_ops:
            op, at = float_ops[node.target]
            node.target, node.args = op, (*node.args[:at], *node.args[at + 2:])
    for layer, parts in signature.caches(gm).items():
        model_dtype = program.layers[layer].dtype
        for part in ("k", "v"):
            val = parts[part].meta["val"]
            parts[part].meta["val"] = val.new_empty((*val.shape[:3], program.layers[layer].head_dim),
                                                    dtype=model_dtype)
        for part in ("k_scale", "v_scale"):
            signature.remove(gm, parts[part])
    gm.recompile()
    twin_ctx = dataclasses.replace(ctx, options=options, signature=signature, kv_scheme=None)
    return _program(CompiledGraph(program.compiled.captured, gm, twin_ctx, 0.0), options)


def _check(program: DecoderProgram, reference: _Reference, kv_dtype: str, seed: int, lossy: str | None = None) -> None:
    page, vocab = program.page_size, program.vocab_size
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in _LENGTHS]
    # interleave the two sequences' blocks, so a slot or block-table mix-up shows
    blocks_each = -(-max(_LENGTHS) // page)
    tables = [[1 + 2 * i + s for i in range(blocks_each)] for s in range(len(seqs))]
    device = next(iter(program.gm.parameters()), torch.empty(0)).device
    cache = program.new_kv_cache(1 + 2 * blocks_each, device=device)
    tol = _tolerance(program, kv_dtype)
    for step in _SCHEDULE:
        ids, specs = [], []
        for s, (start, n) in enumerate(step.chunks):
            ids += seqs[s][start:start + n]
            specs.append((tables[s], start, n))
        meta = AttentionMetadata.build(specs, page, [list(range(n)) for _, n in step.chunks])
        stream = torch.tensor(ids, device=device)
        with torch.no_grad():
            got = program(stream, meta, cache).float().cpu()
        row = 0
        for s, (start, n) in enumerate(step.chunks):
            want, _ = reference.run(seqs[s][:start + n])
            want = want[start:start + n]
            scale = max(1.0, float(want.abs().max()))
            err = float((got[row:row + n] - want).abs().max())
            if not err <= tol * scale:  # NaN fails too
                if lossy:  # the float twin passed: the quantization itself is off
                    raise UnsupportedModelError(
                        f"compile-time self-check failed: {lossy} moves the logits by {err:.3g} (more than "
                        f"{tol:.0%} of their scale {scale:.3g}) in a {step.kind}, although the same program in "
                        f"float is exact; use kv_dtype='auto' / weight_dtype='int8' for this model")
                raise UnsupportedModelError(_diagnose(program, reference, stream, meta, cache, seqs[s], start, n,
                                                      row, step.kind, err, scale, tol))
            row += n


def _diagnose(program, reference, stream, meta, cache, seq, start, n, row, kind, err, scale, tol) -> str:
    """Name the first attention site whose output differs, re-running the failing step recorded."""
    tagged = {node.meta["attention_site"]: node for node in program.gm.graph.nodes if "attention_site" in node.meta}
    rec = Recorder(program.gm, set(tagged.values()))
    with torch.no_grad():
        rec.run(*program.graph_inputs(stream, meta.to(stream.device), cache))  # rewrites the same K/V: idempotent
    _, want_sites = reference.run(seq[:start + n], record_sites=True)
    where = "after every attention site agreed (the difference arises later in the layer stack)"
    for layer in sorted(tagged):
        if layer not in want_sites or tagged[layer] not in rec.values:
            continue
        got = rec.values[tagged[layer]].float()[..., row:row + n, :].cpu()  # [1, H, n, D]
        want = want_sites[layer].float()[..., start:start + n, :]
        if got.shape != want.shape:
            continue
        site_err = float((got - want).abs().max())
        if not site_err <= tol * max(1.0, float(want.abs().max())):
            site = program.compiled.context.analysis.sites[layer]
            where = (f"first at attention site layer {layer} ({site.kind} attention, node {site.output.name}): "
                     f"its output differs by {site_err:.3g}; something before it mixes tokens outside attention, "
                     f"or depends on the step's length rather than the positions (an op the analysis cannot see)")
            break
    return (f"compile-time self-check failed: the incremental program's logits differ from the cache-free "
            f"model's by {err:.3g} (tolerance {tol * scale:.3g}) in a {kind} at positions {start}..{start + n - 1}; "
            f"{where}. specgraph refuses the model rather than answer wrongly; Engine(self_check=False) skips this "
            f"check (at your own risk)")
