"""Index algebra: what a mask, bias or position tensor of a captured graph is, as a formula of its indices.

An attention mask is built from ``arange``s by broadcasting comparisons (HF's ``sdpa_mask``, a
``tril`` of ones, ``kv_idx > q_idx - window``, ...). Running it on one sample length shows what it
does at that length only: a window of 8 looks causal at length 6. Instead, :class:`IndexAlgebra`
evaluates such a subgraph *symbolically*: the value of a node is a sympy expression of its element
index, one integer symbol per dimension (``_d0``, ``_d1``, ... from the left), exact for every
length. ``arange(T)`` is ``_d0``; ``unsqueeze``/``expand``/``view``/``transpose`` re-index;
arithmetic, comparisons, logic, ``where``, ``masked_fill``, ``tril``/``triu`` and a ``cumsum`` of
ones (OPT's positions) build the formula. Tensors without a graph input among their ancestors
(buffers, ALiBi slopes) are evaluated concretely: a vector along one dimension becomes a table
lookup ``slopes[_dk]``; a square band matrix (a ``tril`` buffer, maybe a windowed one) becomes its
band formula, after checking every diagonal of the whole buffer. Anything else is unknown
(``None``), and the caller refuses what it cannot prove.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

aten = torch.ops.aten

COMPARE = {aten.lt: sympy.Lt, aten.le: sympy.Le, aten.gt: sympy.Gt, aten.ge: sympy.Ge, aten.eq: sympy.Eq,
           aten.ne: sympy.Ne}
LOGIC = {aten.__and__: sympy.And, aten.bitwise_and: sympy.And, aten.logical_and: sympy.And,
         aten.__or__: sympy.Or, aten.bitwise_or: sympy.Or, aten.logical_or: sympy.Or}
NOT = {aten.bitwise_not.default, aten.logical_not.default}
ARITH = {aten.add: lambda a, b: a + b, aten.sub: lambda a, b: a - b, aten.mul: lambda a, b: a * b,
         aten.rsub: lambda a, b: b - a}
IDENTITY = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.type_as.default, aten.clone.default,
            aten.contiguous.default, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default,
            aten.repeat.default}
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
CONSTANT_FILL = {aten.ones.default: 1, aten.new_ones.default: 1, aten.zeros.default: 0, aten.new_zeros.default: 0,
                 aten.ones_like.default: 1, aten.zeros_like.default: 0}


def dim_symbol(k: int) -> sympy.Symbol:
    """The index of dimension ``k`` (from the left) of a value."""
    return sympy.Symbol(f"_d{k}", integer=True, nonnegative=True)


@dataclass(frozen=True)
class IndexValue:
    """A tensor as a formula: element ``[x0, x1, ...]`` is ``expr`` with ``_dk = xk``."""

    expr: sympy.Basic
    shape: tuple  # sizes: ints or sympy expressions

    @property
    def rank(self) -> int:
        return len(self.shape)


def _size(dim):
    return dim.node.expr if isinstance(dim, torch.SymInt) else int(dim)


def _is_one(dim) -> bool:
    return isinstance(dim, int) and dim == 1 or dim == sympy.Integer(1)


def _reindex(expr, mapping: dict[int, object]) -> sympy.Basic:
    """Substitute ``_dk -> mapping[k]`` (an int or another expression), all at once."""
    return sympy.sympify(expr).xreplace({dim_symbol(k): sympy.sympify(v) for k, v in mapping.items()})


def broadcast_to(v: IndexValue, shape: tuple) -> sympy.Basic:
    """``v``'s formula in the dims of ``shape`` (numpy broadcasting: dims aligned from the right, size-1 dims fixed
    at index 0)."""
    lead = len(shape) - v.rank
    if lead < 0:
        raise ValueError(f"a rank-{v.rank} mask does not broadcast to the rank-{len(shape)} scores")
    mapping = {}
    for k, size in enumerate(v.shape):
        mapping[k] = 0 if _is_one(size) and not _is_one(shape[k + lead]) else dim_symbol(k + lead)
    return _reindex(v.expr, mapping)


def is_predicate(expr) -> bool:
    """Whether a formula is a truth value (a dim symbol is an integer, never one)."""
    return isinstance(expr, (sympy.logic.boolalg.BooleanFunction, sympy.logic.boolalg.BooleanAtom,
                             sympy.core.relational.Relational))


def numeric(expr) -> sympy.Basic:
    """A boolean formula used as a number (``True`` = 1)."""
    return sympy.Piecewise((1, expr), (0, True)) if is_predicate(expr) else expr


class IndexAlgebra:
    """Symbolic values of the nodes of one graph (memoized); ``value(node)`` is an :class:`IndexValue` or None."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.tables: dict[str, torch.Tensor] = {}  # IndexedBase name -> its 1-d values
        self._values: dict[fx.Node, IndexValue | None] = {}
        self._constants: dict[fx.Node, torch.Tensor | None] = {}
        # nodes computed from a tensor input (activations): never a formula, never a constant
        self.from_inputs: set[fx.Node] = set()
        # nodes with a symbolic size among their inputs: formulas, not constants
        self._symbolic: set[fx.Node] = set()
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                (self.from_inputs if isinstance(node.meta.get("val"), torch.Tensor) else self._symbolic).add(node)
            elif any(a in self.from_inputs for a in node.all_input_nodes):
                self.from_inputs.add(node)
            elif any(a in self._symbolic for a in node.all_input_nodes):
                self._symbolic.add(node)

    # -- concrete constants -------------------------------------------------------------------------
    def _concrete(self, node) -> torch.Tensor | None:
        """The value of a node with no graph input among its ancestors (None otherwise)."""
        if not isinstance(node, fx.Node):
            return node if isinstance(node, torch.Tensor) else None
        if node in self.from_inputs or node in self._symbolic:
            return None
        if node not in self._constants:
            self._constants[node] = self._compute_constant(node)
        return self._constants[node]

    def _compute_constant(self, node: fx.Node) -> torch.Tensor | None:
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return None  # never run an op that writes (a buffer update) outside the model
        if node.op == "get_attr":
            obj = self.gm
            for part in node.target.split("."):
                obj = getattr(obj, part)
            return obj if isinstance(obj, torch.Tensor) else None
        if node.op != "call_function":
            return None
        args = []
        for a in node.args:
            if isinstance(a, fx.Node):
                c = self._concrete(a)
                if c is None:
                    return None
                args.append(c)
            elif isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a):
                return None
            else:
                args.append(a)
        if any(isinstance(v, fx.Node) for v in node.kwargs.values()):
            return None
        try:
            with torch.no_grad():
                out = node.target(*args, **node.kwargs)
        except Exception:
            return None
        return out if isinstance(out, torch.Tensor) else None

    def _from_tensor(self, node: fx.Node, t: torch.Tensor) -> IndexValue | None:
        shape = tuple(t.shape)
        if t.numel() == 1:
            return IndexValue(sympy.sympify(t.item()), shape)
        big = [k for k, s in enumerate(shape) if s > 1]
        if len(big) == 1:  # a vector along one dim: a table lookup
            name = f"table_{node.name}"
            self.tables[name] = t.flatten().detach().clone()
            return IndexValue(sympy.IndexedBase(name)[dim_symbol(big[0])], shape)
        if len(big) == 2 and big[1] == big[0] + 1 and shape[big[0]] == shape[big[1]]:
            band = _band(t.reshape(shape[big[0]], shape[big[1]]))
            if band is not None:
                r, c = dim_symbol(big[0]), dim_symbol(big[1])
                allowed = sympy.Le(c, r) if band == 0 else sympy.And(sympy.Le(c, r), sympy.Lt(r - c, band))
                if t.dtype == torch.bool:
                    return IndexValue(allowed, shape)
                if bool(((t == 0) | (t == 1)).all()):
                    return IndexValue(numeric(allowed), shape)
        return None

    # -- symbolic evaluation ------------------------------------------------------------------------
    def value(self, node) -> IndexValue | None:
        if not isinstance(node, fx.Node):
            if isinstance(node, (bool, int, float)):
                return IndexValue(sympy.sympify(node), ())
            if isinstance(node, torch.SymInt):
                return IndexValue(node.node.expr, ())
            return None
        if node in self.from_inputs:
            return None
        if node not in self._values:
            self._values[node] = self._evaluate(node)
        return self._values[node]

    def _evaluate(self, node: fx.Node) -> IndexValue | None:
        val = node.meta.get("val")
        if node.op == "placeholder":
            return IndexValue(val.node.expr, ()) if isinstance(val, torch.SymInt) else None
        if node.op == "get_attr":
            t = self._concrete(node)
            return self._from_tensor(node, t) if t is not None else None
        if node.op == "call_function" and isinstance(val, torch.SymInt):  # size arithmetic, e.g. T - 4
            return IndexValue(val.node.expr, ())
        if node.op != "call_function" or not isinstance(val, torch.Tensor):
            return None
        shape = tuple(_size(d) for d in val.shape)
        try:
            expr = self._formula(node, shape)
        except (TypeError, ValueError, IndexError):
            expr = None
        if expr is None:
            t = self._concrete(node)
            return self._from_tensor(node, t) if t is not None else None
        return IndexValue(sympy.sympify(expr), shape)

    def _operand(self, arg, shape: tuple):
        v = self.value(arg)
        return None if v is None else broadcast_to(v, shape)

    def _formula(self, node: fx.Node, shape: tuple):
        t, args = node.target, node.args
        packet = getattr(t, "overloadpacket", None)
        if t in (aten.arange.default, aten.arange.start, aten.arange.start_step):
            start = args[0] if t != aten.arange.default else 0
            step = args[2] if t == aten.arange.start_step else 1
            start, step = self.value(start), self.value(step)
            return None if start is None or step is None else start.expr + step.expr * dim_symbol(0)
        if t in CONSTANT_FILL:
            return sympy.sympify(CONSTANT_FILL[t])
        if t in (aten.full.default, aten.new_full.default, aten.full_like.default, aten.scalar_tensor.default):
            fill = args[1] if t in (aten.full.default, aten.new_full.default, aten.full_like.default) else args[0]
            f = self.value(fill)
            return None if f is None else f.expr
        if t in IDENTITY or t in VIEWS or t in (aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim,
                                                aten.slice.Tensor, aten.select.int, aten.transpose.int,
                                                aten.permute.default):
            return self._reshaped(node, shape)
        if packet in COMPARE:
            a, b = self._operand(args[0], shape), self._operand(args[1], shape)
            return None if a is None or b is None else COMPARE[packet](numeric(a), numeric(b))
        if packet in LOGIC:
            a, b = self._operand(args[0], shape), self._operand(args[1], shape)
            return None if a is None or b is None else LOGIC[packet](_as_bool(a), _as_bool(b))
        if t in NOT:
            a = self._operand(args[0], shape)
            return None if a is None else sympy.Not(_as_bool(a))
        if packet in ARITH:
            a, b = self._operand(args[0], shape), self._operand(args[1], shape)
            if a is None or b is None:
                return None
            alpha = node.kwargs.get("alpha", 1)
            b = numeric(b) * alpha if packet in (aten.add, aten.sub) else numeric(b)
            return ARITH[packet](numeric(a), b)
        if t == aten.neg.default:
            a = self._operand(args[0], shape)
            return None if a is None else -numeric(a)
        if packet == aten.where:
            c, a, b = (self._operand(x, shape) for x in args[:3])
            return None if None in (c, a, b) else sympy.Piecewise((numeric(a), _as_bool(c)), (numeric(b), True))
        if packet == aten.masked_fill:
            x, m, fill = self._operand(args[0], shape), self._operand(args[1], shape), self.value(args[2])
            return None if None in (x, m, fill) else sympy.Piecewise((fill.expr, _as_bool(m)), (numeric(x), True))
        if t in (aten.tril.default, aten.triu.default):
            x = self._operand(args[0], shape)
            k = args[1] if len(args) > 1 else 0
            r, c = dim_symbol(len(shape) - 2), dim_symbol(len(shape) - 1)
            keep = sympy.Le(c - r, k) if t == aten.tril.default else sympy.Ge(c - r, k)
            if x is None:
                return None
            return sympy.And(x, keep) if is_predicate(x) else sympy.Piecewise((x, keep), (0, True))
        if t == aten.index.Tensor:  # x[i0, i1, ...] with every dim indexed by a tensor
            x, indices = self.value(args[0]), args[1]
            if x is None or len(indices) != x.rank or any(i is None for i in indices):
                return None
            at = [self._operand(i, shape) for i in indices]
            return None if any(a is None for a in at) else _reindex(x.expr, dict(enumerate(at)))
        if t == aten.diff.default:
            return self._diff(node)
        if t == aten.cumsum.default:
            x = self._operand(args[0], shape)
            dim = args[1] % len(shape)
            if x is None or numeric(x).free_symbols:
                return None  # only a cumulative sum of a constant has a closed form here
            return numeric(x) * (dim_symbol(dim) + 1)
        return None

    def _diff(self, node: fx.Node):
        """``diff(x, 1, dim, prepend=p)`` where ``p`` continues ``x``'s formula one step back (HF's check
        for packed sequences, ``diff(positions, prepend=positions[:1] - 1)``): ``x[k] - x[k - 1]``."""
        x, rest = self.value(node.args[0]), list(node.args[1:]) + [None] * 4
        n, dim, prepend, append = (rest[0] if rest[0] is not None else 1), rest[1], rest[2], rest[3]
        p = self.value(prepend) if isinstance(prepend, fx.Node) else None
        if x is None or p is None or n != 1 or append is not None:
            return None
        dim = (dim if dim is not None else -1) % x.rank
        if not _is_one(p.shape[dim]):
            return None
        before_first = _reindex(x.expr, {dim: -1})
        if sympy.simplify(broadcast_to(p, x.shape).xreplace({dim_symbol(dim): 0}) - before_first) != 0:
            return None
        return sympy.expand(x.expr - _reindex(x.expr, {dim: dim_symbol(dim) - 1}))

    def _reshaped(self, node: fx.Node, shape: tuple):
        """Index maps: the output index -> the input index, for views, permutations, slices and broadcasts."""
        t, args = node.target, node.args
        src = self.value(args[0])
        if src is None:
            return None
        if t in IDENTITY:
            if t == aten.repeat.default and any(r != 1 for r in args[1]):
                return None
            return src.expr
        n = len(shape)
        if t == aten.expand.default:
            return broadcast_to(src, shape)
        if t == aten.unsqueeze.default:
            dim = args[1] % n
            return _reindex(src.expr, {k: dim_symbol(k if k < dim else k + 1) for k in range(src.rank)})
        if t == aten.squeeze.dim:
            dim = args[1] % src.rank
            if not _is_one(src.shape[dim]):
                return src.expr
            return _reindex(src.expr, {k: 0 if k == dim else dim_symbol(k if k < dim else k - 1)
                                       for k in range(src.rank)})
        if t == aten.transpose.int:
            a, b = args[1] % n, args[2] % n
            order = list(range(n))
            order[a], order[b] = order[b], order[a]
            return _reindex(src.expr, {k: dim_symbol(order[k]) for k in range(n)})
        if t == aten.permute.default:
            perm = [p % n for p in args[1]]
            return _reindex(src.expr, {perm[k]: dim_symbol(k) for k in range(n)})
        if t == aten.select.int:
            dim, index = args[1] % src.rank, args[2]
            if not isinstance(index, int) or index < 0:
                return None
            return _reindex(src.expr, {k: index if k == dim else dim_symbol(k if k < dim else k - 1)
                                       for k in range(src.rank)})
        if t == aten.slice.Tensor:
            dim = args[1] % n
            start = args[2] if len(args) > 2 and args[2] is not None else 0
            step = args[4] if len(args) > 4 else 1
            if not isinstance(start, int) or start < 0 or not isinstance(step, int):
                return None
            return _reindex(src.expr, {dim: start + step * dim_symbol(dim)})
        return _view(src, shape)


