"""Analysis of a captured decoder graph: where its tokens, positions, attention and logits are.

Structural matching finds each attention site (``aten.scaled_dot_product_attention`` or the
hand-written ``matmul | baddbmm -> scale -> [soft cap] -> masks and biases -> softmax -> matmul``
chain); then :func:`prove_sites` *proves* the facts the KV-cache passes rely on instead of trusting
the shape of the code: each site's mask and bias are turned into formulas of the query and key
index (``index_algebra.py``) and classified for every length (``attention_masks.py``: causal, a
sliding window, ALiBi slopes), and one sample run checks that the GQA expansion maps query head
``h`` to kv head ``h // (heads // kv_heads)``. A site that does not fit gets an
:class:`UnsupportedAttentionError` naming the node and what it found.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import networkx as nx
import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .attention_masks import NEG_LARGE, MaskError, allowed, alibi_slopes, split_additive, window_of
from .index_algebra import VIEWS, IndexAlgebra, broadcast_to, dim_symbol, is_predicate

aten = torch.ops.aten

SDPA = aten.scaled_dot_product_attention.default
SOFTMAX = {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default}
MATMUL = {aten.matmul.default, aten.bmm.default}
ARANGE = {aten.arange.default, aten.arange.start, aten.arange.start_step}
EMBEDDING = aten.embedding.default
# ops that only reshape/repeat K or V heads for grouped-query attention
GQA_EXPAND = {aten.expand.default, aten.reshape.default, aten.view.default, aten._unsafe_view.default,
              aten.unsqueeze.default, aten.slice.Tensor, aten.repeat_interleave.self_int,
              aten.contiguous.default, aten.clone.default}
PASS_THROUGH = {aten.to.dtype, aten.to.dtype_layout, aten.type_as.default, aten.dropout.default,
                aten.contiguous.default, aten.clone.default}


class UnsupportedAttentionError(ValueError):
    """An attention pattern the KV-cache passes cannot rewrite."""


class UnsupportedModelError(ValueError):
    """The compiled program does not reproduce the model (the compile-time self-check): specgraph
    refuses it rather than answer wrongly."""


@dataclass
class AttentionSite:
    """One attention computation (one per layer in a decoder).

    Shapes are those of the captured graph: ``q`` and ``output`` are ``[B, heads, T, head_dim]``
    (``output`` may fold ``B * heads`` into one dim, as Bloom's ``bmm`` does), ``k`` and ``v`` are
    ``[B, kv_heads, T, head_dim]`` (taken before any GQA expansion). The mask and score modifiers are
    proved by :func:`prove_sites`: ``window`` (0: plain causal), ``softcap``, ``alibi_slopes``.
    """

    layer: int
    kind: str  # "sdpa" or "manual"
    q: fx.Node
    k: fx.Node
    v: fx.Node
    output: fx.Node
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    operands: tuple = ()  # q, k, v exactly as the attention consumes them (after GQA expansion, reshapes)
    score_shape: tuple = ()  # the scores' shape: [..., heads, queries, keys]
    is_causal: bool = False  # SDPA's flag
    masks: list = field(default_factory=list)  # (node, how, fill): how = "keep" | "drop" (True = masked) | "add"
    causal: bool = False  # proved: every mask is causal, maybe with a window
    window: int = 0
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None  # [heads] float32

    def describe(self) -> str:
        extras = "".join([f" window={self.window}" if self.window else "",
                          f" softcap={self.softcap:g}" if self.softcap else "",
                          " alibi" if self.alibi_slopes is not None else ""])
        return (f"layer {self.layer}: {self.kind} q={self.q.name} k={self.k.name} v={self.v.name} "
                f"out={self.output.name} heads={self.heads} kv_heads={self.kv_heads} "
                f"head_dim={self.head_dim} scale={self.scale:.6g} causal={self.causal}{extras}")


@dataclass
class GraphAnalysis:
    """What the passes need to know about a decoder graph."""

    input_ids: fx.Node
    seq_len: fx.Node | None  # SymInt placeholder for the sequence length (None: static capture)
    embedding: fx.Node
    logits: fx.Node
    vocab_size: int
    sites: list[AttentionSite]
    logits_index: int = 0  # position of ``logits`` among the graph's flattened outputs
    position_sources: list[fx.Node] = field(default_factory=list)  # aranges over the sequence

    def summary(self) -> str:
        lines = [f"input_ids={self.input_ids.name} seq_len={getattr(self.seq_len, 'name', None)} "
                 f"embedding={self.embedding.name} logits={self.logits.name} vocab={self.vocab_size}",
                 f"positions from: {[n.name for n in self.position_sources]}"]
        lines += [s.describe() for s in self.sites]
        return "\n".join(lines)


def to_networkx(graph: fx.Graph) -> nx.DiGraph:
    """The data-flow graph of ``graph`` (an edge per use)."""
    g = nx.DiGraph()
    for node in graph.nodes:
        g.add_node(node)
        for user in node.users:
            g.add_edge(node, user)
    return g


def _val(node) -> object:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def _shape(node: fx.Node) -> tuple:
    val = _val(node)
    if not isinstance(val, torch.Tensor):
        raise UnsupportedAttentionError(f"node {node.name} has no tensor metadata")
    return tuple(val.shape)


def _static(dim, what: str, node: fx.Node) -> int:
    if isinstance(dim, int):
        return dim
    raise UnsupportedAttentionError(f"{what} of {node.name} is symbolic ({dim}); it must be a constant")


def _expr(x):
    """The sympy expression of a SymInt node/value, or the int itself."""
    val = _val(x)
    if isinstance(val, torch.SymInt):
        return val.node.expr
    return val


def _skip(node: fx.Node, ops: set) -> fx.Node:
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in ops:
        node = node.args[0]
    return node


def _gqa_source(node: fx.Node, heads: int) -> fx.Node:
    """Walk back from an attention operand through GQA expansion to the ``[B, kv_heads, T, D]`` tensor."""
    best = node
    cur = node
    while cur.op == "call_function" and cur.target in GQA_EXPAND:
        cur = cur.args[0]
        shape = _val(cur).shape if isinstance(_val(cur), torch.Tensor) else ()
        if len(shape) == 4 and isinstance(shape[1], int) and shape[1] <= heads and heads % shape[1] == 0:
            best = cur
    return best


def _sdpa_site(node: fx.Node, layer: int) -> AttentionSite:
    q, k, v = node.args[:3]
    params = dict(zip(["attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"], node.args[3:]))
    params.update(node.kwargs)
    if params.get("dropout_p", 0.0):
        raise UnsupportedAttentionError(f"{node.name}: attention dropout p={params['dropout_p']} (put the model in eval mode)")
    qs = _shape(q)
    if len(qs) != 4:
        raise UnsupportedAttentionError(f"{node.name}: expected 4-d q [B, heads, T, head_dim], got {qs}")
    heads = _static(qs[1], "heads", q)
    head_dim = _static(qs[3], "head_dim", q)
    k_src, v_src = _gqa_source(k, heads), _gqa_source(v, heads)
    scale = params.get("scale")
    mask = params.get("attn_mask")
    masks = []
    if mask is not None:
        masks.append((mask, "keep" if _val(mask).dtype == torch.bool else "add", None))
    return AttentionSite(layer=layer, kind="sdpa", q=q, k=k_src, v=v_src, output=node, heads=heads,
                         kv_heads=_static(_shape(k_src)[1], "kv_heads", k_src), head_dim=head_dim,
                         scale=float(scale) if scale is not None else 1.0 / math.sqrt(head_dim),
                         operands=(q, k, v), score_shape=(*qs[:3], _shape(k)[2]),
                         is_causal=bool(params.get("is_causal", False)), masks=masks)


def _four_d(node: fx.Node) -> fx.Node:
    """Walk back through reshapes to the ``[B, heads, T, head_dim]`` tensor a 3-d ``bmm`` operand folds."""
    cur = node
    while len(_shape(cur)) != 4 and cur.op == "call_function" and cur.target in VIEWS | PASS_THROUGH:
        cur = cur.args[0]
    if len(_shape(cur)) != 4:
        raise UnsupportedAttentionError(f"{node.name}: expected an attention operand [B, heads, T, head_dim] "
                                        f"(or a reshape of one); got {_shape(node)}")
    return cur


def _softcap(x: fx.Node) -> tuple[float, fx.Node]:
    """``c * tanh(y / c)`` -> (c, y); anything else -> (0, x)."""
    if x.target in (aten.mul.Tensor, aten.mul.Scalar) and not isinstance(x.args[1], fx.Node):
        t = _skip(x.args[0], PASS_THROUGH)
        if t.target == aten.tanh.default:
            inner = _skip(t.args[0], PASS_THROUGH)
            cap = float(x.args[1])
            if inner.target in (aten.div.Tensor, aten.div.Scalar) and inner.args[1] == cap:
                return cap, inner.args[0]
            if inner.target in (aten.mul.Tensor, aten.mul.Scalar) and not isinstance(inner.args[1], fx.Node) \
                    and math.isclose(float(inner.args[1]) * cap, 1.0, rel_tol=1e-6):
                return cap, inner.args[0]
    return 0.0, x


def _manual_site(softmax: fx.Node, layer: int, algebra: IndexAlgebra) -> AttentionSite:
    expected = ("matmul(q, k^T) | baddbmm(bias, q, k^T) -> [scale] -> [c * tanh(. / c)] -> "
                "[masked_fill | where | + mask or bias]* -> softmax -> matmul(., v)")
    users = [u for u in softmax.users]
    probs = softmax
    while len(users) == 1 and users[0].target in PASS_THROUGH | VIEWS:
        probs = users[0]
        users = list(probs.users)
    if len(users) != 1 or users[0].target not in MATMUL or users[0].args[0] is not probs:
        raise UnsupportedAttentionError(f"softmax {softmax.name} is not followed by probs @ v; expected {expected}")
    out = users[0]
    v = out.args[1]
    score_shape = _shape(softmax.args[0])
    x, masks = softmax.args[0], []
    while True:  # masks and biases, outermost first
        x = _skip(x, PASS_THROUGH | VIEWS)
        if x.target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
            masks.append((x.args[1], "drop", x.args[2]))
            x = x.args[0]
        elif x.target in (aten.where.self, aten.where.ScalarOther):
            masks.append((x.args[0], "keep", x.args[2]))
            x = x.args[1]
        elif x.target == aten.add.Tensor and all(isinstance(a, fx.Node) for a in x.args[:2]):
            a, b = x.args[:2]
            term, x = (b, a) if algebra.value(b) is not None else (a, b)
            if algebra.value(term) is None:
                raise UnsupportedAttentionError(f"{x.name}: scores plus {term.name}, which is not a mask or bias "
                                                "built from positions; expected " + expected)
            masks.append((term, "add", None))
        else:
            break
    softcap, x = _softcap(x)
    x = _skip(x, PASS_THROUGH)
    scale = 1.0
    while x.target in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar) \
            and not isinstance(x.args[1], fx.Node):
        factor = float(x.args[1])
        scale *= factor if x.target in (aten.mul.Tensor, aten.mul.Scalar) else 1.0 / factor
        x = _skip(x.args[0], PASS_THROUGH)
    if x.target == aten.baddbmm.default and x.kwargs.get("beta", 1) == 1:
        masks.append((x.args[0], "add", None))
        scale *= float(x.kwargs.get("alpha", 1))
        q, kt = x.args[1:3]
    elif x.target in MATMUL:
        q, kt = x.args
    else:
        raise UnsupportedAttentionError(f"attention scores before {softmax.name} come from {x.name} "
                                        f"({x.target}); expected {expected}")
    rank = len(_shape(kt))
    if kt.target != aten.transpose.int or sorted(d % rank for d in kt.args[1:]) != [rank - 2, rank - 1]:
        raise UnsupportedAttentionError(f"{x.name}: keys must enter as k.transpose(-2, -1); got {kt.name}")
    q4 = _four_d(q)
    qs = _shape(q4)
    heads = _static(qs[1], "heads", q4)
    k_src, v_src = _gqa_source(_four_d(kt.args[0]), heads), _gqa_source(_four_d(v), heads)
    return AttentionSite(layer=layer, kind="manual", q=q4, k=k_src, v=v_src, output=out, heads=heads,
                         kv_heads=_static(_shape(k_src)[1], "kv_heads", k_src),
                         head_dim=_static(qs[3], "head_dim", q4), scale=scale, operands=(q, kt.args[0], v),
                         score_shape=score_shape, masks=masks, softcap=softcap)


def find_attention_sites(graph: fx.Graph, algebra: IndexAlgebra) -> list[AttentionSite]:
    """Structurally match every attention site, in graph order."""
    sites = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target == SDPA:
            sites.append(_sdpa_site(node, len(sites)))
        elif node.target in SOFTMAX:
            sites.append(_manual_site(node, len(sites), algebra))
    return sites


def _find_input_ids(graph: fx.Graph) -> fx.Node:
    for node in graph.nodes:
        if node.op == "placeholder" and isinstance(_val(node), torch.Tensor) and not _val(node).is_floating_point():
            return node
    raise UnsupportedAttentionError("the graph has no integer token-id input (expected input_ids [B, T])")


def sample_inputs(gm: fx.GraphModule, input_ids: fx.Node, seq_len_expr, vocab: int, length: int,
                   ids: torch.Tensor | None = None) -> list:
    """Placeholder values for a run over ``length`` tokens (``ids [1, length]``, else random ids)."""
    values = []
    gen = torch.Generator().manual_seed(0)
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = _val(node)
        if isinstance(val, torch.SymInt):
            values.append(length)
        elif isinstance(val, torch.Tensor):
            shape = [length if not isinstance(d, int) else d for d in val.shape]
            example = node.meta.get("example")
            if node is not input_ids and isinstance(example, torch.Tensor) and list(example.shape) == shape:
                values.append(example)  # scalars Dynamo lifted to inputs keep their real value
            elif node is input_ids:
                values.append((ids if ids is not None else torch.randint(0, vocab, shape, generator=gen)).to(val.device))
            else:
                values.append(torch.randn(shape, generator=gen).to(val.device, val.dtype))
        else:
            values.append(val)
    return values


class Recorder(fx.Interpreter):
    """Runs a graph and keeps the values of the ``wanted`` nodes."""

    def __init__(self, gm, wanted):
        super().__init__(gm)
        self.wanted, self.values = wanted, {}

    def run_node(self, n):
        out = super().run_node(n)
        if n in self.wanted:
            self.values[n] = out
        return out


def _prove_mask(site: AttentionSite, algebra: IndexAlgebra) -> None:
    """Prove the site's masks are causal (maybe with a window) and its score bias is ALiBi, for every length."""
    rank = len(site.score_shape)
    head, query, key = (dim_symbol(rank - 3), dim_symbol(rank - 2), dim_symbol(rank - 1))
    visible = [sympy.Le(key, query)] if site.is_causal else []
    biases = []
    for node, how, fill in site.masks:
        value = algebra.value(node)
        if value is None:
            raise MaskError(f"the mask {node.name} is not built from positions by ops specgraph can prove "
                            "(arange, comparisons, logic, where, tril/triu, a band buffer)")
        formula = broadcast_to(value, site.score_shape)
        if how == "add":
            masks, bias = split_additive(formula)
            visible += [allowed(m) for m in masks]
            biases += bias
            continue
        fill_value = algebra.value(fill) if isinstance(fill, fx.Node) else None
        if isinstance(fill, fx.Node) and fill_value is not None and fill_value.expr.is_number:
            fill = float(fill_value.expr)
        if fill is not None and not (isinstance(fill, (int, float)) and fill <= NEG_LARGE):
            raise MaskError(f"{node.name} fills masked scores with {fill}, not -inf")
        keep = formula if is_predicate(formula) else sympy.Ne(formula, 0)
        visible.append(keep if how == "keep" else sympy.Not(keep))
    if not visible:
        raise MaskError("attention is not causal (no mask and is_causal=False); expected a causal decoder")
    site.window = window_of(sympy.And(*visible), query, key)
    if biases:
        site.alibi_slopes = alibi_slopes(sympy.Add(*biases), head, query, key, site.heads, algebra.tables)
    site.causal = True


def prove_sites(gm: fx.GraphModule, analysis: GraphAnalysis, algebra: IndexAlgebra, length: int = 6) -> None:
    """Prove each site's mask and bias symbolically, and its GQA head mapping on one sample run."""
    for s in analysis.sites:
        try:
            _prove_mask(s, algebra)
        except (ValueError, TypeError) as e:  # MaskError, or a formula sympy cannot classify
            raise UnsupportedAttentionError(f"{s.output.name} ({s.kind}, layer {s.layer}): {e}") from None
    wanted = set()
    for s in analysis.sites:
        wanted |= {s.k, s.v, *s.operands[1:]}
    rec = Recorder(gm, wanted)
    seq_expr = _expr(analysis.seq_len) if analysis.seq_len is not None else None
    T = length if seq_expr is not None else _shape(analysis.input_ids)[1]
    with torch.no_grad():
        rec.run(*sample_inputs(gm, analysis.input_ids, seq_expr, analysis.vocab_size, T))
    for s in analysis.sites:
        rep = s.heads // s.kv_heads
        for src, used in ((s.k, s.operands[1]), (s.v, s.operands[2])):
            src_val, used_val = rec.values[src], rec.values[used]
            heads_used = used_val.numel() // src_val[:, :1].numel()
            expected = src_val if heads_used == s.kv_heads else src_val.repeat_interleave(rep, dim=1)
            if expected.numel() != used_val.numel() or not torch.equal(expected, used_val.reshape(expected.shape)):
                raise UnsupportedAttentionError(
                    f"{used.name} (layer {s.layer}): the key/value heads are not expanded as "
                    f"head h -> kv head h // {rep} (repeat_kv / repeat_interleave); unsupported GQA layout")


def _find_position_sources(graph: fx.Graph, algebra: IndexAlgebra, seq_expr) -> list[fx.Node]:
    """The tensors that hold each token's index in the sequence, ``[T]`` or ``[1, T]``, however built
    (``arange``, OPT's cumulative sum of a mask of ones minus one): the outermost such node of each chain."""
    if seq_expr is None:
        return []

    def is_index(node: fx.Node) -> bool:
        val = _val(node)
        if (node.op != "call_function" or not isinstance(val, torch.Tensor) or val.dim() not in (1, 2)
                or (val.dim() == 2 and val.shape[0] != 1) or _expr(val.shape[-1]) != seq_expr):
            return False
        value = algebra.value(node)
        return (value is not None and not is_predicate(value.expr)
                and sympy.expand(value.expr - dim_symbol(val.dim() - 1)) == 0)

    index = {n for n in graph.nodes if n not in algebra.from_inputs and is_index(n)}
    return [n for n in graph.nodes if n in index and not all(u in index for u in n.users)]


def _flatten(out) -> list:
    return list(pytree.tree_leaves(out, is_leaf=lambda x: x is None))


def output_nodes(graph: fx.Graph) -> list:
    """The graph's outputs, flattened in order (tuples, lists and dicts of outputs; None kept)."""
    return _flatten(next(n for n in graph.nodes if n.op == "output").args[0])


def pick_output(out, index: int):
    """Output ``index`` (numbered as :func:`output_nodes` numbers them) of a graph's runtime result."""
    return _flatten(out)[index]


def find_logits(graph: fx.Graph, from_ids: set, seq_expr, vocab: int) -> tuple[int, fx.Node]:
    """The logits output by structure, whatever else the model returns (caches, hidden states).

    The logits are a ``[B, T, V]`` output computed from the token ids whose last dimension is the
    embedding's vocabulary, or failing that (an LM head padded or cut to another size) the widest
    such output of a linear layer. K/V caches (``[B, H, T, D]``) and hidden states (``[B, T, D]``
    with ``D`` the model width, not produced by the last linear) are never chosen over them.
    """
    candidates = []
    for i, node in enumerate(output_nodes(graph)):
        if not isinstance(node, fx.Node) or node not in from_ids:
            continue
        shape = _shape(node)
        if len(shape) != 3 or not isinstance(shape[-1], int):
            continue
        if seq_expr is not None and _expr(shape[1]) != seq_expr:
            continue
        is_head = node.op == "call_function" and node.target in (aten.linear.default, aten.mm.default,
                                                                  aten.matmul.default)
        candidates.append((shape[-1] == vocab, is_head, shape[-1], -i, i, node))
    if not candidates:
        raise UnsupportedAttentionError("no output of the graph looks like logits: expected a [batch, tokens, "
                                        f"vocab] tensor computed from the token ids (vocabulary {vocab})")
    best = max(candidates, key=lambda c: c[:4])
    if not (best[0] or best[1]):
        raise UnsupportedAttentionError(f"no output of the graph looks like logits (vocabulary {vocab}); the "
                                        f"widest [batch, tokens, X] output is {best[5].name} with X={best[2]}")
    return best[4], best[5]


def analyze(gm: fx.GraphModule, verify: bool = True) -> GraphAnalysis:
    """Analyze a captured decoder graph (see module docstring)."""
    graph = gm.graph
    input_ids = _find_input_ids(graph)
    ids_shape = _shape(input_ids)
    if len(ids_shape) != 2:
        raise UnsupportedAttentionError(f"token ids {input_ids.name} must be [B, T]; got {ids_shape}")
    seq_expr = _expr(ids_shape[1]) if not isinstance(ids_shape[1], int) else None
    seq_len = next((n for n in graph.nodes if n.op == "placeholder" and isinstance(_val(n), torch.SymInt)
                    and seq_expr is not None and _expr(n) == seq_expr), None)
    nxg = to_networkx(graph)
    from_ids = nx.descendants(nxg, input_ids)
    embedding = next((n for n in graph.nodes if n.op == "call_function" and n.target == EMBEDDING
                      and (n.args[1] is input_ids or n.args[1] in from_ids)), None)
    if embedding is None:
        raise UnsupportedAttentionError(f"no aten.embedding reads the token ids {input_ids.name}")
    vocab = _static(_shape(embedding.args[0])[0], "vocabulary", embedding)
    logits_index, logits = find_logits(graph, from_ids, seq_expr, vocab)
    lshape = _shape(logits)
    if lshape[-1] != vocab and isinstance(lshape[-1], int):
        vocab = lshape[-1]
    algebra = IndexAlgebra(gm)
    sites = find_attention_sites(graph, algebra)
    if not sites:
        raise UnsupportedAttentionError("no attention found: expected aten.scaled_dot_product_attention or "
                                        "matmul(q, k^T) -> softmax -> matmul(., v)")
    analysis = GraphAnalysis(input_ids=input_ids, seq_len=seq_len, embedding=embedding, logits=logits,
                             vocab_size=vocab, sites=sites, logits_index=logits_index,
                             position_sources=_find_position_sources(graph, algebra, seq_expr))
    if verify:
        prove_sites(gm, analysis, algebra)
    return analysis
