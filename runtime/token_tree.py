"""Token trees for speculation: tree shapes, building a tree from scored candidates, and lossless
verification of a tree by one target forward.

Numbering
---------
A drafted tree is a :class:`~.proposers.base.Draft` with ``parents``: draft node ``i`` (token
``token_ids[i]``) hangs under draft node ``parents[i] < i``, or under the root (``-1``: the
sequence's last committed token, not yet fed). The verify step feeds ``[root] + token_ids``: step
node ``m = i + 1``, so the target's logits row ``m`` is its distribution after node ``m``'s path.
A chain is the tree ``parents = [-1, 0, 1, ...]``.

Shapes (``Engine(draft_tree=...)``)
-----------------------------------
* ``"static:W1,W2,..."``: the draft's top-``W1`` tokens at depth 1, its top-``W2`` under each of
  those at depth 2, ...: depth = the list's length (Medusa-style).
* ``"dynamic:N"``: grown by the draft's cumulative confidence (the product of its probabilities
  along the path): each level expands the most confident nodes, and the best ``N`` nodes of all
  levels are verified (EAGLE-2). The cumulative confidence never rises along a path, so the best
  ``N`` always include their ancestors.

Verification
------------
:func:`accept_tree`: from the root, follow the child whose token is the target's own token after its
parent (greedy: the argmax; sampled: the draw of the position's uniform) while there is one; emit those
tokens: the longest root path the target agrees with, plus one target token. The engine reads those
tokens from ``runtime/step_logits.py``; :func:`verify_tree_greedy` and :func:`verify_tree_sampling` take
whole logits or probability rows (the pure forms the tests check, as ``rejection.py``'s verifiers).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..kernels.hot_cold import hot_tensors
from .sampling import draw_token

_FORMS = "'static:W1,W2,...' (top-W per level, e.g. 'static:4,2,1') or 'dynamic:N' (the N most confident nodes)"
DYNAMIC_DEPTH = 6  # levels a dynamic tree may grow
DYNAMIC_WIDTH = 4  # least nodes a dynamic tree expands per level, and children per expanded node


@dataclass(frozen=True)
class TreeShape:
    """A parsed ``draft_tree``: ``widths`` (static) or ``budget`` nodes (dynamic)."""

    widths: tuple[int, ...] = ()
    budget: int = 0

    @property
    def dynamic(self) -> bool:
        return self.budget > 0

    @property
    def depth(self) -> int:
        return min(DYNAMIC_DEPTH, self.budget) if self.dynamic else len(self.widths)

    @property
    def level_widths(self) -> tuple[int, ...]:
        """Static: the widths; dynamic: the nodes each level keeps, ``max(DYNAMIC_WIDTH, budget / depth)``."""
        if not self.dynamic:
            return self.widths
        return (max(DYNAMIC_WIDTH, -(-self.budget // self.depth)),) * self.depth

    @property
    def scratch_nodes(self) -> int:
        """Cache slots past the root that drafting and verifying this shape may write: a dynamic tree
        grows more nodes than it verifies."""
        return sum(self.level_widths) if self.dynamic else self.max_nodes

    @property
    def max_nodes(self) -> int:
        """Draft nodes of the largest tree of this shape (the root not counted)."""
        if self.dynamic:
            return self.budget
        total, level = 0, 1
        for w in self.widths:
            level *= w
            total += level
        return total

    def __str__(self) -> str:
        return f"dynamic:{self.budget}" if self.dynamic else "static:" + ",".join(map(str, self.widths))


def parse_tree(spec: str, max_nodes: int) -> TreeShape:
    """``"static:4,2,1"`` / ``"dynamic:24"`` -> :class:`TreeShape`; ``ValueError`` naming the forms."""
    kind, sep, arg = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    try:
        numbers = tuple(int(x) for x in arg.split(",")) if sep and arg else ()
    except ValueError:
        numbers = ()
    if kind == "static" and numbers and all(n >= 1 for n in numbers):
        shape = TreeShape(widths=numbers)
    elif kind == "dynamic" and len(numbers) == 1 and numbers[0] >= 1:
        shape = TreeShape(budget=numbers[0])
    else:
        raise ValueError(f"draft_tree={spec!r} is malformed; accepted forms: {_FORMS}")
    if shape.scratch_nodes > max_nodes:
        raise ValueError(f"draft_tree={spec!r} writes {shape.scratch_nodes} nodes; at most {max_nodes} fit one step")
    return shape


class TreeBuilder:
    """Grows one sequence's draft tree level by level (breadth-first numbering, see the module docstring).

    The proposer gives, for each node of :attr:`frontier` (None: the root), its candidate children as
    ``(token, probability)`` best first (:meth:`add_level`) until :attr:`done`; :meth:`result` is the
    tree to verify. Static: the best ``widths[d]`` distinct candidates of every frontier node.
    Dynamic: each node's best ``w`` candidates, of which the level keeps the ``w`` most confident
    (cumulative log-probability) as the next frontier, ``w = max(DYNAMIC_WIDTH, budget / depth)``;
    at the end the best ``budget`` nodes of all levels. ``max_depth`` caps the levels (a request
    near its token limit).
    """

    def __init__(self, shape: TreeShape, max_depth: int | None = None):
        self.shape = shape
        self.depth = shape.depth if max_depth is None else min(max_depth, shape.depth)
        self.width = shape.level_widths
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []  # cumulative log-probability (dynamic)
        self.frontier: list[int | None] = [None]
        self.level = 0

    @property
    def done(self) -> bool:
        return not self.frontier or self.level >= self.depth

    def path(self, node: int | None) -> list[int]:
        """Tokens from the root's first child down to ``node`` (empty for the root)."""
        out = []
        while node is not None and node >= 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def add_level(self, candidates: list[list[tuple[int, float]]]) -> None:
        width = self.width[self.level]
        level = []
        for node, cands in zip(self.frontier, candidates):
            base = 0.0 if node is None else self.scores[node]
            seen: set[int] = set()
            for t, p in cands:
                if len(seen) == width:
                    break
                if int(t) not in seen:
                    seen.add(int(t))
                    level.append((base + math.log(max(float(p), 1e-30)), -1 if node is None else node, int(t)))
        if self.shape.dynamic:
            level = heapq.nlargest(width, level, key=lambda c: c[0])
        self.frontier = []
        for score, parent, t in level:
            self.tokens.append(t)
            self.parents.append(parent)
            self.scores.append(score)
            self.frontier.append(len(self.tokens) - 1)
        self.level += 1

    def result(self) -> tuple[list[int], list[int]]:
        """``(tokens, parents)`` of the tree to verify."""
        if self.shape.dynamic:
            return best_nodes(self.tokens, self.parents, self.scores, self.shape.budget)
        return list(self.tokens), list(self.parents)