def _view(src: IndexValue, shape: tuple):
    """A view that only adds or drops size-1 dims (the other dims pair up in order, equal sizes)."""
    old = [k for k, s in enumerate(src.shape) if not _is_one(s)]
    new = [k for k, s in enumerate(shape) if not _is_one(s)]
    if len(old) != len(new) or any(sympy.simplify(sympy.sympify(src.shape[a]) - sympy.sympify(shape[b])) != 0
                                   for a, b in zip(old, new)):
        return None
    mapping = {k: 0 for k in range(src.rank)}
    mapping.update({a: dim_symbol(b) for a, b in zip(old, new)})
    return _reindex(src.expr, mapping)


def _as_bool(expr) -> sympy.Basic:
    """A number used as a truth value (nonzero = True)."""
    return expr if is_predicate(expr) else sympy.Ne(expr, 0)


def _band(table: torch.Tensor) -> int | None:
    """For an ``[L, L]`` matrix that is exactly a causal band (nonzero on diagonals ``0 .. W-1`` below
    the main one, zero elsewhere): ``W``, or 0 when the band covers the whole lower triangle."""
    n = table.shape[0]
    nonzero = table != 0
    if nonzero.triu(1).any():
        return None
    width = 0
    while width < n and bool(nonzero.diagonal(-width).all()):
        width += 1
    if width == 0 or nonzero.tril(-width).any():
        return None
    return 0 if width == n else width
