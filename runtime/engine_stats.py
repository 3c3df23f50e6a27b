"""The figures an :class:`~specgraph.Engine` reports as ``engine.stats``: what the last ``generate``
call did, and counters since ``engine.reset_stats()``."""
from __future__ import annotations

from typing import Any


class EngineStats:
    """Counts what an engine's steps do; :meth:`snapshot` is ``engine.stats``.

    ``kv_pool_usage``: fraction of the pool's blocks held by live requests (evictable cached
    blocks do not count); ``preemptions``: running requests pushed back to recompute for lack
    of blocks; ``evictions``: cached blocks handed out again; ``forks`` and ``cow_copies``:
    samples that shared their prompt's blocks, and shared blocks copied before a write;
    ``recompiles``: step graphs compiled after the engine was built (0 in steady state);
    ``cuda_graph_captures``: CUDA graphs recorded for the decode buckets (one each on CUDA, 0 elsewhere);
    ``host_overhead_fraction``: of the time in steps, the share spent outside the target's forward
    (scheduling, drafting, metadata, sampling), from ``host_s`` and ``forward_s``.
    With a draft: ``mean_accepted_tokens`` is the tokens a sequence gained per target forward
    over all its decode forwards, speculative or not (prefill chunks excluded; ``decode_emitted``
    / ``decode_forwards``); ``acceptance_rate`` the share of verified drafts kept;
    ``speculated_fraction`` the share of decode forwards that verified drafts; ``requests``
    the last ``generate`` call's per-request decisions (decode steps, speculated steps, draft
    lengths chosen); ``forward_cost_s`` the controller's seconds per target forward by stream
    size (its measured shape times ``forward_cost_scale``, learned from the steps: 1.2 means
    they now take 20% longer than when the engine measured them, and times
    ``forward_cost_corrections``, by stream size, where steps of that size took more or less than
    the measured shape says relative to the others); ``mean_accepted_path`` the drafts kept per
    verify forward (a tree's accepted root path) and ``tree_nodes_verified`` the tree nodes
    verified; ``draft_s`` the seconds spent drafting (part of ``host_s``); ``draft_lookups_skipped`` the
    decode steps on which a proposer that drafts for free (n-gram lookup) was not asked, lookups having cost
    more host time than their plans were predicted to save (``runtime/lookup_gate.py``).
    """

    def __init__(self, engine):
        self._engine = engine
        self.reset()

    def reset(self) -> None:
        self._values: dict[str, Any] = dict(
            tokens_per_second=0.0, generated_tokens=0, prompt_tokens=0, cached_prompt_tokens=0, target_forwards=0,
            kv_pool_peak_usage=0.0, time_to_first_token_s=0.0, elapsed_s=0.0, draft_tokens=0, accepted_tokens=0,
            verify_steps=0, verify_emitted=0, decode_forwards=0, tree_nodes_verified=0, decode_emitted=0,
            forward_s=0.0, host_s=0.0, requests=[])
        self._counter_base = self._counters()
        speculation = self._engine.speculation
        self._draft_s_base = speculation.draft_s if speculation is not None else 0.0
        self._skipped_base = self._skipped_lookups()

    # ------------------------------------------------------------ counting
    def count_forward(self, pool_usage: float) -> None:
        """A target forward ran; the pool held ``pool_usage`` of its blocks."""
        s = self._values
        s["target_forwards"] += 1
        s["kv_pool_peak_usage"] = max(s["kv_pool_peak_usage"], pool_usage)

    def count_time(self, forward_s: float, host_s: float) -> None:
        self._values["forward_s"] += forward_s
        self._values["host_s"] += host_s

    def count_verify(self, drafted: int, tree: bool, emitted: int) -> None:
        """``drafted`` drafts (tree nodes when ``tree``) verified, ``emitted`` tokens kept (drafts + 1)."""
        s = self._values
        if tree:
            s["tree_nodes_verified"] += drafted
        s["draft_tokens"] += drafted
        s["accepted_tokens"] += emitted - 1
        s["verify_steps"] += 1
        s["verify_emitted"] += emitted

    def count_decode(self, emitted: int) -> None:
        """A decode forward of one sequence gained it ``emitted`` tokens."""
        self._values["decode_forwards"] += 1
        self._values["decode_emitted"] += emitted

    def finish_generate(self, elapsed: float, requests: list) -> None:
        """The figures of a ``generate`` call over ``requests`` that took ``elapsed`` seconds."""
        s = self._values
        new_tokens = sum(len(r.output_ids) for r in requests)
        s["elapsed_s"] = elapsed
        s["generated_tokens"] = new_tokens
        s["tokens_per_second"] = new_tokens / elapsed if elapsed > 0 else 0.0
        s["prompt_tokens"] = sum(len(r.prompt_ids) for r in requests)
        s["cached_prompt_tokens"] = sum(r.cached_tokens for r in requests)
        ttft = [r.first_token_time for r in requests if r.first_token_time is not None]
        s["time_to_first_token_s"] = sum(ttft) / len(ttft) if ttft else 0.0
        if self._engine.proposer is not None:
            s["requests"] = [r.speculation_summary() for r in requests]

    # ------------------------------------------------------------ reading
    def snapshot(self) -> dict[str, Any]:
        engine = self._engine
        s = dict(self._values)
        s["prefix_cache_hit_rate"] = engine.kv.prefix_cache_hit_rate
        s["kv_pool_usage"] = engine.kv.usage
        s["kv_bytes_per_token"] = engine.program.kv_bytes_per_token()
        s["kv_pool_tokens"] = engine.table_width * engine.page_size
        if engine.program.hot_cold:
            s["kv_hot_bytes_per_token"] = engine.program.kv_hot_bytes_per_token()
            s["kv_hot_blocks"], s["kv_cold_blocks"] = engine.num_blocks - 1, engine.num_cold_blocks
            s["kv_cold_fraction"] = 1.0 - engine.kv.block_pool.num_free_cold_blocks / max(engine.num_cold_blocks, 1)
        busy = s["forward_s"] + s["host_s"]
        s["host_overhead_fraction"] = s["host_s"] / busy if busy else 0.0
        for name, value in self._counters().items():
            s[name] = value - self._counter_base[name]
        if engine.proposer is not None:
            s["proposer"] = engine.proposer.name
            s["num_draft_tokens"] = engine.num_draft_tokens
            s["adaptive"] = engine.adaptive
            s["acceptance_rate"] = _ratio(s["accepted_tokens"], s["draft_tokens"])
            s["mean_accepted_tokens"] = _ratio(s["decode_emitted"], s["decode_forwards"])
            s["speculated_fraction"] = _ratio(s["verify_steps"], s["decode_forwards"])
            s["mean_accepted_path"] = _ratio(s["accepted_tokens"], s["verify_steps"])
            s["draft_tree"] = engine.draft_tree
            s["draft_s"] = engine.speculation.draft_s - self._draft_s_base
            if engine.controller is not None:
                s["forward_cost_s"] = engine.controller.forward_cost.as_dict()
                s["forward_cost_scale"] = engine.controller.forward_cost.scale
                s["forward_cost_corrections"] = dict(engine.controller.forward_cost.corrections)
                s["draft_lookups_skipped"] = self._skipped_lookups() - self._skipped_base
        return s

    def _skipped_lookups(self) -> int:
        controller = self._engine.controller
        return controller.lookups.skipped if controller is not None else 0

    def _counters(self) -> dict[str, int]:
        engine = self._engine
        drafter = getattr(engine.proposer, "program", None)
        return dict(preemptions=engine.scheduler.preemptions, evictions=engine.kv.block_pool.num_evictions,
                    kv_demotions=engine.kv.num_demotions, forks=engine.scheduler.forks,
                    cow_copies=engine.kv.num_cow_copies,
                    recompiles=engine.program.recompiles + (drafter.recompiles if drafter is not None else 0),
                    cuda_graph_captures=engine.program.captures + (drafter.captures if drafter is not None else 0))


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0
