"""``draft="eagle"`` / ``"eagle:PATH"``: drafts from an EAGLE head over the target's own features.

The engine runs the target with its last hidden states as an extra output (the ``hidden_states``
pass) and hands each sequence's features to :meth:`EagleProposer.on_features`; the head
(``runtime/heads/eagle.py``, slot ``t`` = ``(x_t, f_{t-1})``) keeps its K/V in its own cache tensors
indexed by the target's block tables. Each draft first feeds the slots of the committed tokens the
head has not seen, with the target's true features, up to the last committed token; that slot's
output drafts the first token; later steps feed ``(drafted token, predicted feature)``. Slots past
the committed tokens are scratch: the next step re-feeds them with true features.

A prefix-cache hit skips the target's forward, and so the features, of the cached tokens: the head
then trusts its K/V in the shared blocks (a slot depends only on the tokens up to it). K/V a drafting
sequence never wrote there can only lower acceptance: verification stays exact.
"""
from __future__ import annotations

import torch

from ...compiler.program import AttentionMetadata
from ...kernels.tree_mask import mask_words
from ..heads.eagle import EagleHead
from ..kv_manager import KVCacheManager
from ..token_tree import TreeBuilder, TreeShape
from .base import Draft, DraftContext, DraftRequest
from .learned import candidate_rows, draw, load_target_head

DEFAULT_TREE = "static:2,1,1"  # 7 tokens: fits the 8-token static step graph (bench_trees.py, tuning prompts)


