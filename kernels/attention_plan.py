"""The CPU reference attention's per-step plan: which cache slots each sequence reads, and masks.

Everything the torch reference needs besides q and the cache depends only on the step's
metadata (block tables, lengths, query ranges, positions), which every layer shares. So the
plan is built once per step, by the first layer, and reused by the others (``plan_for`` keeps
the last plan and the metadata tensors it came from; a new step passes new tensors).

A plan is a list of :class:`AttentionGroup`. Sequences with at most ``BATCHED_MAX_QUERIES``
new tokens (decodes, speculative verifies) share one padded group; each longer one (a prefill
chunk) is a group of its own. A group reads ``B`` rows of ``L`` keys by flat slot index
(``block * page_size + offset``); keys past a sequence's length are padding: they are masked
and point at the sequence's own first slot. Reading a real key there (never the stale or
unwritten slots past the end, whose bytes may be anything, even NaN) keeps every gathered
value finite, so a masked key adds exactly ``0 * finite = 0`` to ``probs @ V`` and no
zeroing pass is needed. (Position 0 of a sequence is always written: by this step's cache
write, which runs before attention in each layer, or by an earlier step.)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .tree_mask import unpack

BATCHED_MAX_QUERIES = 16  # sequences with at most this many new tokens share one padded SDPA call


@dataclass
class AttentionGroup:
    batch: int  # B sequences
    num_queries: int  # Q query rows per sequence (padded)
    num_keys: int  # L keys per sequence (padded)
    slots: torch.Tensor  # [B * L] int64 flat cache slots (padding keys: the sequence's first slot)
    query_rows: torch.Tensor | slice  # [B * Q] stream rows feeding the padded queries (or a slice)
    keep: torch.Tensor | None  # [M] int64 padded rows that are real (None: all)
    out_rows: torch.Tensor | slice  # [M] stream rows the real rows are written to (or a slice)
    mask: torch.Tensor | None  # [B, 1, G * Q, L] bool, True = visible; None: all visible
    query_positions: torch.Tensor  # [B, Q] int64 positions of the padded query rows (ALiBi's bias)
    key_positions: torch.Tensor | None = None  # [B, L] int64 positions of the keys (None: key index = position)


class _LastStep:
    key: tuple = ()
    tensors: tuple = ()
    plans: dict = {}  # (page_size, group, window) -> plan, for the step's metadata tensors


_LAST = _LastStep()


def plan_for(block_tables, seq_lens, query_start_loc, positions, page_size: int, group: int,
             window: int = 0, tree_mask: torch.Tensor | None = None) -> list[AttentionGroup]:
    """The step's plan, built on the first call for these metadata tensors and reused after (one per
    layer shape and window: layers with and without a sliding window may alternate)."""
    tensors = (block_tables, seq_lens, query_start_loc, positions, tree_mask)
    key = tuple(None if t is None else t._version for t in tensors)
    # identity, not equality: the cached tensors are kept alive, so their ids cannot be reused
    if not (key == _LAST.key and all(a is b for a, b in zip(tensors, _LAST.tensors))):
        _LAST.key, _LAST.tensors, _LAST.plans = key, tensors, {}
    kind = (page_size, group, window)
    if kind not in _LAST.plans:
        _LAST.plans[kind] = build_plan(block_tables, seq_lens, query_start_loc, positions, page_size, group, window,
                                       tree_mask)
    return _LAST.plans[kind]


def build_plan(block_tables, seq_lens, query_start_loc, positions, page_size: int, group: int,
               window: int = 0, tree_mask: torch.Tensor | None = None) -> list[AttentionGroup]:
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    # a sequence without keys (a step's padding sequence) reads nothing: its rows stay 0
    runs = [(s, starts[s], starts[s + 1] - starts[s], lens[s]) for s in range(len(lens))
            if starts[s + 1] > starts[s] and lens[s] > 0]
    short = [r for r in runs if r[2] <= BATCHED_MAX_QUERIES]
    long = [r for r in runs if r[2] > BATCHED_MAX_QUERIES]
    tables = block_tables.long()
    num_tokens = positions.shape[0]
    groups = [_group(tables, positions, [r], page_size, group, num_tokens, window, tree_mask) for r in long]
    if short:
        groups.append(_group(tables, positions, short, page_size, group, num_tokens, window, tree_mask))
    return groups


def _group(tables, positions, runs, page_size: int, group: int, num_tokens: int, window: int,
           tree_mask: torch.Tensor | None) -> AttentionGroup:
    device = positions.device
    B = len(runs)
    qmax = max(n for _, _, n, _ in runs)
    L = max(length for *_, length in runs)
    seq_ids = torch.tensor([s for s, *_ in runs], device=device)
    lens = torch.tensor([length for *_, length in runs], device=device).view(B, 1)
    key_pos = torch.arange(L, device=device).view(1, L)
    live = key_pos < lens  # [B, L]
    pages = tables.index_select(0, seq_ids)  # [B, max_blocks]
    block = pages.gather(1, (key_pos // page_size).clamp_max(pages.shape[1] - 1).expand(B, L))
    slots = block * page_size + key_pos % page_size
    slots = torch.where(live, slots, slots[:, :1]).reshape(-1)

    starts = [start for _, start, _, _ in runs]
    counts = [n for _, _, n, _ in runs]
    contiguous = all(n == qmax for n in counts) and all(b - a == qmax for a, b in zip(starts, starts[1:]))
    if contiguous:  # the group's queries are one contiguous range of the stream, no padding
        query_rows = out_rows = slice(starts[0], starts[0] + B * qmax)
        keep = None
        q_pos = positions[query_rows].view(B, qmax)
    else:
        rows = torch.cat([torch.arange(a, a + qmax) for a in starts]).clamp_max(num_tokens - 1).to(device)
        valid = torch.cat([torch.arange(qmax) < n for n in counts]).to(device)
        query_rows = rows
        keep = valid.nonzero().view(-1)
        out_rows = rows.index_select(0, keep)
        q_pos = torch.where(valid, positions.index_select(0, rows), 0).view(B, qmax)
    # a query at position p sees keys 0..p of its own sequence (capped at the sequence's length), and
    # with a sliding window only the last `window` of them (p - window < j); in a tree step, the new
    # keys are seen by the mask's bits, at their own positions (tree_mask.py)
    k_pos = key_pos if tree_mask is None else _tree_key_positions(positions, runs, L)  # [1 or B, L]
    visible = (k_pos.view(-1, 1, L) <= q_pos.view(B, qmax, 1)) & live.view(B, 1, L)  # [B, Q, L]
    if tree_mask is not None:
        visible &= _tree_visible(tree_mask, runs, query_rows, qmax, L)
    if window > 0:
        visible &= k_pos.view(-1, 1, L) > q_pos.view(B, qmax, 1) - window
    if bool(visible.all()):
        mask = None
    else:
        mask = visible.repeat(1, group, 1).unsqueeze(1)  # [B, 1, G * Q, L]; row g * Q + t
    return AttentionGroup(B, qmax, L, slots, query_rows, keep, out_rows, mask, q_pos.long(),
                          None if tree_mask is None else k_pos)


def _tree_key_positions(positions: torch.Tensor, runs, L: int) -> torch.Tensor:  # [B, L] int64
    """Key positions in a tree step: committed key ``j`` is at ``j``; new key ``base + r`` at its token's."""
    rows = []
    for _, start, n, length in runs:
        base = length - n
        new = positions[start:start + n].long()
        rows.append(torch.cat([torch.arange(base, device=positions.device), new,
                               torch.arange(length, L, device=positions.device)]))
    return torch.stack(rows)