def best_nodes(tokens: list[int], parents: list[int], scores: list[float], budget: int) -> tuple[list[int], list[int]]:
    """The ``budget`` highest-scoring nodes (ties: shallower, then earlier), renumbered in their
    original order; ``scores`` must not rise from a parent to its children, so the kept set holds
    every kept node's ancestors."""
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    keep = sorted(range(len(tokens)), key=lambda i: (-scores[i], depth[i], i))[:budget]
    keep.sort()
    index = {old: new for new, old in enumerate(keep)}
    if any(parents[i] >= 0 and parents[i] not in index for i in keep):
        raise ValueError("tree scores rise from a parent to a child: the best nodes lack an ancestor")
    return [tokens[i] for i in keep], [index[parents[i]] if parents[i] >= 0 else -1 for i in keep]


def step_children(parents: list[int]) -> list[list[int]]:
    """Children of each verify-step node (0 = the root) in order: draft node ``i`` is step node ``i + 1``."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        children[p + 1].append(i + 1)
    return children


def chain_in_tree(parents: list[int], path: list[int]) -> tuple[int, int]:
    """The tree's first-child chain (from the root, each node's first child: the draft's best guess there)
    against the accepted root path ``path`` (step nodes): ``(the chain's length, how many of its nodes
    lead the path)``. Under greedy decoding that is what verifying that chain alone would have accepted.

    >>> chain_in_tree([-1, -1, 0, 1], [2, 4])  # root -> {1 -> {3}, 2 -> {4}}: the chain is 1 -> 3
    (2, 0)
    >>> chain_in_tree([-1, -1, 0, 1], [1])
    (2, 1)
    """
    children = step_children(parents)
    chain, node = [], 0
    while children[node]:
        node = children[node][0]
        chain.append(node)
    kept = 0
    while kept < min(len(chain), len(path)) and chain[kept] == path[kept]:
        kept += 1
    return len(chain), kept


def verify_tree_greedy(tokens: list[int], parents: list[int],
                       target_logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """Greedy tree verification over ``target_logits [1 + len(tokens), V]`` (row ``m``: after step node ``m``).

    Returns ``(emitted tokens, accepted step nodes)``: the longest root path equal to the target's
    argmax, then one target token.

    >>> logits = torch.eye(6)[[2, 0, 4, 5]]  # argmax after root: 2; after node 1: 0; node 2: 4; node 3: 5
    >>> verify_tree_greedy([1, 2, 4], [-1, -1, 1], logits)  # root -> {1, 2 -> {4}}
    ([2, 4, 5], [2, 3])
    """
    assert target_logits.shape[0] == len(tokens) + 1, "target_logits must have one row per step node"
    return accept_tree(tokens, parents, target_logits.argmax(dim=-1).tolist().__getitem__)


def accept_tree(tokens: list[int], parents: list[int],
                target_token: Callable[[int], int]) -> tuple[list[int], list[int]]:
    """The longest root path whose nodes carry the target's own token after their parent (``target_token(m)``:
    the argmax, or the draw of the uniform of the output position it decides, of the row after step node
    ``m``; asked only for the nodes reached), then that token where it stops (see the module docstring)."""
    children = step_children(parents)
    node, out, path = 0, [], []
    while True:
        want = target_token(node)
        out.append(want)
        nxt = next((c for c in children[node] if tokens[c - 1] == want), None)
        if nxt is None:
            return out, path
        node = nxt
        path.append(node)


def node_depths(parents: list[int]) -> list[int]:
    """Each step node's depth (node 0, the fed token, is the root at 0; node ``m`` is draft ``m - 1``, whose
    parent index ``parents[m - 1]`` is -1 for the root or an earlier draft's)."""
    depths = [0]
    for p in parents:
        depths.append(depths[p + 1] + 1)
    return depths


