"""Model proposers: a draft model, or the target's own first K layers (``layer_skip:K``).

Both run a specgraph :class:`~specgraph.compiler.program.DecoderProgram` of the drafter over the
same block tables as the target (one :class:`KVCacheManager`, one set of block ids; the
drafter's cache tensors are indexed by the same slots), drafting k tokens by k single-token
steps batched over all sequences.

Cache rule for ``layer_skip:K``: the drafter *is* layers 0..K-1 of the target, so its K/V for a
token equals the target's K/V of those layers for that token. The drafter therefore reads and
writes the target's own cache tensors of layers 0..K-1: after the target verifies a step, every
committed token's K/V in those layers is valid for the drafter, and K/V the drafter wrote for
drafts is overwritten by the target's verify with identical values (rejected drafts' slots are
rolled back and rewritten later). A separate draft model keeps its own cache tensors and is
valid for exactly the tokens it was fed. Either way verification makes the output lossless: a
stale drafter cache could only lower acceptance.
"""
from __future__ import annotations

import copy

import torch

from ...compiler.program import AttentionMetadata, DecoderProgram
from ..kv_manager import KVCacheManager
from ..sampling import probabilities
from ..token_tree import TreeBuilder
from .base import Draft, DraftContext, DraftRequest


class ModelProposer:
    """Drafts with a compiled decoder sharing the target's block tables."""

    def __init__(self, name: str, program: DecoderProgram, kv_cache, kv: KVCacheManager, page_size: int,
                 shares_target_cache: bool):
        self.name, self.program, self.kv_cache, self.kv = name, program, kv_cache, kv
        self.page_size, self.shares_target_cache = page_size, shares_target_cache
        self._fed: dict[int, int] = {}  # tokens of each sequence whose drafter K/V is in the cache

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = {r.request_id: [] for r in requests}
        qs: dict[int, list[torch.Tensor]] = {r.request_id: [] for r in requests}
        active = [r for r in requests if r.k > 0]
        # step 0 feeds everything the drafter has not seen: a draft model's own cache lacks the prompt
        # on a request's first step; layer_skip's layers already hold every committed token but the
        # last (the target computed them)
        feed = {r.request_id: self._unfed(r) for r in active}
        start = {r.request_id: len(r.token_ids) - len(feed[r.request_id]) for r in active}
        for step in range(max((r.k for r in active), default=0)):
            live = [r for r in active if len(drafts[r.request_id]) < r.k and step < r.k]
            if not live:
                break
            ids, seqs, want = [], [], []
            for r in live:
                toks = feed[r.request_id]
                ids += toks
                seqs.append((self.kv.block_table(r.request_id), start[r.request_id], len(toks)))
                want.append([len(toks) - 1])
            logits = self._forward(ids, seqs, want)
            for row, r in enumerate(live):
                rid = r.request_id
                self._fed[rid] = start[rid] + len(feed[rid])
                if r.params is None or r.params.greedy:
                    token = int(torch.argmax(logits[row]))
                else:
                    q = probabilities(logits[row], r.params)
                    token = int(torch.multinomial(q, 1, generator=r.generator))
                    qs[rid].append(q)
                drafts[rid].append(token)
                start[rid] += len(feed[rid])
                feed[rid] = [token]
        out = []
        for r in requests:
            probs = torch.stack(qs[r.request_id]) if qs[r.request_id] else None
            out.append(Draft(token_ids=drafts[r.request_id], probs=probs))
        return out

    def propose_tree(self, requests: list[DraftRequest], shape) -> list[Draft]:
        """Token trees, one drafter forward per level batched over the requests (``token_tree.TreeBuilder``:
        candidates are the drafter's most probable tokens, best first, so the tree holds the greedy
        chain). Level 1 feeds what the drafter has not seen up to the last committed token, as a chain
        draft's first step; each later level feeds the whole tree so far as one tree step (its nodes at the
        cache indices the target's verify gives them), for the logits of the newest level."""
        builders = {r.request_id: TreeBuilder(shape, max_depth=r.k) for r in requests}
        live = [r for r in requests if not builders[r.request_id].done]
        if live:
            feed = {r.request_id: self._unfed(r) for r in live}
            seqs = [(self.kv.block_table(r.request_id), len(r.token_ids) - len(feed[r.request_id]),
                     len(feed[r.request_id])) for r in live]
            logits = self._forward([t for r in live for t in feed[r.request_id]], seqs,
                                   [[len(feed[r.request_id]) - 1] for r in live])
            rows = iter(logits)
            for r in live:
                self._fed[r.request_id] = len(r.token_ids)  # tree nodes past it are scratch, never committed
                builders[r.request_id].add_level([_candidates(next(rows), builders[r.request_id])])
        while live := [r for r in live if not builders[r.request_id].done]:
            ids, seqs, want, trees = [], [], [], {}
            for s, r in enumerate(live):
                b = builders[r.request_id]
                ids += b.tokens
                seqs.append((self.kv.block_table(r.request_id), len(r.token_ids), len(b.tokens)))
                want.append(list(b.frontier))
                trees[s] = b.parents
            rows = iter(self._forward(ids, seqs, want, trees))
            for r in live:
                b = builders[r.request_id]
                b.add_level([_candidates(next(rows), b) for _ in b.frontier])
        out = []
        for r in requests:
            tokens, parents = builders[r.request_id].result()
            out.append(Draft(tokens, parents=parents))
        return out

    def _forward(self, ids: list[int], seqs, want, trees=None) -> torch.Tensor:
        """The drafter's logits for the ``want`` rows, on the host (tokens are chosen there, with the
        requests' host generators, and a sampled draft's probabilities meet the target's there)."""
        meta = AttentionMetadata.build(seqs, self.page_size, want, trees, tree_words=self.program.tree_words)
        with torch.no_grad():
            return self.program(torch.tensor(ids, dtype=torch.long), meta, self.kv_cache).float().cpu()

    def _unfed(self, r: DraftRequest) -> list[int]:
        """The committed tokens the drafter has no K/V for, the last one always included (it is fed to
        draft from)."""
        return r.token_ids[min(self._fed.get(r.request_id, self._first_fed(r)), len(r.token_ids) - 1):]

    def _first_fed(self, r: DraftRequest) -> int:
        return len(r.token_ids) - 1 if self.shares_target_cache else 0

    def on_verified(self, request_id: int, num_committed: int) -> None:
        if self.shares_target_cache:
            self._fed[request_id] = num_committed  # the target's verify wrote layers < K for all of them
        else:
            self._fed[request_id] = min(self._fed.get(request_id, 0), num_committed)

    def release(self, request_id: int) -> None:
        self._fed.pop(request_id, None)


