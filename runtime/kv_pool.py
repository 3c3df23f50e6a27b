"""How many KV pages a memory budget buys: one kind of page, or hot and cold pages.

A cache of one kind gets ``memory // bytes per page`` pages. A hot/cold cache
(``kernels/hot_cold.py``) splits the budget:

* ``fp8`` / ``int4``: the hot pages (the model's dtype) hold what must be hot at once: every
  running sequence's window, the page it writes and the slots of its drafts, plus one prefill chunk
  (whose pages stay hot until the chunk is committed); at most half of the memory. The quantized
  cold pages take the rest, so long contexts cost the cold bytes per token.
* ``adaptive``: half of the memory hot (every page stays hot while they last), half cold (where
  pages go under pressure).

Given hot pages (``num_blocks``) without cold ones, a hot/cold cache gets as many cold pages.
"""
from __future__ import annotations


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pool_sizes(program, memory: int, num_blocks: int | None = None, num_cold: int | None = None,
               max_num_seqs: int = 8, max_tokens_per_step: int = 512, drafts: int = 1) -> tuple[int, int]:
    """``(hot pages, cold pages)`` for ``program`` (a ``DecoderProgram``) in ``memory`` bytes; a cache of one
    kind has no cold pages. ``drafts``: the most stream tokens one decoding sequence feeds per step."""
    page = program.page_size
    per_cold = program.kv_bytes_per_token() * page
    if not program.hot_cold:
        return (num_blocks if num_blocks is not None else max(2, memory // per_cold)), 0
    per_hot = program.kv_hot_bytes_per_token() * page
    options = program.compiled.context.options
    if num_blocks is None:
        if options.kv_dtype == "adaptive":
            num_blocks = max(2, memory // 2 // per_hot)
        else:
            per_seq = options.hot_window_tokens // page + 1 + _cdiv(drafts, page)
            num_blocks = 1 + max_num_seqs * per_seq + _cdiv(max_tokens_per_step, page)
            num_blocks = max(2, min(num_blocks, memory // 2 // per_hot))
        if num_cold is None:
            num_cold = max(0, (memory - num_blocks * per_hot) // per_cold)
    return num_blocks, num_blocks if num_cold is None else num_cold
