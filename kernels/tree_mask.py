"""Token trees in attention: the ancestor mask every paged-attention kernel takes.

A step may feed, per sequence, a *tree* of new tokens instead of a chain: node ``m`` (its
``m``-th new token in the stream) has a parent ``parents[m] < m`` (``-1``: the root, which
follows the committed tokens), so siblings share a depth and a position. Two things then
differ from a chain:

* **cache index vs position**: node ``m`` is written to the sequence's cache index
  ``base + m`` (``base = seq_lens[s] - n_s``, the first index this step writes; ``n_s`` its
  new tokens), while its position (RoPE, ALiBi, window) is ``base + depth(m)``;
* **visibility**: a node sees the committed keys and its own ancestors (itself included),
  never a sibling's branch.

``tree_mask`` (``int32 [N, W]``, optional in every attention op) carries the second: bit ``r``
of token ``i``'s row (word ``r // 32``, bit ``r % 32``) says whether ``i`` sees the ``r``-th new
key of its sequence. The full rule, for token ``i`` of sequence ``s`` (local index ``m_i``),
and key cache index ``j < seq_lens[s]`` whose position is ``kp = j`` for ``j < base`` and
``kp = positions[query_start_loc[s] + j - base]`` for ``j >= base``:

    visible(i, j) = j <= base + m_i
                    and (j < base or j - base >= 32 * W or bit(j - base) of tree_mask[i])
                    and kp <= positions[i]
                    and (window == 0 or kp > positions[i] - window)

ALiBi's bias is ``slope * (kp - positions[i])``. A row of ``-1`` (all bits) gives a chain's or a
prefill chunk's plain causal rule, so a step mixing trees, decodes and prefill chunks is one
call; new keys past ``32 * W`` (a long prefill chunk) fall back to that rule. Without
``tree_mask`` the kernels run the chain rule (``paged_attention.py``'s glossary).

:func:`ancestor_mask` packs parent lists; :func:`dense_tree_attention` is the float64 reference
the kernel tests fuzz against (one query at a time, straight from the rule above).
"""
from __future__ import annotations

import torch

BITS = 32  # mask bits per int32 word


