"""``draft="<kind>+ngram"`` (e.g. ``"eagle+ngram"``): a tree-drafting proposer's tree plus a prompt-lookup branch.

A learned head guesses what the text says next; prompt lookup (``ngram.py``) knows what it said before.
They fail on different tokens: on the target's greedy answers to the benchmarks' tuning prompts
(chains of 3 from the shipped EAGLE head, walked as a verify loop walks them), the head alone keeps
1.91 / 1.52 tokens per forward on code / chat, and the better of its chain and the lookup's
continuation 2.43 / 1.70. So each tree the primary proposer drafts gets the lookup's continuation as
one more root path, verified in the same forward: it follows the tree's nodes while they carry its
tokens and hangs the rest below the last one it reached (a shared prefix costs nothing). A longer
matched suffix is likelier to continue, so the branch is ``BRANCH_PER_MATCHED_TOKEN`` tokens per
matched token (at most :data:`BRANCH_NODES`), and none without a match.

The branch adds at most :data:`BRANCH_NODES` nodes to a tree (``extra_tree_nodes``: the engine compiles
and reserves room for them). Chains (``propose``, e.g. when the adaptive controller picks a chain) are
the primary's. Every draft stays exact: the verify keeps only what the target itself would emit.
"""
from __future__ import annotations

from .base import Draft, DraftRequest
from .ngram import NgramProposer

BRANCH_NODES = 6  # the most nodes a branch adds (3-token matches: the longest suffix ngram looks up)
BRANCH_PER_MATCHED_TOKEN = 2


def add_branch(tokens: list[int], parents: list[int], branch: list[int]) -> tuple[list[int], list[int]]:
    """The tree ``(tokens, parents)`` with ``branch`` as a root path: its tokens follow existing nodes while a
    child carries the next one, then go below the last node reached, in order (parents precede children).

    >>> add_branch([5, 6, 7], [-1, -1, 0], [5, 7, 9])  # root -> {5 -> {7}, 6}: 5, 7 exist; 9 hangs below 7
    ([5, 6, 7, 9], [-1, -1, 0, 2])
    """
    tokens, parents = list(tokens), list(parents)
    node = -1
    for i, t in enumerate(branch):
        child = next((c for c, (tc, pc) in enumerate(zip(tokens, parents)) if pc == node and tc == t), None)
        if child is None:
            for t_new in branch[i:]:
                tokens.append(t_new)
                parents.append(node)
                node = len(tokens) - 1
            break
        node = child
    return tokens, parents


class LookupBranch:
    """``primary``'s drafts; its trees with a prompt-lookup branch added (see the module docstring)."""

    extra_tree_nodes = BRANCH_NODES

    def __init__(self, primary, lookup: NgramProposer | None = None):
        if not callable(getattr(primary, "propose_tree", None)):
            raise ValueError(f"draft='{getattr(primary, 'name', primary)}+ngram': a lookup branch joins a proposer "
                             f"that drafts token trees")
        self.primary = primary
        self.lookup = lookup if lookup is not None else NgramProposer()
        self.name = f"{getattr(primary, 'name', 'draft')}+{self.lookup.name}"

    def __getattr__(self, attr):  # the primary's hooks and traits: features, caches, head
        if attr == "primary":  # (not set yet: during unpickling or before __init__)
            raise AttributeError(attr)
        return getattr(self.primary, attr)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return self.primary.propose(requests)

    def propose_tree(self, requests: list[DraftRequest], shape) -> list[Draft]:
        trees = self.primary.propose_tree(requests, shape)
        out = []
        for r, tree in zip(requests, trees):
            branch = self.branch(r)
            if branch:
                tokens, parents = add_branch(tree.token_ids, tree.parents or list(range(-1, len(tree.token_ids) - 1)),
                                             branch)
                tree = Draft(tokens, parents=parents)
            out.append(tree)
        return out

    def branch(self, r: DraftRequest) -> list[int]:
        """The lookup's continuation for ``r``: ``BRANCH_PER_MATCHED_TOKEN`` per matched token, at most ``r.k``
        and :data:`BRANCH_NODES`."""
        draft = self.lookup.propose([DraftRequest(r.request_id, r.token_ids, r.num_prompt_tokens,
                                                  min(r.k, BRANCH_NODES))])[0]
        if not draft.token_ids:
            return []
        return draft.token_ids[:BRANCH_PER_MATCHED_TOKEN * draft.evidence]

    def on_verified(self, request_id: int, num_committed: int) -> None:
        self.primary.on_verified(request_id, num_committed)

    def release(self, request_id: int) -> None:
        self.primary.release(request_id)
        self.lookup.release(request_id)
