"""Engine: generation and scoring on a compiled, paged decoder with continuous batching.

    engine = specgraph.Engine(model, tokenizer=tok, page_size=16, prefix_caching=True)
    results = engine.generate(["def fib(n):"], max_new_tokens=64)
    engine.stats  # tokens_per_second, prefix_cache_hit_rate, kv_pool_usage, kv_bytes_per_token, ...
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from ..compiler.options import MAX_TREE_NODES, BackendOptions
from ..compiler.program import AttentionMetadata, DecoderProgram, compile_decoder
from .controller import SpeculationController
from .drafting import Speculation, cached_target_cost, is_decode, verify_draft
from .engine_stats import EngineStats
from ..kernels.hot_cold import demote_blocks, hot_tensors
from .kv_manager import KVCacheManager
from .kv_pool import pool_sizes
from .proposers.base import Draft
from .sampling import PositionNoise, SamplingParams, token_logprobs
from .scheduler import Request, Scheduler
from .step_logits import TargetRows, host_rows, rows_wanted
from .token_tree import keep_path, parse_tree
from .prompts import GenerationResult, calibration_ids, encode_prompts, eos_ids
from .scoring import score
from .shape_choice import choose_default_shape


class Engine:
    """Generation on a specgraph-compiled decoder.

    Parameters
    ----------
    model: a Hugging Face causal LM or any module mapping ids ``[1, T]`` to logits.
    tokenizer: optional; needed for string prompts, ``.text`` and stop strings.
    kv_dtype, weight_dtype, page_size: see :class:`~specgraph.BackendOptions`.
    weight_calibration: what int8/fp8 weights are calibrated on (GPTQ, ``compiler/calibration.py``):
        ``"builtin"`` (a built-in text, when there is a tokenizer; without one the weights are
        rounded to nearest), a text, token ids, or None (round to nearest).
    prefix_caching: reuse cached full blocks of earlier prompts.
    kv_cache_memory: bytes of KV cache (all layers, K and V) when ``num_blocks`` is not given.
    num_blocks: size of the block pool (block 0 is reserved); of a hot/cold cache, its hot pages.
    kv_hot_window: tokens per sequence kept in the model's dtype under kv_dtype fp8 / int4 / adaptive
        (see :class:`~specgraph.BackendOptions`; 0: every page quantized as written).
    num_cold_blocks: a hot/cold cache's quantized pages (default: as many as ``num_blocks`` when that is
        given, else what ``kv_cache_memory`` leaves after the hot pages).
    max_num_seqs, max_tokens_per_step: continuous-batching limits (prefills are chunked to fit).
    draft: speculative decoding proposer: ``"ngram"``/``"ngram:N"`` (prompt lookup),
        ``"eagle"``/``"medusa"`` (the learned heads shipped for the model, or ``"eagle:PATH"``; see
        ``runtime/heads``), ``"layer_skip:K"`` (the target's first K layers, sharing their cache) or a draft
        ``nn.Module`` with the same vocabulary, or any object implementing
        :class:`~specgraph.runtime.proposers.Proposer`; None disables speculation.
    num_draft_tokens: k, the drafts verified per target forward (with ``adaptive``, the most).
    draft_tree: draft token trees instead of chains, verified in one forward each
        (``runtime/token_tree.py``): ``"static:W1,W2,..."`` (the draft's top-``W1`` at depth 1, top-``W2``
        under each at depth 2, ...) or ``"dynamic:N"`` (the ``N`` most confident nodes, EAGLE-2);
        ``num_draft_tokens`` is then ignored. Learned heads (``"eagle"``, ``"medusa"``) have their kind's
        default tree (``adaptive=False``: it or a chain within its depth, whichever is timed fastest at build,
        ``engine.draft_shape_rates``, ``runtime/shape_choice.py``); ``engine.draft_tree = None``: chains.
    adaptive: let a controller choose each step's draft length per sequence (0 to
        ``num_draft_tokens``), or with a ``draft_tree`` the whole tree, a chain within its depth or
        nothing, from measured acceptance and cost (``runtime/controller.py``); the default when a
        draft is given. ``adaptive=False`` drafts ``num_draft_tokens`` (or the tree) every step.
        Outputs do not depend on it: verification is exact whatever length is chosen.
    draft_weight_dtype: the weight storage of a draft ``nn.Module`` (None: the target's
        ``weight_dtype``), e.g. an int4 draft for a float32 target, or of a learned head's linears
        (None: int8 on CPU, a quarter of float's bytes per draft step; ``"auto"``: float);
        verification stays exact for the target whatever the draft's weights. ``layer_skip`` runs on
        the target's own weights.
    self_check: after compiling, compare the incremental program with the cache-free model on random
        ids and raise ``UnsupportedModelError`` on a mismatch (see ``specgraph.compiler.self_check``).
    lowering: ``"inductor"`` (generated code, compiled here for every step shape, cached on disk),
        ``"eager"`` or ``"triton-interpret"``; see :class:`~specgraph.BackendOptions`.
    cuda_graphs: on CUDA, replay the decode buckets' steps as CUDA graphs (``BackendOptions.cuda_graphs``).
    progress: optional ``progress(stage)``, told when each compile stage starts (the CLI shows it).
    compile_in_background: return once the graph is captured and checked; the step graphs compile
        in a thread while requests run on the eager lowering, which they leave when the generated
        code is ready (``engine.program.wait_for_steps()``). For interactive use: the first answer
        does not wait for code generation.
    """

    def __init__(self, model: torch.nn.Module, tokenizer=None, *, kv_dtype: str = "auto", weight_dtype: str = "auto",
                 kv_hot_window: int | None = None, num_cold_blocks: int | None = None,
                 weight_calibration: str | Sequence[int] | None = "builtin",
                 page_size: int = 16, prefix_caching: bool = True, kv_cache_memory: int = 256 << 20, num_blocks: int | None = None,
                 max_num_seqs: int = 8, max_tokens_per_step: int = 512, passes: Sequence = (),
                 dump_dir: str | None = None, draft=None, num_draft_tokens: int = 4, adaptive: bool | None = None,
                 draft_tree: str | None = None,
                 draft_weight_dtype: str | None = None, self_check: bool = True,
                 lowering: str | None = None, progress: Callable[[str], None] | None = None,
                 compile_in_background: bool = False, cuda_graphs: bool = True):
        self.model, self.tokenizer = model, tokenizer
        calibration = calibration_ids(weight_calibration, weight_dtype, tokenizer)
        from .proposers import kind_of

        shape_given, kind = draft_tree is not None, kind_of(draft)
        if not shape_given and kind is not None:  # (with adaptive, the largest shape the controller may use)
            draft_tree = kind.default_tree
        tree, extra = None, kind.extra_tree_nodes if kind is not None else getattr(draft, "extra_tree_nodes", 0)
        if draft_tree is not None:
            if draft is None:
                raise ValueError(f"draft_tree={draft_tree!r} is given without a draft")
            tree = parse_tree(draft_tree, MAX_TREE_NODES - 1 - extra)  # (extra: a lookup branch's nodes)
        tree_stream = 0 if tree is None else 1 + tree.scratch_nodes + extra  # a sequence's tokens in a tree verify
        self._features = kind is not None and kind.features  # the proposer reads the target's hidden states
        self.default_tree = None if tree is None else str(tree)  # the shape given (or the kind's), at build
        options = BackendOptions(kv_dtype=kv_dtype, kv_hot_window=kv_hot_window, weight_dtype=weight_dtype,
                                 weight_calibration=calibration,
                                 page_size=page_size, tree_nodes=tree_stream,
                                 hidden_states=self._features,
                                 passes=tuple(passes), dump_dir=dump_dir, self_check=self_check, lowering=lowering,
                                 cuda_graphs=cuda_graphs)
        t0 = time.perf_counter()
        self.program: DecoderProgram = compile_decoder(model, options, progress=progress)
        if num_cold_blocks is not None and not self.program.hot_cold:
            raise ValueError(f"num_cold_blocks is for a hot/cold cache (kv_dtype fp8 / int4 / adaptive with a hot "
                             f"window); kv_dtype={kv_dtype!r} has one kind of page")
        drafts = tree_stream or (num_draft_tokens + 1 if draft is not None else 1)
        self.num_blocks, self.num_cold_blocks = pool_sizes(self.program, kv_cache_memory, num_blocks, num_cold_blocks,
                                                           max_num_seqs, max_tokens_per_step, drafts)
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved); got {self.num_blocks}")
        device = self.device = next(model.parameters()).device
        self.kv_cache = self.program.new_kv_cache(self.num_blocks, device=device, num_cold=self.num_cold_blocks)
        self.table_width = self.num_blocks + self.num_cold_blocks - 1  # one sequence may hold every usable block
        self.program.compile_steps(self.kv_cache, self.table_width, progress=progress,
                                   background=compile_in_background)
        self.kv = KVCacheManager(self.num_blocks, page_size, enable_prefix_caching=prefix_caching,
                                 num_cold=self.num_cold_blocks, hot_window=options.hot_window_tokens,
                                 demote="pressure" if kv_dtype == "adaptive" else "window")
        self.scheduler = Scheduler(self.kv, max_num_seqs=max_num_seqs, max_tokens_per_step=max_tokens_per_step,
                                   on_preempt=self._release_draft_state)
        self.eos_ids = eos_ids(model, tokenizer)
        self.page_size = page_size
        self._next_id = 0
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1; got {num_draft_tokens}")
        proposer = None
        if draft is not None:
            from .proposers import DraftContext, make_proposer

            draft_calibration = None  # the target's
            if draft_weight_dtype is not None:
                draft_calibration = calibration_ids(weight_calibration, draft_weight_dtype, tokenizer)
            proposer = make_proposer(draft, DraftContext(
                model, self.program, self.kv, self.kv_cache, page_size, self.table_width + 1, self.table_width, device,
                draft_weight_dtype, draft_calibration))
            if getattr(proposer, "wants_features", False) and not self._features:
                raise ValueError(f"the proposer {getattr(proposer, 'name', proposer)!r} drafts from the target's hidden "
                                 f"states: give its registered spec (e.g. draft='eagle:PATH'), so the target is "
                                 f"compiled to return them")
        elif draft_weight_dtype is not None:
            raise ValueError(f"draft_weight_dtype={draft_weight_dtype!r} is given without a draft")
        if adaptive and proposer is None:
            raise ValueError("adaptive=True chooses draft lengths: it needs a draft (e.g. draft='ngram')")
        self.speculation = None if proposer is None else Speculation(
            proposer, num_draft_tokens, adaptive is not False, self.kv,
            self._copy_blocks, self._measure_target_cost, tree)
        self._num_draft_tokens = num_draft_tokens  # (kept when there is no draft, for the stats)
        if self.adaptive and not compile_in_background:
            self.speculation.ready_controller()  # an empty pool always has room
        # every cache tensor indexed by block id: copy-on-write must copy all of them
        self._all_caches = list(self.kv_cache)
        if getattr(self.proposer, "shares_target_cache", True) is False:
            self._all_caches += list(self.proposer.kv_cache)
        self._stats = EngineStats(self)
        self.draft_shape_rates: dict[str, float] | None = None  # fixed speculation, kind's shape: tok/s timed
        if tree is not None and not shape_given and adaptive is False and not compile_in_background:
            self.draft_shape_rates = choose_default_shape(self, tree, num_draft_tokens)
        self.compile_seconds = time.perf_counter() - t0  # capture, passes, self-check, step graphs, shape choice

    # ------------------------------------------------------------------ public
    def generate(self, prompts, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int = 0, stop: Sequence[str] | None = None, n: int = 1,
                 ignore_eos: bool = False, on_token: Callable[[int, int], None] | None = None,
                 num_draft_tokens: int | None = None) -> list[GenerationResult]:
        """Generate for one prompt or a batch (``str``, ``list[str]``, ``list[int]`` or ``list[list[int]]``).

        ``n`` samples per prompt: ``results[i * n + j]`` is sample ``j`` of prompt ``i``; the samples
        share the prompt's cache blocks (copy-on-write). ``on_token(result_index, token_id)`` is
        called for every new token as it is produced (streaming). ``ignore_eos`` keeps generating
        past EOS (benchmarks). ``num_draft_tokens`` caps these requests' drafts per step, as in
        :meth:`submit`. Requests submitted earlier with :meth:`submit` progress as well.
        """
        prompt_ids = encode_prompts(prompts, self.tokenizer, self.program.vocab_size)
        groups = [self._new_requests(ids, max_new_tokens, temperature, top_p, top_k, seed * 1_000_003 + i * n,
                                     stop, n, ignore_eos, num_draft_tokens) for i, ids in enumerate(prompt_ids)]
        requests = [r for g in groups for r in g]
        for i, r in enumerate(requests):  # all checked before any is queued
            r.on_token = None if on_token is None else (lambda tok, i=i: on_token(i, tok))
            self.scheduler.add(r)
        t0 = time.perf_counter()
        while not all(r.finished for r in requests):
            self.step()
        elapsed = time.perf_counter() - t0
        self._stats.finish_generate(elapsed, requests)
        return [self.result(r) for r in requests]

    def submit(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int = 0, stop: Sequence[str] | None = None, n: int = 1,
               ignore_eos: bool = False, logprobs: int | None = None, num_draft_tokens: int | None = None,
               on_token: Callable[[int], None] | None = None) -> list[Request]:
        """Queue one prompt (``n`` samples) without running it; :meth:`step` advances every request.

        Returns the ``n`` requests; ``request.finished`` tells when one is done and
        :meth:`result` gives its output. ``on_token(token_id)`` streams each sample's tokens.
        ``logprobs=K`` records ``(log p(token), top-K (token, log p))`` of each new token in
        ``request.output_logprobs`` (the model's distribution, before temperature).
        ``num_draft_tokens`` caps this request's drafts per step below the engine's (0: no speculation).
        A request that can never fit the KV pool is refused here (``ValueError`` with the numbers).
        """
        (ids,) = encode_prompts([prompt], self.tokenizer, self.program.vocab_size)
        if logprobs is not None and logprobs < 0:
            raise ValueError(f"logprobs must be >= 0; got {logprobs}")
        requests = self._new_requests(ids, max_new_tokens, temperature, top_p, top_k, seed, stop, n, ignore_eos,
                                      num_draft_tokens)
        for r in requests:
            r.on_token, r.logprobs = on_token, logprobs
            self.scheduler.add(r)
        return requests

    def step(self) -> list[Request]:
        """Run one scheduler step (one target forward) and return the requests it finished."""
        if not self.scheduler.has_work():
            return []
        return self._step()

    def abort(self, request: Request) -> None:
        """Cancel a submitted request; its KV blocks are released at once."""
        self.scheduler.abort(request)
        self._forget(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def result(self, r: Request) -> GenerationResult:
        """The output of a request so far (final once ``r.finished``)."""
        ids = r.output_ids
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            for s in r.stop:
                if s in text:
                    text = text[:text.index(s)]
        return GenerationResult(list(ids), text, r.finish_reason or "length", len(r.prompt_ids), r.cached_tokens)

    def score(self, token_ids: Sequence[int], chunk_size: int | None = None, return_top1: bool = False):
        """``log p(token_ids[t] | token_ids[:t])`` for t = 1..len-1, computed through the cache in prefill
        chunks of ``chunk_size`` tokens (see :func:`~specgraph.runtime.scoring.score`)."""
        return score(self, token_ids, chunk_size, return_top1)

    @property
    def stats(self) -> dict[str, Any]:
        """Figures of the last ``generate`` call, and counters since :meth:`reset_stats` (each one is
        described in :class:`~specgraph.runtime.engine_stats.EngineStats`)."""
        return self._stats.snapshot()

    def reset_stats(self) -> None:
        self._stats.reset()

    # ---------------------------------------------------------------- internals
    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _new_requests(self, ids: list[int], max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                      seed: int, stop: Sequence[str] | None, n: int, ignore_eos: bool,
                      num_draft_tokens: int | None) -> list[Request]:
        """``n`` samples of one prompt; sample ``j`` draws its tokens from ``PositionNoise(seed + j)`` (a draft
        model's samples from a generator seeded ``seed + j``)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
        if n < 1:
            raise ValueError(f"n must be >= 1; got {n}")
        if num_draft_tokens is not None and num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0; got {num_draft_tokens}")
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        requests: list[Request] = []
        for j in range(n):
            gen = None if params.greedy else torch.Generator().manual_seed(seed + j)
            noise = None if params.greedy else PositionNoise(seed + j)
            r = Request(self._new_id(), list(ids), max_new_tokens, params, gen, tuple(stop or ()), ignore_eos,
                        num_draft_tokens=num_draft_tokens, parent=requests[0] if requests else None, noise=noise)
            self.scheduler.check_fits(r)
            requests.append(r)
        return requests

    # ------------------------------------------------------------ speculation
    @property
    def proposer(self):
        """The draft proposer (None without a draft)."""
        return self.speculation.proposer if self.speculation is not None else None

    @property
    def controller(self) -> SpeculationController | None:
        """The adaptive controller (None without one, or until the target's cost is measured)."""
        return self.speculation.controller if self.speculation is not None else None

    @property
    def adaptive(self) -> bool:
        return self.speculation is not None and self.speculation.adaptive

    @adaptive.setter
    def adaptive(self, value: bool) -> None:
        if value and self.speculation is None:
            raise ValueError("adaptive=True chooses draft lengths: it needs a draft (e.g. draft='ngram')")
        if self.speculation is not None:
            self.speculation.adaptive = bool(value)

    @property
    def num_draft_tokens(self) -> int:
        """k, the drafts verified per target forward (with ``adaptive``, the most)."""
        return self.speculation.num_draft_tokens if self.speculation is not None else self._num_draft_tokens

    @num_draft_tokens.setter
    def num_draft_tokens(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"num_draft_tokens must be >= 1; got {k}")
        self._num_draft_tokens = k
        if self.speculation is not None:
            self.speculation.num_draft_tokens = k

    @property
    def draft_tree(self) -> str | None:
        """The token-tree shape drafts take (None: chains of ``num_draft_tokens``)."""
        tree = self.speculation.tree if self.speculation is not None else None
        return None if tree is None else str(tree)

    @draft_tree.setter
    def draft_tree(self, spec: str | None) -> None:
        """Another tree shape (or None: chains), within the nodes the program was compiled for."""
        if self.speculation is None or not self.program.max_tree_nodes:
            raise ValueError("draft_tree can change only on an engine built with a draft and a draft_tree")
        room = self.program.max_tree_nodes - 1 - self.speculation.extra_tree_nodes
        self.speculation.set_tree(None if spec is None else parse_tree(spec, room))

    def _measure_target_cost(self):
        """The target's cost by stream size for the controller, once the step graphs it must
        measure are in use (None before that, or while the pool has no room)."""
        if self.program.compiling:
            return None
        capacity = (self.num_blocks - 1) * self.page_size
        max_stream = min(self.scheduler.max_num_seqs * (self.num_draft_tokens + 1),
                         self.scheduler.max_tokens_per_step, capacity)
        return cached_target_cost(self.program, self.kv, self.kv_cache, self.page_size, max_stream,
                                  [self._new_id() for _ in range(self.scheduler.max_num_seqs)])

    def _release_draft_state(self, request: Request) -> None:
        if self.speculation is not None:
            self.speculation.release(request)

    def _forget(self, request: Request) -> None:
        """The request is finished or aborted: drop the proposer's and the controller's state of it."""
        if self.speculation is not None:
            self.speculation.forget(request)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Apply queued demotions, then the copy-on-write ``(src, dst)`` block copies (hot pages only)."""
        self._apply_demotions()
        for src, dst in copies:
            for caches in self._all_caches:
                for t in hot_tensors(caches):  # K, V (and their scales): every tensor a hot id indexes
                    t[dst].copy_(t[src])

    def _apply_demotions(self) -> None:
        """Quantize the pages the KV manager moved to cold blocks (a drafter's own float cache copies them)."""
        demotions = self.kv.take_demotions()
        if not demotions:
            return
        latest = {d: s for s, d in demotions}  # a cold page freed and reused within the batch: the last one counts
        src, dst = list(latest.values()), list(latest)
        for layer in self.kv_cache:
            demote_blocks(*layer[4:], *layer[:4], src, dst)
        for caches in self._all_caches[len(self.kv_cache):]:
            for t in hot_tensors(caches):
                t[dst] = t[src]

    @torch.no_grad()
    def _step(self) -> list[Request]:
        t_start = time.perf_counter()
        chunks, copies = self.scheduler.schedule()
        if not chunks:
            raise RuntimeError("scheduler produced an empty step with work pending")
        finished: list[Request] = []
        decoding = [is_decode(c) for c in chunks]  # before this step's tokens change wants_logits
        self._copy_blocks(copies)
        drafts = (self.speculation.draft(chunks, draining=not self.scheduler.waiting)
                  if self.speculation is not None else {})
        ids: list[int] = []
        seqs, want, trees = [], [], {}
        for c in chunks:
            draft = drafts.get(c.request.request_id)
            extra = draft.token_ids if draft is not None else []
            ids += c.request.all_ids[c.start:c.start + c.num_tokens] + extra
            n = c.num_tokens + len(extra)
            if draft is not None and draft.parents is not None:  # step node 0: the fed token, the root
                trees[len(seqs)] = [-1] + [p + 1 for p in draft.parents]
            seqs.append((self.kv.block_table(c.request.request_id), c.start, n))
            want.append(list(range(n)) if extra else [n - 1] if c.wants_logits else [])
        meta = AttentionMetadata.build(seqs, self.page_size, want, trees, self.program.tree_words if trees else 0)
        self._apply_demotions()  # (drafting may have allocated, and so demoted)
        t_forward = time.perf_counter()
        stream = torch.tensor(ids, dtype=torch.long)
        if self._features:  # the proposer drafts from the target's last hidden states
            logits, hidden = self.program(stream, meta, self.kv_cache, return_hidden=True)
        else:
            logits, hidden = self.program(stream, meta, self.kv_cache), None
        # the target's tokens, picked where the logits are (rows brought back only where a request reads them)
        targets = host_rows(logits, [rows_wanted(c.request, drafts.get(c.request.request_id), len(w))
                                     for c, w in zip(chunks, want)])
        t_back = time.perf_counter()
        self._stats.count_forward(self.kv.usage)
        offset = 0  # (the chunk's first stream token)
        for c, rows, decode, (_, _, fed), target in zip(chunks, want, decoding, seqs, targets):
            r = c.request
            rid = r.request_id
            offset += fed
            if r.finished:  # aborted by an on_token callback earlier in this loop
                continue
            r.num_computed = c.start + c.num_tokens
            token_logits = target.logits  # row i: the distribution of new token i (None: not on the host)
            drafted = len(drafts[rid].token_ids) if rid in drafts else 0
            path: list[int] = []
            if rows and drafted:
                new_tokens, path = self._verify(r, drafts[rid], target)
                if path != list(range(1, len(path) + 1)):  # tree nodes off the chain's cache indices
                    keep_path(self.kv_cache, self.kv.slot_mapping(rid, c.start, max(path) + 1), path)
                token_logits = token_logits[[0] + path] if r.logprobs is not None else None
                if hidden is not None:  # the features of the fed token and the accepted drafts
                    self.speculation.on_features(rid, c.start, hidden[[offset - fed + m for m in [0] + path]])
                # cached now: the last token + the accepted drafts (the final token is not yet fed)
                r.num_computed = c.start + len(new_tokens)
                self.kv.truncate(rid, r.num_computed)
            else:
                new_tokens = [target.token(0)] if rows else []
                if hidden is not None:
                    self.speculation.on_features(rid, c.start, hidden[offset - fed:offset - fed + c.num_tokens])
            emitted = 0
            for j, token in enumerate(new_tokens):
                self._emit(r, token, token_logits[j] if token_logits is not None else None)
                emitted += 1
                if r.finished:
                    finished.append(r)
                    break
            if decode:
                self._account_decode(r, drafts.get(rid), emitted, path)
            if not r.finished:
                self.kv.commit(rid, r.all_ids[:r.num_computed])
            if r.finished:
                self._forget(r)
            elif self.speculation is not None:
                self.speculation.on_verified(rid, r.num_computed)
        t_end = time.perf_counter()
        if self.speculation is not None and all(decoding):  # the whole step but its drafting call
            self.speculation.observe_forward(len(ids), t_end - t_start - self.speculation.draft_call_s)
        self._stats.count_time(t_back - t_forward, (t_forward - t_start) + (t_end - t_back))
        return finished

    def _verify(self, r: Request, draft: Draft, target: TargetRows) -> tuple[list[int], list[int]]:
        """Accepted drafts + one target token (lossless: greedy match or rejection sampling), and the step
        nodes of the accepted drafts (1..a for a chain; a root path for a tree)."""
        tokens, path = verify_draft(draft, target, r.params, r.noise, len(r.output_ids))
        self._stats.count_verify(len(draft.token_ids), draft.parents is not None, len(tokens))
        return tokens, path

    def _account_decode(self, r: Request, draft: Draft | None, emitted: int, path: list[int]) -> None:
        """One decode forward of ``r``: ``draft`` verified (None: none), its step nodes ``path`` accepted."""
        drafted = len(draft.token_ids) if draft is not None else 0
        r.decode_steps += 1
        r.draft_lengths[drafted] = r.draft_lengths.get(drafted, 0) + 1
        self._stats.count_decode(emitted)
        if self.speculation is not None:
            self.speculation.observe_decode(r, draft, path)

    def _emit(self, r: Request, token: int, logits: torch.Tensor | None) -> None:
        r.output_ids.append(token)
        if r.logprobs is not None:
            r.output_logprobs.append(token_logprobs(logits, token, r.logprobs))
        if r.first_token_time is None:
            r.first_token_time = time.perf_counter() - r.arrival_time
        reason = self._finish_reason(r)
        if reason is not None:
            r.finish_reason = reason
            self.scheduler.finish(r)
        if r.on_token is not None:
            r.on_token(token)

    def _finish_reason(self, r: Request) -> str | None:
        if r.output_ids[-1] in self.eos_ids and not r.ignore_eos:
            return "stop"
        if r.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(r.output_ids[-16:], skip_special_tokens=True)
            if any(s in text for s in r.stop):
                return "stop"
        if len(r.output_ids) >= r.max_new_tokens:
            return "length"
        return None
