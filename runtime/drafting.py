"""Speculation's side of a step: how many tokens each decoding sequence drafts, and the drafts.

The engine builds one :class:`Speculation` when it has a draft, hands it the step's scheduled
chunks before the target forward (:meth:`Speculation.draft`) and tells it what was verified
after (:meth:`observe_decode`, :meth:`observe_forward`, :meth:`on_verified`). It owns the
proposer and, with ``adaptive``, the :class:`~.controller.SpeculationController`:

* a sequence's cap is ``num_draft_tokens`` (or its request's own, lower one) and never more tokens
  than it may still emit;
* the controller picks each length within the cap before drafting, and again after, with the
  drafting time spent (a draft shorter than asked may no longer pay);
* a proposer that writes no cache (``writes_cache = False``, e.g. n-gram lookup) drafts for every
  sequence first, and the controller chooses knowing each draft and its evidence class; the drafts
  it does not verify are scored, unverified, as the target's tokens arrive (shadow drafts); steps look
  only while looking is worth its host time (:class:`~.lookup_gate.LookupGate`);
* draft slots are allocated in the KV manager before the forward (copy-on-write copies through
  ``copy_blocks``), and the slots of drafts cut short are given back at once.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from ..compiler.graph_cache import measurement_path
from ..compiler.program import AttentionMetadata, DecoderProgram
from .controller import SpeculationController
from .forward_cost import ForwardCost, cost_sizes, measure_forward_cost
from .kv_manager import KVCacheManager
from .proposers.base import Draft, DraftRequest
from .rejection import accept_matching, verify_sampling
from .sampling import PositionNoise, SamplingParams, probabilities
from .step_logits import TargetRows, row_argmax
from .token_tree import TreeShape, accept_tree, chain_in_tree
from .scheduler import Request, ScheduledChunk


def is_decode(chunk: ScheduledChunk) -> bool:
    """The sequence feeds one token and wants the next (drafts may be verified with it)."""
    return chunk.num_tokens == 1 and chunk.wants_logits


def measure_target_cost(program: DecoderProgram, kv: KVCacheManager, kv_cache, page_size: int, max_stream: int,
                        sequence_ids: list[int], context: int = 128):
    """The target's forward cost by stream size (:func:`~.forward_cost.measure_forward_cost`), timed in the
    shape decode steps have: a stream of ``n`` tokens is ``min(n, len(sequence_ids))`` scratch sequences,
    each past ``context`` cached tokens, feeding an equal share of the ``n`` (one token each: a plain
    decode batch; more: a verify), not one sequence's prefill from position 0, a shape no decode step
    has. The scratch blocks are free ones, freed again uncommitted, so no request's cache state is
    touched; with too little room the context, then the sequences, shrink. None when not even one
    sequence fits."""
    seqs = list(sequence_ids)
    while True:
        per_seq = context + -(-max_stream // len(seqs))
        needed = len(seqs) * -(-per_seq // page_size)
        if needed <= kv.num_free_blocks:  # free blocks only: making room would queue demotions
            break
        if context > 0:
            context //= 2
        elif len(seqs) > 1:
            seqs.pop()
        else:
            return None
    for sid in seqs:
        kv.add_sequence(sid, [])
    try:
        if any(kv.allocate(sid, per_seq) is None for sid in seqs):
            return None
        tables = [kv.block_table(sid) for sid in seqs]

        def forward(n: int) -> None:
            b = min(n, len(tables))
            shares = [n // b + (i < n % b) for i in range(b)]
            meta = AttentionMetadata.build([(t, context, q) for t, q in zip(tables, shares)], page_size,
                                           [list(range(q)) for q in shares])  # a verify wants every row
            row_argmax(program(torch.zeros(n, dtype=torch.long), meta, kv_cache))  # as a greedy step picks its tokens

        with torch.no_grad():
            return measure_forward_cost(forward, cost_sizes(max_stream, program.buckets))
    finally:
        for sid in seqs:
            kv.free(sid)


def cached_target_cost(program: DecoderProgram, kv: KVCacheManager, kv_cache, page_size: int, max_stream: int,
                       sequence_ids: list[int]) -> ForwardCost | None:
    """:func:`measure_target_cost`, measured once per machine: kept beside the program's graph-cache
    entry (whose key names this CPU), by stream size limit, lowering and buckets."""
    shape = "-".join(map(str, program.buckets or ()))
    path = measurement_path(program.cache_key, f"forward-cost-decode-{max_stream}-{program.lowering}-{shape}")
    cost = ForwardCost.load(path) if path is not None else None
    if cost is None:
        cost = measure_target_cost(program, kv, kv_cache, page_size, max_stream, sequence_ids)
        if cost is not None and path is not None:
            cost.save(path)
    return cost


def verify_draft(draft: Draft, target: TargetRows, params: SamplingParams, noise: PositionNoise | None,
                 position: int) -> tuple[list[int], list[int]]:
    """Accepted drafts + one target token, lossless, and the verify-step nodes of the accepted drafts (``1..a``
    for a chain; a root path for a tree). ``target``: the step's ``1 + len(draft)`` rows for the sequence, row
    ``m`` after node ``m``. A deterministic draft (and any draft, greedy) is kept while it equals the target's
    own token (the argmax, or the draw of the output position's uniform: exactly plain decoding's tokens); a
    sampled chain (``draft.probs``) by rejection sampling from output ``position`` on."""
    assert len(target) == len(draft.token_ids) + 1, f"need 1 + {len(draft.token_ids)} rows; got {len(target)}"
    if draft.parents is not None:
        return accept_tree(draft.token_ids, draft.parents, target.token)
    if params.greedy or draft.probs is None:
        tokens = accept_matching(draft.token_ids, target.token)
    else:
        n = len(draft.token_ids)
        tokens = verify_sampling(draft.token_ids, draft.probs, probabilities(target.whole(), params),
                                 noise.draws(position, n + 1), noise.coins(position, n))
    return tokens, list(range(1, len(tokens)))


class Speculation:
    """Draft lengths and drafts for each step (see module docstring).

    ``measure_cost()`` returns the target's :class:`~.forward_cost.ForwardCost` (or None while it
    cannot be measured: no room in the pool, or the step graphs still compiling); the controller is
    built on the first step where it can be."""

    def __init__(self, proposer, num_draft_tokens: int, adaptive: bool, kv: KVCacheManager,
                 copy_blocks: Callable[[list[tuple[int, int]]], None], measure_cost: Callable[[], object],
                 tree: TreeShape | None = None):
        self.proposer = proposer
        self.num_draft_tokens = num_draft_tokens
        self.adaptive = adaptive
        self.controller: SpeculationController | None = None
        self._kv, self._copy_blocks, self._measure_cost = kv, copy_blocks, measure_cost
        self.draft_s = 0.0  # seconds spent in the proposer (engine.stats["draft_s"])
        self.draft_call_s = 0.0  # the last draft() call's seconds, lookups and planning included
        self.tree: TreeShape | None = None
        self.tree_ids: set[int] = set()  # the sequences whose drafts this step are trees
        self.set_tree(tree)

    def set_tree(self, tree: TreeShape | None) -> None:
        """Draft token trees of this shape (None: chains). With ``adaptive`` the tree is the largest shape:
        each step the controller verifies it, a chain within its depth, or nothing."""
        if tree is not None and not callable(getattr(self.proposer, "propose_tree", None)):
            raise ValueError(f"draft_tree={str(tree)!r} needs a proposer that drafts trees (ngram, eagle, medusa, a "
                             f"draft model, layer_skip); {getattr(self.proposer, 'name', self.proposer)!r} does not")
        self.tree = tree

    def ready_controller(self) -> SpeculationController | None:
        """The controller, built once the target's cost can be measured."""
        if self.controller is None:
            cost = self._measure_cost()
            if cost is not None:
                self.controller = SpeculationController(self.num_draft_tokens, cost)
        return self.controller

    def draft(self, chunks: list[ScheduledChunk], draining: bool = False) -> dict[int, Draft]:
        """Drafts for the decoding sequences of ``chunks`` by request id; their extra slots are allocated.
        ``draining``: no request waits, so the controller values tokens by the time they cut from finishing
        the batch (:meth:`~.controller.SpeculationController.worth`). The call's seconds are kept in
        ``draft_call_s`` (the engine takes them out of the step it reports to :meth:`observe_forward`)."""
        t0 = time.perf_counter()
        try:
            return self._draft(chunks, draining)
        finally:
            self.draft_call_s = time.perf_counter() - t0

    def _draft(self, chunks: list[ScheduledChunk], draining: bool) -> dict[int, Draft]:
        decodes = [c.request for c in chunks if is_decode(c)]
        self.tree_ids = set()
        controller = self.ready_controller() if self.adaptive else None
        if self.tree is not None and controller is None:
            return self._draft_trees(decodes)
        ids = [r.request_id for r in decodes]
        shadowing = controller is not None and getattr(self.proposer, "writes_cache", True) is False
        if shadowing and self.tree is None:  # (the gate first: a step that does not look does nothing more)
            if any(i not in controller.records for i in ids):  # a sequence's first decode: its drafts are unknown
                controller.lookups.look_next()
            if not ids or not controller.lookups.should_look(len(ids), controller.forward_cost(len(ids))):
                return {}  # (not worth its host time lately)
        longest = self.tree.depth if self.tree is not None else self.num_draft_tokens
        caps = [min(longest if r.num_draft_tokens is None else min(r.num_draft_tokens, longest),
                    r.max_new_tokens - len(r.output_ids) - 1) for r in decodes]
        other_tokens = sum(c.num_tokens for c in chunks) - len(decodes)
        remaining = [r.max_new_tokens - len(r.output_ids) for r in decodes] if draining and not other_tokens else None
        if shadowing and self.tree is None:
            t0 = time.perf_counter()
            drafts = self._look_then_choose(decodes, caps, other_tokens, remaining)
            controller.lookups.spend(time.perf_counter() - t0)
            return drafts
        lengths = (controller.plan(ids, caps, other_tokens, probe=not shadowing, remaining=remaining)
                   if controller is not None else caps)
        nodes = self.tree.max_nodes + self.extra_tree_nodes if self.tree is not None else 0
        if self.tree is not None and ids and controller.tree_pays(ids, caps, nodes, other_tokens, controller.last_rate,
                                                                  remaining):
            return self._draft_trees(decodes)
        wanted, shadows = [], []
        for r, k, cap in zip(decodes, lengths, caps):
            if k <= 0:
                if shadowing and cap > 0 and controller.wants_shadow(r.request_id):
                    shadows.append(DraftRequest(r.request_id, r.all_ids, len(r.prompt_ids), cap, r.params, r.generator))
                continue
            request = self._reserve(r, k, k)
            if request is not None:  # (None: pool short, a plain decode this step)
                wanted.append(request)
        if not wanted and not shadows:
            return {}
        t0 = time.perf_counter()
        proposals = self.proposer.propose(wanted + shadows)
        drafting = time.perf_counter() - t0
        self.draft_s += drafting
        drafts = dict(zip((w.request_id for w in wanted), proposals))
        if controller is not None:
            controller.observe_draft(drafting, max(w.k for w in wanted + shadows))
            for w, d in zip(shadows, proposals[len(wanted):]):
                controller.shadow(w.request_id, len(w.token_ids), d.token_ids[:w.k])
            asked = {w.request_id: w.k for w in wanted}
            got = [len(drafts[i].token_ids[:asked[i]]) if i in asked else 0 for i in ids]
            floors = [min(n, controller.probe_length) if i in controller.probes else 0 for i, n in zip(ids, got)]
            keep = dict(zip(ids, controller.plan(ids, got, other_tokens, drafting_cost=False, floors=floors,
                                                 remaining=remaining)))
        else:
            keep = {w.request_id: w.k for w in wanted}
        for w in wanted:
            d, k = drafts[w.request_id], keep[w.request_id]
            d.token_ids = d.token_ids[:k]
            if d.probs is not None:
                d.probs = d.probs[:k]
            if len(d.token_ids) < w.k:  # give back the slots of drafts not verified
                self._kv.truncate(w.request_id, self._kv.num_tokens(w.request_id) - (w.k - len(d.token_ids)))
        return {i: d for i, d in drafts.items() if d.token_ids}

    def _look_then_choose(self, decodes: list[Request], caps: list[int], other_tokens: int,
                          remaining: list[int] | None) -> dict[int, Draft]:
        """Drafts that cost nothing and write no cache (n-gram lookup): every sequence drafts to its cap
        first, then the controller chooses the lengths knowing each draft's length and evidence class;
        a draft it does not verify becomes the sequence's shadow draft (scored as its tokens arrive)."""
        controller = self.controller
        asked = [DraftRequest(r.request_id, r.all_ids, len(r.prompt_ids), cap, r.params, r.generator)
                 for r, cap in zip(decodes, caps) if cap > 0]
        if not asked:
            return {}
        t0 = time.perf_counter()
        proposals = dict(zip((a.request_id for a in asked), self.proposer.propose(asked)))
        drafting = time.perf_counter() - t0
        self.draft_s += drafting
        controller.observe_draft(drafting, max(a.k for a in asked))
        ids = [r.request_id for r in decodes]
        got = [proposals[i] if i in proposals else Draft([]) for i in ids]
        lengths = controller.plan(ids, [len(d.token_ids) for d in got], other_tokens, drafting_cost=False,
                                  probe=False, remaining=remaining, evidence=[d.evidence for d in got])
        controller.lookups.observe_saving(controller.last_saving)
        drafts = {}
        for r, d, k in zip(decodes, got, lengths):
            if k > 0 and self._reserve(r, k, k) is not None:  # (None: pool short, a plain decode this step)
                d.token_ids = d.token_ids[:k]
                drafts[r.request_id] = d
            elif d.token_ids and controller.wants_shadow(r.request_id):
                controller.shadow(r.request_id, len(r.all_ids), d.token_ids, d.evidence)
        return drafts

    @property
    def extra_tree_nodes(self) -> int:
        """Nodes (and levels) the proposer may add to each tree beyond its shape's: a lookup branch's."""
        return getattr(self.proposer, "extra_tree_nodes", 0)

    def _draft_trees(self, decodes: list[Request]) -> dict[int, Draft]:
        """Token trees: slots for the largest tree the shape (and the proposer's extra nodes) may write are
        allocated, drafting writes (scratch slots past the sequence's committed ones), and the slots past the
        drafted tree are given back."""
        scratch = self.tree.scratch_nodes + self.extra_tree_nodes
        wanted = []
        for r in decodes:
            depth = min(max(self.tree.depth, self.extra_tree_nodes), r.max_new_tokens - len(r.output_ids) - 1)
            if r.num_draft_tokens is not None:  # the request's own cap bounds the tree's depth
                depth = min(depth, r.num_draft_tokens)
            if depth <= 0:
                continue
            request = self._reserve(r, scratch, depth)
            if request is not None:  # (None: pool short, a plain decode this step)
                wanted.append(request)
        if not wanted:
            return {}
        drafts = {}
        t0 = time.perf_counter()
        trees = self.proposer.propose_tree(wanted, self.tree)
        drafting = time.perf_counter() - t0
        self.draft_s += drafting
        if self.controller is not None and self.adaptive:
            self.controller.observe_tree_draft(drafting)
        for w, d in zip(wanted, trees):
            self._kv.truncate(w.request_id, self._kv.num_tokens(w.request_id) - (scratch - len(d.token_ids)))
            if d.token_ids:
                drafts[w.request_id] = d
                self.tree_ids.add(w.request_id)
        return drafts

    def _reserve(self, r: Request, slots: int, k: int) -> DraftRequest | None:
        """``slots`` cache slots past ``r``'s tokens (copy-on-write copies made) and the request for ``k``
        drafts; None when the pool is short."""
        copies = self._kv.allocate(r.request_id, slots)
        if copies is None:
            return None
        self._copy_blocks(copies)
        return DraftRequest(r.request_id, r.all_ids, len(r.prompt_ids), k, r.params, r.generator)

    def observe_decode(self, r: Request, draft: Draft | None, path: list[int]) -> None:
        """A decode forward of ``r`` verified ``draft`` (None: a plain decode) and accepted the drafts at
        step nodes ``path``."""
        if not (self.adaptive and self.controller is not None):
            return
        rid = r.request_id
        if rid in self.tree_ids:  # a tree's accepted root path; its first-child chain tells the chain estimate
            self.controller.observe_tree(rid, self.tree.depth, len(path))
            # (a lookup branch that follows the first-child chain to its end hangs its rest below it, so the
            # chain may run past the shape's depth: only the levels a chain of the proposer could hold count)
            chain, kept = chain_in_tree(draft.parents, path)
            chain = min(chain, self.tree.depth, self.controller.max_drafts)
            self.controller.observe_decode(rid, chain, min(kept, chain))
            return
        self.controller.observe_decode(rid, len(draft.token_ids) if draft is not None else 0, len(path),
                                       draft.evidence if draft is not None else None)
        if self.controller.has_shadow(rid):  # (part of a look's host time)
            t0 = time.perf_counter()
            self.controller.score_shadow(rid, r.all_ids)
            self.controller.lookups.spend(time.perf_counter() - t0)

    def observe_forward(self, num_tokens: int, seconds: float) -> None:
        """A step made only of decodes took ``seconds`` over ``num_tokens`` stream tokens, from its start to its
        end less its drafting call (whose proposer time the draft cost per position prices, and whose lookups
        the lookup gate; its planning is left out): scheduling, metadata, the forward, and the sampling or
        verification after it. Timed from the forward on (as it was), a step's scheduling and metadata went
        unpriced, and on a GPU a CUDA-graph replay takes about 2 ms, so that work is a large part of a step."""
        if self.adaptive and self.controller is not None:
            self.controller.observe_forward(num_tokens, seconds)

    def on_verified(self, request_id: int, num_computed: int) -> None:
        self.proposer.on_verified(request_id, num_computed)

    def on_features(self, request_id: int, first: int, feats: torch.Tensor) -> None:
        """The target's last hidden states of one sequence's tokens ``first, first + 1, ...`` (proposers
        of a kind registered with ``features=True``)."""
        self.proposer.on_features(request_id, first, feats)

    def release(self, request: Request) -> None:
        """The request is preempted: its draft state goes (its acceptance estimate stays)."""
        self.proposer.release(request.request_id)

    def forget(self, request: Request) -> None:
        """The request is finished or aborted: the proposer's and the controller's state of it go."""
        self.proposer.release(request.request_id)
        if self.controller is not None:
            self.controller.release(request.request_id)
