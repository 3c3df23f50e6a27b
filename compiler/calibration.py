"""Calibrated weight quantization: GPTQ rounding from each linear's input statistics.

Rounding every weight to its nearest code (RTN) treats all errors alike. A linear's output error
on inputs ``X`` is ``||X (W - Q)^T||``: what matters is the error along the directions the inputs
take. GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers") quantizes one input column at a time and spreads each column's
rounding error over the columns not yet quantized, weighted by the inverse of the inputs' second
moment ``H = X^T X / n``; columns go in order of decreasing ``H`` diagonal ("act order"), and
``H`` is damped by 10% of its mean diagonal. The result is still the format of
``kernels/quant_linear.py``: the same per-channel scales (``amax / max code``, fixed up front),
codes on the same grid, so every kernel runs it unchanged. Rows are independent given ``H``, so a
fused linear's stacked weight is solved at once and its parts' codes are reused for the unfused
graph the self-check runs.

``H`` comes from the cache-free graph (as captured) run on calibration token ids in chunks, each
chunk a sequence from position 0 (:func:`linear_input_hessians`). Measured on SmolLM2-135M with
the built-in texts (:func:`builtin_calibration_texts`; perplexity against float32 over 1,024 tokens
of two texts it does not contain, prose and code): fp8 +1.90% / +3.13% with RTN, +1.12% / +1.07%
with GPTQ. int4 keeps RTN: its groups' (scale, min) already follow each group's own range.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.fx as fx

from ..kernels.quant import FP8_DTYPE, FP8_MAX
from ..kernels.quant_linear import INT8_MAX

CALIBRATED_SCHEMES = ("int8", "fp8")
CHUNK = 512  # tokens per calibration sequence
_DAMP = 0.1  # of H's mean diagonal; 0.01 (GPTQ's default) swung more with the calibration text here
_BLOCK = 128  # columns whose error updates are applied to the rest at once


def builtin_calibration_texts() -> dict[str, str]:
    """Text every Python installation has: ``code``, the source of ``argparse``; ``prose``, the
    docstrings of a few standard-library modules and their public members. The benchmarks'
    evaluation texts (``benchmarks/data/eval_text.txt``, from the Language Reference, and
    ``textwrap``'s source) are not in it."""
    import argparse
    import collections
    import functools
    import heapq
    import itertools
    import logging
    import pathlib
    import subprocess

    docs = []
    for module in (subprocess, collections, functools, itertools, heapq, logging, pathlib):
        docs.append(inspect.getdoc(module) or "")
        for name in sorted(getattr(module, "__all__", ())):
            doc = inspect.getdoc(getattr(module, name, None))
            if doc and not name.startswith("_"):
                docs.append(f"{name}\n{doc}")
    return {"code": inspect.getsource(argparse)[:16000], "prose": "\n\n".join(docs)[:16000]}


def builtin_calibration_ids(tokenizer, tokens: int = 4096) -> tuple[int, ...]:
    """The first ``tokens // 2`` tokens of each built-in text (code, then prose)."""
    texts = builtin_calibration_texts()
    ids = tokenizer(texts["code"], add_special_tokens=False)["input_ids"][:tokens // 2]
    ids += tokenizer(texts["prose"], add_special_tokens=False)["input_ids"][:tokens - len(ids)]
    return tuple(int(i) for i in ids)


def linear_input_hessians(gm: fx.GraphModule, analysis, ids: Sequence[int], chunk: int = CHUNK
                          ) -> dict[str, torch.Tensor]:
    """``H = X^T X / n`` (float32 ``[K, K]``) of every constant-weight linear's input ``X``, by the
    weight's attribute name, over the cache-free graph run on ``ids`` in chunks of ``chunk``."""
    from ..passes.quantize_weights import constant_weight_linear
    from .analysis import sample_inputs

    sums: dict[fx.Node, torch.Tensor] = {}  # by input node: q, k and v (gate and up) share one
    counts: dict[fx.Node, int] = {}
    inputs: dict[str, fx.Node] = {}  # weight name -> its linear's input node

    class _Recorder(fx.Interpreter):
        def run_node(self, node):
            matched = constant_weight_linear(self.module, node)
            if matched is not None:
                x_node = matched[0]
                inputs[matched[1].target] = x_node
                if x_node not in done:  # once per chunk
                    done.add(x_node)
                    x = self.env[x_node].detach()
                    x = x.reshape(-1, x.shape[-1]).float()
                    sums[x_node] = sums.get(x_node, 0) + (x.T @ x).double()
                    counts[x_node] = counts.get(x_node, 0) + x.shape[0]
            return super().run_node(node)

    if ids and (min(ids) < 0 or max(ids) >= analysis.vocab_size):
        raise ValueError(f"weight_calibration holds token ids outside the model's vocabulary 0..{analysis.vocab_size - 1}")
    ids_node = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == analysis.input_ids.name)
    device = next(iter(gm.parameters()), torch.empty(0)).device
    recorder = _Recorder(gm)
    done: set[fx.Node] = set()  # inputs recorded in this chunk
    with torch.no_grad():
        for start in range(0, len(ids), chunk):
            part = list(ids[start:start + chunk])
            if len(part) < 2:
                continue
            done.clear()
            args = sample_inputs(gm, ids_node, None, analysis.vocab_size, len(part),
                                 ids=torch.tensor([part], device=device))
            recorder.run(*args)
    means = {x: (sums[x] / counts[x]).float().cpu() for x in sums}
    return {t: means[x] for t, x in inputs.items()}  # linears reading one input share one tensor


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> ``(codes, scales)`` in ``scheme``'s format (int8 or fp8, per-channel scales),
    the codes chosen by GPTQ against ``hessian [K, K]`` (module docstring)."""
    if scheme not in CALIBRATED_SCHEMES:
        raise ValueError(f"GPTQ rounding is for {CALIBRATED_SCHEMES}; got {scheme!r}")
    w = w.detach().float().cpu()
    n, k = w.shape
    if hessian.shape != (k, k):
        raise ValueError(f"a [{k}, {k}] Hessian is needed for a weight of {k} input columns; got {tuple(hessian.shape)}")
    top = INT8_MAX if scheme == "int8" else FP8_MAX
    scale = w.abs().amax(dim=1) / top
    scale = torch.where(scale > 0, scale, 1.0)

    def codes(column: torch.Tensor) -> torch.Tensor:  # [N] values -> their codes (as float)
        v = (column / scale).clamp(-top, top)
        return torch.round(v) if scheme == "int8" else v.to(FP8_DTYPE).float()

    h = hessian.double().clone()
    dead = torch.diagonal(h) == 0  # an input column that is always zero: its weights do not matter
    h[dead, dead] = 1.0
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    h = h[order][:, order]
    h += _DAMP * torch.diagonal(h).mean() * torch.eye(k, dtype=h.dtype)
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    u = torch.linalg.cholesky(inverse, upper=True).float()  # the inverse's upper Cholesky factor
    work = w[:, order].clone()
    work[:, dead[order]] = 0.0
    out = torch.empty_like(work)
    for i1 in range(0, k, _BLOCK):
        i2 = min(i1 + _BLOCK, k)
        block = work[:, i1:i2].clone()
        errors = torch.empty_like(block)
        for i in range(i2 - i1):
            q = codes(block[:, i])
            out[:, i1 + i] = q
            err = errors[:, i]
            torch.div(block[:, i] - q * scale, u[i1 + i, i1 + i], out=err)
            block[:, i:].addr_(err, u[i1 + i, i1 + i:i2], alpha=-1.0)
        work[:, i2:] -= errors @ u[i1:i2, i2:]
    data = torch.empty_like(out)
    data[:, order] = out
    data = data.to(torch.int8) if scheme == "int8" else data.to(FP8_DTYPE)
    return data, scale


@dataclass
class Calibration:
    """The inputs' statistics of a graph's linears (by weight name) and the GPTQ solutions found so
    far, so that the program and the self-check's reference get the very same codes."""

    hessians: dict[str, torch.Tensor]
    tokens: int
    _solved: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def quantize(self, parts: list[tuple[str, int]], w: torch.Tensor, scheme: str
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """GPTQ codes and scales of ``w [N, K]``, the rows of the weights ``parts`` (``(name, rows)``,
        stacked in order); None when a part has no statistics or ``scheme`` is not calibrated.
        Parts that read one input (a fused q/k/v) are solved together, and each part's solution is
        kept, so the unfused reference gets the same codes."""
        if scheme not in CALIBRATED_SCHEMES or any(t not in self.hessians for t, _ in parts):
            return None
        missing = [(t, rows) for t, rows in parts if (t, scheme) not in self._solved]
        if missing:
            shared = all(self.hessians[t] is self.hessians[parts[0][0]] for t, _ in parts)
            start, groups = 0, []
            for t, rows in parts:
                groups.append((t, start, start + rows))
                start += rows
            if shared and len(missing) == len(parts):
                data, scales = gptq_quantize(w, self.hessians[parts[0][0]], scheme)
                for t, a, b in groups:
                    self._solved[(t, scheme)] = (data[a:b], scales[a:b])
            else:
                for t, a, b in groups:
                    if (t, scheme) not in self._solved:
                        self._solved[(t, scheme)] = gptq_quantize(w[a:b], self.hessians[t], scheme)
        solved = [self._solved[(t, scheme)] for t, _ in parts]
        return torch.cat([d for d, _ in solved]), torch.cat([s for _, s in solved])


def calibrates(weight_dtype: str) -> bool:
    """Whether any linear of a ``weight_dtype`` program gets calibrated codes (the LM head is int8
    under int4)."""
    from ..passes.quantize_weights import HEAD_SCHEME

    return bool({weight_dtype, HEAD_SCHEME.get(weight_dtype)} & set(CALIBRATED_SCHEMES))


def context_calibration(ctx) -> Calibration | None:
    """The pass context's :class:`Calibration` (computed on first use, then shared with the
    self-check), or None when ``weight_calibration`` is empty or no linear's scheme is calibrated."""
    options = ctx.options
    if not options.weight_calibration or not calibrates(options.weight_dtype):
        return None
    if ctx.calibration is None:
        if ctx.cache_free_gm is None or ctx.analysis is None:
            raise RuntimeError("weight calibration needs the cache-free graph and its analysis (the annotate pass)")
        hessians = linear_input_hessians(ctx.cache_free_gm, ctx.analysis, options.weight_calibration)
        ctx.calibration = Calibration(hessians, len(options.weight_calibration))
    return ctx.calibration
