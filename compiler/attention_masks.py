"""What an attention site's mask and score bias are, proved from their formulas (``index_algebra.py``).

Every kernel supports one family of masks and biases (``kernels/paged_attention.py``, "variant"):
causal, optionally a sliding window ``W`` (query ``i`` sees keys ``i - W < j <= i``), and an ALiBi
bias ``slope[h] * j`` (plus anything constant along the keys, which softmax ignores). Given the
formula of a site's mask over the score dims ``[..., head, query, key]``, :func:`window_of` proves
which member it is for *every* length, or raises :class:`MaskError` saying what it is instead.
"""
from __future__ import annotations

import sympy
import torch

from .index_algebra import is_predicate

NEG_LARGE = float(torch.finfo(torch.float16).min)  # a float mask's "masked" value is below this (or -inf)


class MaskError(ValueError):
    """A mask or bias outside the supported family (the message says what it is)."""


def _keeps(value) -> bool | None:
    """For a float mask's branch value: True = keeps the key (0), False = drops it (very negative), None = neither."""
    if not value.is_number:
        return None
    v = float(value)
    if v == 0.0:
        return True
    return False if v <= NEG_LARGE else None


def allowed(expr) -> sympy.Basic:
    """The (query, key) pairs a mask lets through: a boolean formula as is, or a float mask (a piecewise
    of 0 = keep and a very negative value = drop) as the condition of its keep branches."""
    if is_predicate(expr):
        return expr
    if expr.is_number:
        keep = _keeps(expr)
        if keep is None:
            raise MaskError(f"a constant mask value {expr} is neither 0 nor -inf")
        return sympy.true if keep else sympy.false
    if isinstance(expr, sympy.Piecewise):
        taken, earlier = [], []
        for value, cond in expr.args:
            keep = _keeps(value)
            if keep is None:
                raise MaskError(f"a float mask with the value {value} (expected 0 or -inf)")
            if keep:
                taken.append(sympy.And(cond, *[sympy.Not(c) for c in earlier]))
            earlier.append(cond)
        return sympy.Or(*taken)
    raise MaskError(f"the mask is {expr}, not a boolean or 0/-inf formula of the positions")


def split_additive(expr) -> tuple[list, list]:
    """An additive float mask's terms: (mask terms: 0/-inf piecewise, bias terms: the rest)."""
    terms = sympy.Add.make_args(expr) if not is_predicate(expr) else (expr,)
    masks, biases = [], []
    for term in terms:
        try:
            allowed(term)
            masks.append(term)
        except MaskError:
            biases.append(term)
    return masks, biases


def _canonical(pred) -> sympy.Basic:
    """Relations as ``expanded(lhs - rhs) op 0`` (so that ``(i - d) - i`` cancels); truth-valued Piecewise
    folded into And/Or."""
    pred = sympy.piecewise_fold(pred)
    if isinstance(pred, sympy.Piecewise):
        if all(is_predicate(value) for value, _ in pred.args):  # a truth-valued piecewise: first true branch
            earlier, cases = [], []
            for value, cond in pred.args:
                cases.append(sympy.And(value, cond, *[sympy.Not(c) for c in earlier]))
                earlier.append(cond)
            return _canonical(sympy.Or(*cases))
        return _canonical(allowed(pred))
    if isinstance(pred, sympy.core.relational.Relational):
        lhs = sympy.piecewise_fold(pred.lhs - pred.rhs)
        if isinstance(lhs, sympy.Piecewise):  # e.g. Eq(Piecewise((1, c), (0, True)), 0)
            return _canonical(sympy.Or(*[sympy.And(cond, type(pred)(value, 0)) for value, cond in lhs.args]))
        return type(pred)(sympy.expand(lhs), 0)
    if isinstance(pred, sympy.logic.boolalg.BooleanFunction):
        return type(pred)(*[_canonical(a) for a in pred.args])
    return pred


def window_of(pred, query, key) -> int:
    """Prove ``pred`` (over the query and key index symbols) is causal (return 0) or a sliding window
    (return ``W``), for every length; else raise :class:`MaskError`."""
    pred = _canonical(pred)
    stray = pred.free_symbols - {query, key}
    if stray:
        raise MaskError(f"the mask depends on {sorted(map(str, stray))} (the batch, the head or the length), "
                        "not only on the query and key positions")
    d = sympy.Symbol("distance", integer=True)
    by_distance = _canonical(pred.xreplace({key: query - d}))
    if query in by_distance.free_symbols:
        raise MaskError(f"the mask {pred} is not a function of the query-key distance (e.g. attention sinks "
                        "or a prefix-LM mask)")
    if by_distance == sympy.true:
        raise MaskError("bidirectional attention (every key visible); a decoder needs a causal mask")
    seen = by_distance.as_set().intersect(sympy.S.Integers) if by_distance != sympy.false else sympy.S.EmptySet
    if seen == sympy.Range(0, sympy.oo):
        return 0
    if isinstance(seen, sympy.Range) and seen.start == 0 and seen.step == 1 and seen.stop.is_finite:
        return int(seen.stop)
    raise MaskError(f"the visible query-key distances are {seen}; supported: causal (0, 1, 2, ...) or a sliding "
                    "window (0 .. W-1)")


def alibi_slopes(bias, head, query, key, heads: int, tables: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """Per-head slopes of a bias ``slope[h] * key + c(h, query)`` (None when it does not vary along the
    keys, which softmax ignores); :class:`MaskError` for any other bias."""
    slope = sympy.diff(bias, key)
    rest = sympy.expand(bias - slope * key)
    if key in rest.free_symbols or key in slope.free_symbols or query in slope.free_symbols:
        raise MaskError(f"the attention score bias {bias} is not linear in the key position with a per-head "
                        "slope (ALiBi)")
    lookups = slope.atoms(sympy.Indexed)
    plain = slope.xreplace({e: sympy.Symbol("lookup") for e in lookups})
    if (plain.free_symbols - {head, sympy.Symbol("lookup")}
            or any(set(e.indices) - {head} for e in lookups)):
        raise MaskError(f"the ALiBi slope {slope} depends on more than the head")
    if slope == 0:
        return None
    values = []
    for h in range(heads):
        v = slope.xreplace({head: h})
        v = v.replace(lambda e: isinstance(e, sympy.Indexed),
                      lambda e: sympy.Float(float(tables[str(e.base)][int(e.indices[0])])))
        values.append(float(v))
    return torch.tensor(values, dtype=torch.float32)
