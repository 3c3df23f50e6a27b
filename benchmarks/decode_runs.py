"""bench_decode.py's timed runs, one generate per mode: HF ``generate`` (time to first token from a
streamer), the cache-free model re-run over the whole sequence per token, a specgraph Engine (cold:
its prefix cache flushed first), and the token comparison between modes."""
from __future__ import annotations

import time

import torch

from common import Run, first_mismatch


# ========================================================================= HF runners
try:
    from transformers.generation.streamers import BaseStreamer as _StreamerBase
except ImportError:  # pragma: no cover - very old transformers
    _StreamerBase = object


class _TimingStreamer(_StreamerBase):
    """HF streamer that only timestamps ``put`` calls (the 1st put is the prompt, the 2nd the first new token)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _left_pad(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, seq in enumerate(batch):
        ids[i, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        mask[i, width - len(seq):] = 1
    return ids, mask


def hf_generate(model, batch: list[list[int]], new_tokens: int, pad_id: int) -> Run:
    """Greedy ``model.generate`` producing exactly ``new_tokens`` per row (EOS not a stop token)."""
    streamer = _TimingStreamer()
    ids, mask = _left_pad(batch, pad_id)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                         use_cache=True, eos_token_id=None, pad_token_id=pad_id, streamer=streamer)
    elapsed = time.perf_counter() - t0
    new = out[:, ids.shape[1]:].tolist()
    first = streamer.times[1] - t0 if len(streamer.times) > 1 else elapsed
    return Run(elapsed, [first] * len(batch), new)


@torch.no_grad()
def nocache_generate(model, prompt: list[int], new_tokens: int) -> Run:
    """The cache-free decoder as given: full forward over the whole sequence for every token."""
    ids = torch.tensor([prompt], dtype=torch.long)
    out, first = [], None
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        logits = model(input_ids=ids, use_cache=False).logits[0, -1]
        tok = int(logits.argmax())
        out.append(tok)
        first = first if first is not None else time.perf_counter() - t0
        ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return Run(time.perf_counter() - t0, [first], [out])


def dynamo_graphs() -> int:
    """Graphs Dynamo has compiled so far in this process (to catch recompiles inside timed runs)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - a missing counter only loses a diagnostic
        return 0


# ================================================================== specgraph runners
def flush_prefix_cache(engine) -> int:
    """Drop every free cached block from the Engine's prefix cache (so the next prefill is cold)."""
    pool = engine.kv.block_pool
    dropped = 0
    for block in range(1, pool.num_blocks):
        if pool.ref_count(block) == 0 and pool.block_key(block) is not None:
            pool.uncache_block(block)
            dropped += 1
    return dropped


def sg_generate(engine, batch: list[list[int]], new_tokens: int, cold: bool = True) -> Run:
    if cold:
        flush_prefix_cache(engine)
    engine.reset_stats()
    first: list[float | None] = [None] * len(batch)

    def on_token(i, _tok):
        if first[i] is None:
            first[i] = time.perf_counter()

    t0 = time.perf_counter()
    results = engine.generate(batch, max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True, on_token=on_token)
    elapsed = time.perf_counter() - t0
    run = Run(elapsed, [(f - t0) if f is not None else elapsed for f in first], [r.token_ids for r in results])
    run.cached_tokens = [r.cached_tokens for r in results]
    run.host_fraction = engine.stats["host_overhead_fraction"]
    return run


# ====================================================================== token checks
def compare_tokens(label: str, got: dict[int, list[int]], ref: dict[int, list[int]]) -> dict:
    per = {}
    for i in sorted(got):
        if i in ref:
            per[i] = first_mismatch(got[i], ref[i])
    same = sum(1 for v in per.values() if v is None)
    detail = ", ".join(f"p{i}@{v}" for i, v in per.items() if v is not None)
    return dict(label=label, identical=same, total=len(per), first_mismatch=per,
                line=f"{label}: {same}/{len(per)} identical" + (f" (first differing token: {detail})" if detail else ""))
