"""Static step graphs replayed as CUDA graphs: one launch per decode step instead of one per kernel.

A batch-1 decode of a small model on a GPU is bound by the host: SmolLM2's 30 layers launch a few
hundred kernels per step, each a few microseconds of Python and driver time, while the GPU needs
less than that to run them. A CUDA graph records the launches of one bucket's step once and
replays them with one call (vLLM's and gpt-fast's decode path).

What a replay may and may not change (the invariant :class:`GraphedStep` keeps): a replay runs
exactly the kernels the capture recorded, on the same addresses. So

* the step's **metadata and token ids** (every input but the caches and lifted constants) are
  copied into buffers owned by the graph before each replay; their shapes are the bucket's, fixed;
* the **KV cache** tensors are used in place (the step writes them): a replay is only valid while the
  cache tensors are the ones captured, so a call with other cache tensors (a new pool) captures
  again rather than writing into freed memory;
* the **outputs** live in the graph's memory pool and the next replay overwrites them, so a replay
  returns copies (the logits of at most a bucket's rows: cheap beside a step); an output that is
  an in-place input (a graph that also returns its caches) is returned as that input, uncopied.

A background compile (``Engine(compile_in_background=True)``) captures in its own thread while the
engine keeps stepping on the eager lowering, so the capture only forbids unsafe calls in its own
thread (``capture_error_mode="thread_local"``).

Nothing in a step may wait on the host: the attention kernels take their grid from static shapes
and derive per-token sequence ids on the device (``kernels/attention_kernel.py``), and metadata is
copied host-to-device before the replay, not inside it. The first call of a step runs it eagerly
(Triton compiles and autotunes its kernels then; a capture must not), the second captures. A
capture that fails (an op that syncs with the host, say) is reported once and that step launches
its kernels one by one from then on: slower, never wrong.
"""
from __future__ import annotations

import warnings
from typing import Callable, Sequence

import torch


class GraphedStep:
    """``fn`` (a compiled static-shape step) replayed from a CUDA graph.

    ``in_place[i]``: input ``i`` is used where it lies (a cache tensor the step writes, a lifted
    constant); the other tensor inputs are copied into the graph's own buffers before each replay.
    ``pool``: a memory pool shared with the program's other captured steps (they never run at once).
    """

    def __init__(self, fn: Callable, in_place: Sequence[bool], pool=None):
        self.fn = fn
        self.in_place = tuple(in_place)
        self.pool = pool
        self.captures = 0  # graphs recorded (a second one when the cache tensors changed)
        self._eager_runs = 0
        self._graph = None
        self._static: list = []
        self._addresses: tuple = ()
        self._out = None
        self._in_place_storages: set[int] = set()
        self.failure: str | None = None  # why a capture failed (the step then runs ``fn`` directly)

    def _in_place_addresses(self, inputs: Sequence) -> tuple:
        return tuple(x.data_ptr() if isinstance(x, torch.Tensor) else id(x)
                     for x, keep in zip(inputs, self.in_place) if keep)

    def __call__(self, *inputs):
        if len(inputs) != len(self.in_place):
            raise ValueError(f"a captured step takes {len(self.in_place)} inputs; got {len(inputs)}")
        if self.failure is not None:
            return self.fn(*inputs)
        if self._graph is not None and self._in_place_addresses(inputs) == self._addresses:
            return self._replay(inputs)
        if self._eager_runs == 0:  # Triton compiles and autotunes on a first launch, which a capture must not see
            self._eager_runs += 1
            return self.fn(*inputs)
        try:
            self._capture(inputs)
        except RuntimeError as e:
            self.failure = f"{type(e).__name__}: {e}".splitlines()[0]
            self._graph, self._static, self._out = None, [], None
            warnings.warn(f"specgraph: capturing a step as a CUDA graph failed, its kernels are launched one by "
                          f"one instead ({self.failure})", stacklevel=2)
            return self.fn(*inputs)
        return self._replay(inputs)

    def _capture(self, inputs: Sequence) -> None:
        self._static = [x if keep or not isinstance(x, torch.Tensor) else x.clone()
                        for x, keep in zip(inputs, self.in_place)]
        self._addresses = self._in_place_addresses(inputs)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._out = self.fn(*self._static)
        self._graph = graph
        self._in_place_storages = {x.untyped_storage().data_ptr() for x, keep in zip(self._static, self.in_place)
                                   if keep and isinstance(x, torch.Tensor)}
        self.captures += 1

    def _replay(self, inputs: Sequence):
        for buf, x, keep in zip(self._static, inputs, self.in_place):
            if not keep and isinstance(x, torch.Tensor):
                buf.copy_(x, non_blocking=True)
        self._graph.replay()
        return _copy_outputs(self._out, self._in_place_storages)


def _copy_outputs(out, keep_storages: set[int]):
    """``out`` with every tensor copied, except those over a storage in ``keep_storages``."""
    if isinstance(out, torch.Tensor):
        return out if out.untyped_storage().data_ptr() in keep_storages else out.clone()
    if isinstance(out, (list, tuple)):
        return type(out)(_copy_outputs(o, keep_storages) for o in out)
    return out