def verify_tree_sampling(tokens: list[int], parents: list[int], target_probs: torch.Tensor,
                         draws: list[float]) -> tuple[list[int], list[int]]:
    """Lossless sampling over a token tree of deterministic candidates. ``target_probs [1 + len(tokens), V]``,
    row ``m``: the target's distribution after step node ``m``; ``draws``: the draw uniforms of the output
    positions from the step's first on (at least the tree's depth + 1).

    From the root, draw the token of the next position from the node's row with that position's uniform
    (as plain decoding would); if a child of the node carries that token, keep it and move there, else
    emit the token and stop. Every emitted token is the target's own draw, so the output is exactly plain
    decoding's from the same uniforms, and a node's children are kept with probability ``sum_j p(x_j)``,
    as SpecInfer's recursive rejection over deterministic candidates keeps them.

    Returns ``(emitted tokens, accepted step nodes)``, like :func:`verify_tree_greedy`.
    """
    assert target_probs.shape[0] == len(tokens) + 1, "target_probs must have one row per step node"
    depths = node_depths(parents)
    return accept_tree(tokens, parents, lambda node: draw_token(target_probs[node], draws[depths[node]]))


def keep_path(kv_cache: list[tuple[torch.Tensor, ...]], slots: list[int], path: list[int]) -> int:
    """Move the accepted tree nodes' K/V (and scales) to the sequence's next cache indices.

    ``slots[m]``: the cache slot of verify-step node ``m`` (its cache index is the step's first plus
    ``m``); ``path``: the accepted nodes in root-path order. Node ``path[t - 1]`` moves to index ``t``,
    after the root, in every layer's cache tensors. ``path[t - 1] >= t``, so no source is overwritten
    before it is read. The other nodes' slots are past the committed length and are released by the
    caller. Returns the bytes copied.
    """
    src = torch.tensor([slots[m] for m in path], dtype=torch.long)
    dst = torch.tensor(slots[1:len(path) + 1], dtype=torch.long)
    moved = 0
    for layer in kv_cache:
        for t in hot_tensors(layer):  # [num_blocks, page_size, ...]: K, V and, when quantized, their scales
            raw = t.view(torch.uint8) if t.element_size() == 1 else t  # fp8 has no index_copy: its bytes do
            flat = raw.view(-1, *t.shape[2:])
            rows = flat.index_select(0, src.to(t.device))
            flat.index_copy_(0, dst.to(t.device), rows)
            moved += rows.numel() * rows.element_size()
    return moved