def _tree_visible(tree_mask: torch.Tensor, runs, query_rows, qmax: int, L: int) -> torch.Tensor:  # [B, Q, L]
    """Which keys each padded query row's tree bits let it see (committed keys: all)."""
    B = len(runs)
    num_rows = tree_mask.shape[0]
    rows = torch.arange(num_rows)[query_rows] if isinstance(query_rows, slice) else query_rows
    words = tree_mask.index_select(0, rows.to(tree_mask.device).clamp_max(num_rows - 1))  # [B * Q, W]
    bits = unpack(words, L).view(B, qmax, L)  # bit r: new key r
    out = torch.ones(B, qmax, L, dtype=torch.bool, device=tree_mask.device)
    for b, (_, _, n, length) in enumerate(runs):
        base = length - n
        own = torch.arange(qmax, device=tree_mask.device).view(qmax, 1)  # local index of the query row
        out[b, :, base:] = bits[b, :, :L - base] & (torch.arange(L - base, device=tree_mask.device) <= own)
    return out


def attend(
    q: torch.Tensor,  # [N, num_heads, head_dim]
    plan: list[AttentionGroup],
    gather: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    kv_heads: int,
    scale: float,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:  # [N, num_heads, head_dim], q.dtype, contiguous
    """Run the plan: per group one gather of its slots and one SDPA call (GQA folded into queries).

    ``gather(slots) -> (k, v)``, each ``[len(slots), kv_heads, head_dim]`` in any float dtype.
    ``softcap`` and ``alibi_slopes`` change the scores (see :func:`scores_then_softmax`); the
    window is in the plan's masks.
    """
    num_tokens, num_heads, head_dim = q.shape
    G = num_heads // kv_heads
    out = q.new_zeros(q.shape)  # rows no group covers (padding tokens) are 0, as in the other kernels
    for grp in plan:
        B, Q, L = grp.batch, grp.num_queries, grp.num_keys
        k, v = gather(grp.slots)
        k = k.view(B, L, kv_heads, head_dim).transpose(1, 2).float()  # [B, KVH, L, D]
        v = v.view(B, L, kv_heads, head_dim).transpose(1, 2).float()
        q_g = q[grp.query_rows] if isinstance(grp.query_rows, slice) else q.index_select(0, grp.query_rows)
        q_g = q_g.float().view(B, Q, kv_heads, G, head_dim).permute(0, 2, 3, 1, 4).reshape(B, kv_heads, G * Q, head_dim)
        if softcap > 0 or alibi_slopes is not None:
            o = scores_then_softmax(q_g, k, v, grp, scale, softcap, alibi_slopes)
        else:
            o = F.scaled_dot_product_attention(q_g, k, v, attn_mask=grp.mask, scale=scale)  # [B, KVH, G*Q, D]
        o = o.view(B, kv_heads, G, Q, head_dim).permute(0, 3, 1, 2, 4).reshape(B * Q, num_heads, head_dim)
        if grp.keep is None:
            out[grp.out_rows] = o
        else:
            out.index_copy_(0, grp.out_rows, o.index_select(0, grp.keep).to(out.dtype))
    return out


def scores_then_softmax(q_g, k, v, grp: AttentionGroup, scale: float, softcap: float,
                        alibi_slopes: torch.Tensor | None) -> torch.Tensor:
    """Attention with modified scores, for one group (``q_g [B, KVH, G*Q, D]``; k, v ``[B, KVH, L, D]``).

    The score of query ``t`` (position ``p``, head ``h``) for key ``j`` is ``s = scale * q.k``, then
    ``softcap * tanh(s / softcap)`` when ``softcap > 0`` (Gemma 2), then plus
    ``alibi_slopes[h] * (j - p)`` when slopes are given (ALiBi; the same softmax as Bloom's
    ``slope * j``, without the large values); masked keys are dropped; softmax in float32.
    """
    B, KVH, GQ, _ = q_g.shape
    Q, L = grp.num_queries, grp.num_keys
    G = GQ // Q
    s = torch.matmul(q_g, k.transpose(-1, -2)) * scale  # [B, KVH, G*Q, L]
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    if alibi_slopes is not None:
        slopes = alibi_slopes.float().view(1, KVH, G, 1, 1)
        keys = torch.arange(L, device=s.device).view(1, L) if grp.key_positions is None else grp.key_positions
        dist = keys.view(-1, 1, 1, 1, L) - grp.query_positions.view(B, 1, 1, Q, 1)  # [B, 1, 1, Q, L]
        s = s + (slopes * dist).view(B, KVH, GQ, L)
    if grp.mask is not None:
        s = s.masked_fill(~grp.mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)