def _candidates(logits: torch.Tensor, builder: TreeBuilder) -> list[tuple[int, float]]:
    """The drafter's best tokens for one tree node, ``(token, probability)``, as many as a level may keep."""
    probs = torch.softmax(logits.float(), dim=-1)
    top = torch.topk(probs, min(max(builder.width, default=1), probs.shape[-1]))
    return list(zip(top.indices.tolist(), top.values.tolist()))


def decoder_layer_list(model: torch.nn.Module, num_layers: int) -> tuple[str, torch.nn.ModuleList]:
    """The ``nn.ModuleList`` holding the model's ``num_layers`` decoder layers (name, list)."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers]
    if len(found) != 1:
        raise ValueError(f"layer_skip needs exactly one nn.ModuleList of the {num_layers} decoder layers; "
                         f"found {[n for n, _ in found] or 'none'}")
    return found[0]


def first_layers(model: torch.nn.Module, num_layers: int, keep: int) -> torch.nn.Module:
    """A shallow copy of ``model`` running only its first ``keep`` decoder layers (weights shared)."""
    if not 1 <= keep < num_layers:
        raise ValueError(f"layer_skip:K needs 1 <= K < {num_layers} (the target's layers); got {keep}")
    path, layers = decoder_layer_list(model, num_layers)
    root = copy.copy(model)
    root._modules = dict(model._modules)
    parent = root
    parts = path.split(".")
    for part in parts[:-1]:
        child = copy.copy(parent._modules[part])
        child._modules = dict(child._modules)
        parent._modules[part] = child
        parent = child
    parent._modules[parts[-1]] = torch.nn.ModuleList(list(layers)[:keep])
    return root


def draft_model_proposer(draft: torch.nn.Module, ctx: DraftContext) -> ModelProposer:
    """A separate draft model, compiled in the target's cache format (and its own weight dtype),
    with its own cache tensors over the target's block tables."""
    from ...compiler.program import compile_decoder

    program = compile_decoder(draft, ctx.options(ctx.weight_dtype))
    if program.vocab_size != ctx.program.vocab_size:
        raise ValueError(f"draft model vocabulary {program.vocab_size} != target vocabulary "
                         f"{ctx.program.vocab_size}; speculative decoding needs the same tokenizer")
    cache = program.new_kv_cache(ctx.num_blocks, device=ctx.device)
    program.compile_steps(cache, ctx.table_width)
    return ModelProposer("draft_model", program, cache, ctx.kv, ctx.page_size, shares_target_cache=False)


def layer_skip_proposer(arg: str, ctx: DraftContext) -> ModelProposer:
    """``layer_skip:K``: the target's first K layers, on the target's weights and cache tensors."""
    spec = f"layer_skip:{arg}"
    ctx.refuse_own_weight_dtype(spec, "it runs on the target's weights")
    if not arg.isdigit():
        raise ValueError(f"draft={spec!r}: layer_skip needs a layer count, e.g. 'layer_skip:8'")
    from ...compiler.program import compile_decoder

    keep = int(arg)
    program = compile_decoder(first_layers(ctx.model, ctx.program.num_layers, keep), ctx.options())
    program.compile_steps(ctx.kv_cache[:keep], ctx.table_width)
    return ModelProposer(spec, program, ctx.kv_cache[:keep], ctx.kv, ctx.page_size, shares_target_cache=True)


def _register() -> None:
    from . import register_draft_model, register_proposer

    register_proposer("layer_skip", layer_skip_proposer, "layer_skip:K")
    register_draft_model(draft_model_proposer)


_register()
