"""Continuous batching: which requests run in the next step, and how many tokens each.

Every step mixes decodes (one token per running request) and prefill chunks of waiting or
partially prefilled requests, up to ``max_tokens_per_step`` tokens and ``max_num_seqs``
sequences.

Resource rule
-------------
* **Only running requests hold KV blocks.** A waiting request holds nothing: admission
  (prefix-cache lookup, references on the hit blocks, blocks for the first chunk) is one
  all-or-nothing :meth:`KVCacheManager.admit`. A request that does not fit stays waiting with no
  references, so waiting requests can never starve the running ones of blocks.
* **Evictable blocks count as free.** A full block of a finished or preempted sequence stays in
  the prefix cache with reference count 0; the pool hands such blocks out again (least recently
  freed first) only when no uncached free block is left. Eviction is therefore implicit in
  every allocation, never a separate step that could be forgotten.
* **Preemption.** Running requests are served oldest first. When a running request's chunk does
  not fit, the most recently admitted running request is preempted: all its references are
  dropped (its committed full blocks stay cached, so its recompute usually starts with prefix
  hits) and it goes back to the head of the waiting queue. Admission never preempts.
* **Forks** (``n > 1`` samples of one prompt): a child waits while its parent prefills, then
  :meth:`fork` shares the parent's blocks of ``prompt[:-1]`` (copy-on-write for the shared
  partial block) and the child recomputes only the last prompt token. A child whose parent is
  not running is admitted like any request.

Why every request finishes: :meth:`add` refuses a request needing more than the pool
(``ceil((prompt + max_new_tokens) / page_size)`` blocks, drafts included, since at most
``prompt + max_new_tokens - 1`` tokens are ever in the cache). The oldest running request always
gets its chunk: if short, every newer request is preempted, after which everything but its own
blocks is free or evictable and its whole need fits. So it gains at least one token per step
and finishes in at most ``prompt + max_new_tokens`` steps. With nothing running, the head of the
waiting queue is admitted into a pool that is all free or evictable (waiting requests hold
nothing), where it fits. A finished, aborted or preempted request releases its references at
once, so the pool ends with only evictable cached blocks.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from .kv_manager import KVCacheManager
from .sampling import PositionNoise, SamplingParams


@dataclass
class Request:
    """One sequence being generated."""

    request_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    generator: torch.Generator | None = None  # a draft model's own samples
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    on_token: Callable[[int], None] | None = None  # called with each new token id (streaming)
    num_draft_tokens: int | None = None  # at most this many drafts per step (0: none); None: the engine's
    logprobs: int | None = None  # record log p of each new token and this many top alternatives
    output_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    parent: Request | None = None  # another sample of the same prompt whose blocks this one forks
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V is in the cache
    cached_tokens: int = 0  # of the prompt, served by the prefix cache (or a fork) on first admission
    finish_reason: str | None = None  # "stop", "length" or "abort"
    preemptions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    noise: PositionNoise | None = None  # the uniforms the target's sampled tokens are drawn with, by position
    first_token_time: float | None = None  # seconds from arrival to the first new token
    decode_steps: int = 0  # target forwards that fed this sequence one token (+ its drafts)
    draft_lengths: dict[int, int] = field(default_factory=dict)  # drafts verified in a step -> such steps

    def speculation_summary(self) -> dict:
        """Per request: decode steps, how many verified drafts, and the lengths chosen."""
        spec = sum(n for k, n in self.draft_lengths.items() if k)
        drafted = sum(k * n for k, n in self.draft_lengths.items())
        return dict(request_id=self.request_id, decode_steps=self.decode_steps, speculated_steps=spec,
                    mean_draft_length=drafted / spec if spec else 0.0, draft_lengths=dict(sorted(self.draft_lengths.items())))

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache (the whole prompt at first, then the last sampled token)."""
        return len(self.all_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # first position computed in this step
    num_tokens: int

    @property
    def wants_logits(self) -> bool:
        return self.start + self.num_tokens == len(self.request.all_ids)


def blocks_needed(request: Request, page_size: int) -> int:
    """Blocks the request can hold at most (its prompt and every new token, drafts included)."""
    return -(-(len(request.prompt_ids) + request.max_new_tokens) // page_size)


class Scheduler:
    """See the module docstring for the resource rule and why the loop always makes progress."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int = 8, max_tokens_per_step: int = 512,
                 on_preempt: Callable[[Request], None] | None = None):
        if max_num_seqs < 1 or max_tokens_per_step < 1:
            raise ValueError(f"max_num_seqs and max_tokens_per_step must be >= 1; got {max_num_seqs}, "
                             f"{max_tokens_per_step}")
        self.kv, self.max_num_seqs, self.max_tokens_per_step = kv, max_num_seqs, max_tokens_per_step
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: oldest first
        self.on_preempt = on_preempt  # e.g. drop a drafter's per-request state: its cache went with the blocks
        self.preemptions = 0
        self.forks = 0

    def check_fits(self, request: Request) -> None:
        """Raise ``ValueError`` with the numbers if the request can never fit the pool."""
        need = blocks_needed(request, self.kv.page_size)
        capacity = self.kv.block_pool.num_blocks - 1
        if need > capacity:
            raise ValueError(f"KV pool exhausted: request {request.request_id} needs {need} blocks of "
                             f"{self.kv.page_size} tokens for {len(request.prompt_ids)} prompt + "
                             f"{request.max_new_tokens} new tokens, the pool has {capacity}; raise "
                             f"num_blocks/kv_cache_memory or lower max_new_tokens")

    def add(self, request: Request) -> None:
        self.check_fits(request)
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request) -> None:
        """A running request is done: release its blocks at once."""
        self.running.remove(request)
        self.kv.free(request.request_id)

    def abort(self, request: Request) -> None:
        """Drop a waiting or running request (client gone); its blocks are released at once."""
        if request in self.running:
            self.finish(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.finish_reason = request.finish_reason or "abort"

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.kv.free(victim.request_id)
        victim.num_computed = 0
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)
        if self.on_preempt is not None:
            self.on_preempt(victim)

    def _allocate(self, request: Request, n: int) -> list[tuple[int, int]] | None:
        """Allocate, preempting the newest running requests while the pool is short.

        Running requests are scheduled in admission order, so the newest one is never one this
        step already scheduled, unless it is ``request`` itself: then ``request`` is preempted
        and None returned.
        """
        while True:
            copies = self.kv.allocate(request.request_id, n)
            if copies is not None:
                return copies
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return None

    def _parent_prefilling(self, child: Request) -> bool:
        parent = child.parent
        return parent is not None and parent in self.running and parent.num_computed < len(child.prompt_ids) - 1

    def _fork_ready_children(self) -> None:
        """Children whose parent has computed ``prompt[:-1]`` share its blocks (no new blocks needed)."""
        for child in list(self.waiting):
            if len(self.running) >= self.max_num_seqs:
                return
            parent = child.parent
            if (parent is None or child.num_computed or parent not in self.running
                    or parent.num_computed < len(child.prompt_ids) - 1 or child.output_ids):
                continue
            self.kv.fork(parent.request_id, child.request_id)
            self.kv.truncate(child.request_id, len(child.prompt_ids) - 1)
            child.num_computed = len(child.prompt_ids) - 1
            if not child.preemptions:
                child.cached_tokens = child.num_computed
            self.waiting.remove(child)
            self.running.append(child)
            self.forks += 1

    def schedule(self) -> tuple[list[ScheduledChunk], list[tuple[int, int]]]:
        """The next step's chunks and the copy-on-write block copies to apply first."""
        self._fork_ready_children()
        chunks: list[ScheduledChunk] = []
        copies: list[tuple[int, int]] = []
        budget = self.max_tokens_per_step
        for request in list(self.running):
            if request not in self.running or budget <= 0:
                continue
            n = min(request.num_pending, budget)
            got = self._allocate(request, n)
            if got is None:  # preempted itself: it waits, holding nothing, for blocks to free up
                continue
            copies += got
            chunks.append(ScheduledChunk(request, request.num_computed, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if self._parent_prefilling(request):
                break  # it will fork the parent's blocks once the prompt is in the cache
            admitted = self.kv.admit(request.request_id, request.all_ids, budget)
            if admitted is None:
                if not self.running:  # the pool is all free or evictable: see the module docstring
                    raise RuntimeError(f"scheduler invariant broken: request {request.request_id} does not fit "
                                       f"an idle pool of {self.kv.num_free_blocks} free blocks")
                break  # wait, holding nothing, for running requests to free blocks
            cached, n = admitted
            request.num_computed = cached
            if not request.preemptions:
                request.cached_tokens = cached
            self.waiting.popleft()
            self.running.append(request)
            chunks.append(ScheduledChunk(request, cached, n))
            budget -= n
        return chunks, copies
