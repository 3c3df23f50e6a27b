"""Continuous batching: which requests run in the next step, and how many tokens each.

Every step mixes decodes (one token per running request) and prefill chunks of waiting or
partially prefilled requests, up to ``max_tokens_per_step`` tokens and ``max_num_seqs``
sequences. When the KV pool cannot hold a step, the most recently admitted request is preempted:
its blocks are freed and it is recomputed later from its prompt plus what it generated (never
another sequence's cache overwritten, never a crash).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from .kv_manager import KVCacheManager
from .sampling import SamplingParams


@dataclass
class Request:
    """One sequence being generated."""

    request_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    generator: torch.Generator | None = None
    stop: tuple[str, ...] = ()
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V is in the cache
    cached_tokens: int = 0  # of the prompt, served by the prefix cache
    finish_reason: str | None = None
    admitted: bool = False
    preemptions: int = 0
    first_token_time: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache (the whole prompt at first, then the last sampled token)."""
        return len(self.all_ids) - self.num_computed


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # first position computed in this step
    num_tokens: int

    @property
    def wants_logits(self) -> bool:
        return self.start + self.num_tokens == len(self.request.all_ids)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int = 8, max_tokens_per_step: int = 512):
        self.kv, self.max_num_seqs, self.max_tokens_per_step = kv, max_num_seqs, max_tokens_per_step
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0

    def add(self, request: Request) -> None:
        need = -(-(len(request.prompt_ids) + request.max_new_tokens) // self.kv.page_size)
        capacity = self.kv.block_pool.num_blocks - 1
        if need > capacity:
            raise ValueError(f"KV pool exhausted: request {request.request_id} needs {need} blocks for "
                             f"{len(request.prompt_ids)} prompt + {request.max_new_tokens} new tokens, the pool has "
                             f"{capacity}; raise num_blocks/kv_cache_memory or lower max_new_tokens")
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.kv.free(victim.request_id)
        victim.num_computed, victim.admitted = 0, False
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)

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

    def schedule(self) -> tuple[list[ScheduledChunk], list[tuple[int, int]]]:
        """The next step's chunks and the copy-on-write block copies to apply first."""
        chunks: list[ScheduledChunk] = []
        copies: list[tuple[int, int]] = []
        budget = self.max_tokens_per_step
        for request in list(self.running):
            if request not in self.running or budget <= 0:
                continue
            n = min(request.num_pending, budget)
            got = self._allocate(request, n)
            if got is None:  # preempted itself: it waits for blocks to free up
                continue
            copies += got
            chunks.append(ScheduledChunk(request, request.num_computed, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not request.admitted:
                cached = self.kv.add_sequence(request.request_id, request.all_ids)
                request.num_computed = cached
                if not request.preemptions:
                    request.cached_tokens = cached
                request.admitted = True
            n = min(request.num_pending, budget)
            got = self.kv.allocate(request.request_id, n)
            if got is None:
                if not self.running and not chunks:
                    raise RuntimeError("KV pool cannot fit a single request's next chunk")  # excluded by add()
                break  # wait for blocks to free up; keep the prefix-cache hit it already holds
            self.waiting.popleft()
            self.running.append(request)
            copies += got
            chunks.append(ScheduledChunk(request, request.num_computed, n))
            budget -= n
        return chunks, copies