class EagleProposer:
    name = "eagle"
    wants_features = True  # the engine hands over the target's hidden states (on_features)
    shares_target_cache = False  # its own cache tensors: the engine's copy-on-write copies them too

    def __init__(self, head: EagleHead, kv: KVCacheManager, page_size: int, num_blocks: int, device):
        self.head, self.kv, self.page_size = head, kv, page_size
        self.kv_cache = [head.new_cache(num_blocks, page_size, device, head.compute_dtype)]
        self._fed: dict[int, int] = {}  # slots of each sequence holding true pairs
        self._feats: dict[int, tuple[int, list[torch.Tensor]]] = {}  # (first position, [n_i, hidden] chunks) not fed

    # ------------------------------------------------------------ features
    def on_features(self, request_id: int, first: int, feats: torch.Tensor) -> None:
        """The target's features ``f_first .. f_{first+n-1}`` of one sequence (later ones replace earlier)."""
        feats = feats.to(self.head.compute_dtype).clone()  # (not a view keeping the whole step's states alive)
        start, chunks = self._feats.get(request_id, (first, []))
        held = sum(len(c) for c in chunks)
        if not start <= first <= start + held:  # a gap (a prefix-cache hit, a recompute): start over
            start, chunks, held = first, [], 0
        if first < start + held:  # re-sent positions replace the held ones
            chunks = [torch.cat(chunks)[:first - start]]
        self._feats[request_id] = (start, chunks + [feats])

    def _true_pairs(self, r: DraftRequest) -> tuple[int, list[int], torch.Tensor] | None:
        """``(first slot, tokens, features)`` of the committed slots to feed, through the last committed
        token's (slot ``t`` takes ``f_{t-1}``; slot 0 zeros); None when the features for them are missing."""
        rid, n = r.request_id, len(r.token_ids)
        first, chunks = self._feats.get(rid, (0, []))
        if not chunks:
            return None
        feats = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
        if first + len(feats) < n - 1:
            return None
        start = max(self._fed.get(rid, 0), 0 if first == 0 else first + 1)
        if start > n - 1:
            return None
        if start == 0:
            rows = torch.cat([feats.new_zeros(1, feats.shape[1]), feats[:n - 1]])
        else:
            rows = feats[start - 1 - first:n - 1 - first]
        return start, r.token_ids[start:], rows

    def _feed_committed(self, live: list[DraftRequest]) -> tuple[list[DraftRequest], torch.Tensor]:
        """Feed each request's unseen committed slots; the requests that could, and their last slot's output."""
        ready, ids, feats, seqs = [], [], [], []
        for r in live:
            pairs = self._true_pairs(r)
            if pairs is None:
                continue
            start, toks, rows = pairs
            ready.append(r)
            ids += toks
            feats.append(rows)
            seqs.append((self.kv.block_table(r.request_id), start, len(toks)))
        if not ready:
            return [], torch.empty(0)
        g = self._forward(ids, torch.cat(feats), seqs, [[n - 1] for _, _, n in seqs])
        for r in ready:
            self._fed[r.request_id] = len(r.token_ids)
            self._feats[r.request_id] = (len(r.token_ids) - 1, [])  # f_{n-1} comes with the verify
        return ready, g

    def _forward(self, ids: list[int], feats: torch.Tensor, seqs, want, trees=None, tree_words=0) -> torch.Tensor:
        device = feats.device
        meta = AttentionMetadata.build(seqs, self.page_size, want, trees, tree_words).to(device)
        with torch.no_grad():
            g = self.head.forward_paged(torch.tensor(ids, dtype=torch.long, device=device), feats, meta,
                                        *self.kv_cache[0])
        return g.index_select(0, meta.logits_indices) if trees is None else g

    # ------------------------------------------------------------- drafting
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = {r.request_id: [] for r in requests}
        qs: dict[int, list[torch.Tensor]] = {r.request_id: [] for r in requests}
        live, g = self._feed_committed([r for r in requests if r.k > 0])
        step = 0
        while live:
            logits = self.head.draft_logits(g)
            for row, r in enumerate(live):
                drafts[r.request_id].append(draw(self.head, r, logits[row], qs[r.request_id]))
            step += 1
            keep = [row for row, r in enumerate(live) if step < r.k]
            if not keep:
                break
            live = [live[row] for row in keep]
            g = g[keep]
            n = {r.request_id: len(r.token_ids) for r in live}
            seqs = [(self.kv.block_table(r.request_id), n[r.request_id] - 1 + step, 1) for r in live]
            g = self._forward([drafts[r.request_id][-1] for r in live], g, seqs, [[0]] * len(live))
        return [Draft(drafts[r.request_id], probs=torch.stack(qs[r.request_id]) if qs[r.request_id] else None)
                for r in requests]

    def propose_tree(self, requests: list[DraftRequest], shape: TreeShape) -> list[Draft]:
        """Token trees (``TreeBuilder``) from the head's most probable draft-vocabulary tokens: level 1 from the
        last committed slot's output; each later level feeds the tree so far as one tree step (node ``i`` at
        slot ``n + i``: its token and its parent's predicted feature) for the newest level's outputs."""
        builders = {r.request_id: TreeBuilder(shape, max_depth=r.k) for r in requests}
        width = max(shape.level_widths, default=1)
        live, g = self._feed_committed([r for r in requests if not builders[r.request_id].done])
        root = dict(zip((r.request_id for r in live), g))
        outputs: dict[int, torch.Tensor] = {}
        for r, level in zip(live, candidate_rows(self.head, g, width) if live else []):
            builders[r.request_id].add_level([level])
        words = mask_words(shape.scratch_nodes)
        while live := [r for r in live if not builders[r.request_id].done]:
            ids, feats, seqs, want, trees = [], [], [], [], {}
            for s, r in enumerate(live):
                b = builders[r.request_id]
                ids += b.tokens
                feats += [root[r.request_id] if p < 0 else outputs[r.request_id][p] for p in b.parents]
                seqs.append((self.kv.block_table(r.request_id), len(r.token_ids), len(b.tokens)))
                want.append(list(b.frontier))
                trees[s] = b.parents
            g = self._forward(ids, torch.stack(feats), seqs, want, trees, words)
            offset, rows = 0, []
            for r, (_, _, n) in zip(live, seqs):
                outputs[r.request_id] = g[offset:offset + n]
                rows += [offset + node for node in builders[r.request_id].frontier]
                offset += n
            levels = iter(candidate_rows(self.head, g[rows], width))  # the frontier nodes of every tree at once
            for r in live:
                b = builders[r.request_id]
                b.add_level([next(levels) for _ in b.frontier])
        out = []
        for r in requests:
            tokens, parents = builders[r.request_id].result()
            out.append(Draft(tokens, parents=parents))
        return out

    # ---------------------------------------------------------- bookkeeping
    def on_verified(self, request_id: int, num_committed: int) -> None:
        self._fed[request_id] = min(self._fed.get(request_id, 0), num_committed)

    def release(self, request_id: int) -> None:
        self._fed.pop(request_id, None)
        self._feats.pop(request_id, None)


def eagle_proposer(arg: str, ctx: DraftContext) -> EagleProposer:
    head = load_target_head(arg, ctx, EagleHead)
    return EagleProposer(head, ctx.kv, ctx.page_size, ctx.num_blocks, ctx.device)


def _register() -> None:
    from . import register_proposer

    register_proposer("eagle", eagle_proposer, "eagle (the shipped head) or eagle:PATH", features=True,
                      default_tree=DEFAULT_TREE)


_register()