def mask_words(max_nodes: int) -> int:
    """Words per row for trees of up to ``max_nodes`` new tokens per sequence."""
    return max(1, -(-max_nodes // BITS))


def depths(parents: list[int]) -> list[int]:
    """Depth of each node (root: 0); ``parents[m] < m`` (``-1`` for the root)."""
    out: list[int] = []
    for m, p in enumerate(parents):
        if not -1 <= p < m:
            raise ValueError(f"tree parents must satisfy -1 <= parents[m] < m; node {m} has parent {p}")
        out.append(0 if p < 0 else out[p] + 1)
    return out


def ancestor_mask(parents: list[int], words: int) -> torch.Tensor:  # [len(parents), words] int32
    """Row ``m``: bits of node ``m``'s ancestors and itself (the tree's rows of ``tree_mask``)."""
    n = len(parents)
    if n > words * BITS:
        raise ValueError(f"a tree of {n} nodes does not fit a mask of {words} x {BITS} bits")
    depths(parents)  # validates
    rows = []
    for m, p in enumerate(parents):
        row = (rows[p] if p >= 0 else 0) | (1 << m)
        rows.append(row)
    out = torch.zeros(n, words, dtype=torch.int64)
    for w in range(words):
        out[:, w] = torch.tensor([(r >> (BITS * w)) & 0xFFFFFFFF for r in rows], dtype=torch.int64)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def causal_rows(n: int, words: int) -> torch.Tensor:  # [n, words] int32
    """Rows for tokens outside any tree (decodes, chains, prefill chunks): every bit set."""
    return torch.full((n, words), -1, dtype=torch.int32)


def unpack(tree_mask: torch.Tensor, num_bits: int) -> torch.Tensor:  # [N, num_bits] bool
    """The mask's first ``num_bits`` bits per row (bits past its words count as set)."""
    n, words = tree_mask.shape
    shifts = torch.arange(BITS, device=tree_mask.device, dtype=torch.int32)
    bits = ((tree_mask.unsqueeze(-1) >> shifts) & 1).bool().reshape(n, words * BITS)
    if num_bits <= words * BITS:
        return bits[:, :num_bits]
    return torch.cat([bits, bits.new_ones(n, num_bits - words * BITS)], dim=1)


def check_tree_mask(q: torch.Tensor, tree_mask: torch.Tensor | None) -> None:
    """``ValueError`` unless ``tree_mask`` is None or int32 ``[N, W]`` on q's device."""
    if tree_mask is None:
        return
    if tree_mask.dtype != torch.int32 or tree_mask.dim() != 2 or tree_mask.shape[0] != q.shape[0] \
            or tree_mask.shape[1] < 1:
        raise ValueError(f"tree_mask must be int32 [N={q.shape[0]}, W>=1]; got {tree_mask.dtype} "
                         f"{tuple(tree_mask.shape)}")
    if tree_mask.device != q.device:
        raise ValueError(f"tree_mask is on {tree_mask.device}, q on {q.device}")


def dense_tree_attention(q, keys, values, positions, seq_lens, query_start_loc, scale, tree_mask=None, window=0,
                         softcap=0.0, alibi_slopes=None) -> torch.Tensor:  # [N, H, D] float64
    """The rule of the module docstring in float64, one query at a time (tests only).

    ``keys[s]`` / ``values[s]``: ``[seq_lens[s], KVH, D]``, sequence ``s``'s K/V by cache index.
    """
    N, H, D = q.shape
    out = torch.zeros(N, H, D, dtype=torch.float64)
    qsl = query_start_loc.tolist()
    for s in range(len(qsl) - 1):
        n = qsl[s + 1] - qsl[s]
        length = int(seq_lens[s])
        if n == 0 or length == 0:
            continue
        base = length - n
        k, v = keys[s].double(), values[s].double()
        G = H // k.shape[1]
        kp = [j if j < base else int(positions[qsl[s] + j - base]) for j in range(length)]
        for m in range(n):
            i = qsl[s] + m
            p = int(positions[i])
            words = 0 if tree_mask is None else tree_mask.shape[1]
            seen = []
            for j in range(min(length, base + m + 1)):
                r = j - base
                key_pos = j if tree_mask is None else kp[j]
                if tree_mask is None:
                    ok = j <= p
                else:
                    bit = r < 0 or r >= BITS * words or (int(tree_mask[i, r // BITS]) >> (r % BITS)) & 1
                    ok = bool(bit) and key_pos <= p
                if ok and window > 0:
                    ok = key_pos > p - window
                if ok:
                    seen.append(j)
            if not seen:
                continue
            idx = torch.tensor(seen)
            for h in range(H):
                s_ = (k[idx, h // G] @ q[i, h].double()) * scale
                if softcap > 0:
                    s_ = softcap * torch.tanh(s_ / softcap)
                if alibi_slopes is not None:
                    dist = [(j if tree_mask is None else kp[j]) - p for j in seen]
                    s_ = s_ + float(alibi_slopes[h]) * torch.tensor(dist, dtype=torch.float64)
                out[i, h] = torch.softmax(s_, 0) @ v[idx, h // G]
    return out


def random_tree(n: int, gen: torch.Generator, max_children: int = 3) -> list[int]:
    """Parents of a random tree of ``n`` nodes (tests): each node hangs under an earlier one with room."""
    parents = [-1]
    children = [0]
    for m in range(1, n):
        open_nodes = [a for a in range(m) if children[a] < max_children]
        p = open_nodes[int(torch.randint(len(open_nodes), (1,), generator=gen))]
        parents.append(p)
        children[p] += 1
        children.append(0)
    return parents

