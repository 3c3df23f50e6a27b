"""``draft="medusa"`` / ``"medusa:PATH"``: drafts from Medusa heads over the target's last hidden state.

The engine hands each sequence's features over (:meth:`MedusaProposer.on_features`); the proposer keeps
only the newest. Once the target has produced the last committed token ``n - 1`` from ``f_{n-2}``, head
``k`` guesses token ``n - 1 + k`` from that one feature (``runtime/heads/medusa.py``): a chain is the
heads' best tokens, a tree the top tokens of head ``d`` under every node of depth ``d - 1`` (Medusa's
cartesian candidates; a dynamic shape ranks them by the product of their probabilities). No cache is
written, so the controller may ask for drafts it does not verify.
"""
from __future__ import annotations

import torch

from ..heads.medusa import MedusaHeads
from ..token_tree import TreeBuilder, TreeShape
from .base import Draft, DraftContext, DraftRequest
from .learned import candidates, draw, load_target_head

DEFAULT_TREE = "static:2,1"  # 5 tokens; larger trees lost to no speculation (bench_trees.py, tuning prompts)


class MedusaProposer:
    name = "medusa"
    wants_features = True  # the engine hands over the target's hidden states (on_features)
    writes_cache = False

    def __init__(self, head: MedusaHeads):
        self.head = head
        self._last: dict[int, tuple[int, torch.Tensor]] = {}  # request -> (position, its feature)

    def on_features(self, request_id: int, first: int, feats: torch.Tensor) -> None:
        self._last[request_id] = (first + len(feats) - 1, feats[-1].to(self.head.compute_dtype).clone())

    def _guesses(self, requests: list[DraftRequest]) -> tuple[list[DraftRequest], list[torch.Tensor]]:
        """The requests whose newest feature is ``f_{n-2}``, and each head's features for them (``[R, hidden]``)."""
        ready = [r for r in requests if self._last.get(r.request_id, (-1,))[0] == len(r.token_ids) - 2]
        if not ready:
            return [], []
        with torch.no_grad():
            return ready, self.head(torch.stack([self._last[r.request_id][1] for r in ready]))

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        ready, heads = self._guesses([r for r in requests if r.k > 0])
        drafts: dict[int, Draft] = {}
        if ready:
            logits = [self.head.draft_logits(g) for g in heads]
            for row, r in enumerate(ready):
                qs: list[torch.Tensor] = []
                tokens = [draw(self.head, r, lg[row], qs) for lg in logits[:r.k]]
                drafts[r.request_id] = Draft(tokens, probs=torch.stack(qs) if qs else None)
        return [drafts.get(r.request_id, Draft([])) for r in requests]

    def propose_tree(self, requests: list[DraftRequest], shape: TreeShape) -> list[Draft]:
        ready, heads = self._guesses(requests)
        out = {}
        for row, r in enumerate(ready):
            b = TreeBuilder(shape, max_depth=min(r.k, len(heads)))
            while not b.done:
                level = candidates(self.head, heads[b.level][row], b)
                b.add_level([level] * len(b.frontier))
            tokens, parents = b.result()
            out[r.request_id] = Draft(tokens, parents=parents)
        return [out.get(r.request_id, Draft([], parents=[])) for r in requests]

    def on_verified(self, request_id: int, num_committed: int) -> None:
        pass

    def release(self, request_id: int) -> None:
        self._last.pop(request_id, None)


def medusa_proposer(arg: str, ctx: DraftContext) -> MedusaProposer:
    return MedusaProposer(load_target_head(arg, ctx, MedusaHeads))


def _register() -> None:
    from . import register_proposer

    register_proposer("medusa", medusa_proposer, "medusa (the shipped heads) or medusa:PATH", features=True,
                      default_tree=DEFAULT_TREE)


_register()
