"""CPU tensors in transparent huge pages, for the memory a decode step streams: packed and quantized
weights (``panel_linear.packed``, ``DecoderProgram``) and the KV pool (``DecoderProgram.new_kv_cache``).

A decode step reads every weight once: SmolLM2's float32 linears are 405 MiB, about 100,000 4 KiB
pages and as many TLB misses a step, most of them on the prefetches that run ahead of the kernels.
Linux backs an anonymous mapping with 2 MiB pages where the mapping asks for them
(``madvise(MADV_HUGEPAGE)``) and the system allows it (``/sys/kernel/mm/transparent_hugepage/enabled``
``always`` or ``madvise``, the usual default being ``madvise``: nothing is huge unless asked). Measured
on an Intel Xeon (AVX-512, 2 threads) over SmolLM2's packed float32 linears: 1 row 18.6 -> 17.1 ms,
4 rows 20.1 -> 17.2 ms, 8 rows 25.0 -> 22.8 ms; a step of 4 sequences of 1200 tokens, whose KV reads
match its weight reads, 37.7 -> 35.7 ms with the pool in huge pages.

The values are the same bytes at other addresses: no result changes. Where huge pages are not
available (not Linux, THP ``never``, ``SPECGRAPH_HUGE_PAGES=0``) :func:`moved` returns its tensor and
:func:`zeros` is ``torch.zeros``.
"""
from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import threading
import weakref

import torch

HUGE_PAGE = 2 << 20
#: tensors are placed in mappings of this size (one of its own when larger), so many small weights
#: share huge pages (SmolLM2's int8 linears are 0.3-0.9 MiB each)
CHUNK = 64 << 20
ALIGN = 64  # a placed tensor's start, in bytes (a cache line)
#: smaller tensors stay where they are (norm weights, scales: not worth a copy)
MIN_BYTES = 64 << 10
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
_regions: dict[int, int] = {}  # start -> end address of each live mapping made here


def available() -> bool:
    """Whether an anonymous mapping can ask for huge pages here (and ``SPECGRAPH_HUGE_PAGES`` isn't 0)."""
    if os.environ.get("SPECGRAPH_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    return thp_allows()


@functools.lru_cache(maxsize=None)
def thp_allows(mode_file: str = _THP_MODE) -> bool:
    """Whether the system's THP mode (``always [madvise] never``, the bracket marking it) backs advised
    mappings with huge pages; False where the file is missing (not Linux, no THP). Read once."""
    try:
        with open(mode_file) as f:
            mode = f.read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


class _Chunk:
    """An anonymous mapping that asks for huge pages, starting on a 2 MiB boundary, filled from the
    front. Each tensor placed in it holds the mapping (``torch.frombuffer`` keeps its buffer), so it
    is unmapped when the last of them dies and the chunk is no longer the one being filled."""

    def __init__(self, size: int):
        length = size + HUGE_PAGE  # room to start on a 2 MiB boundary
        self.region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        address = ctypes.addressof(ctypes.c_char.from_buffer(self.region))
        self.used = (-address) % HUGE_PAGE
        self.end = self.used + size
        try:
            self.region.madvise(mmap.MADV_HUGEPAGE, self.used, size)
        except OSError:  # (refused: the mapping still works, in small pages)
            pass
        _regions[address] = address + length
        weakref.finalize(self.region, _regions.pop, address, None)

    def take(self, nbytes: int) -> int:
        """The offset of ``nbytes`` newly taken (the caller checked they fit)."""
        offset, self.used = self.used, -(-(self.used + nbytes) // ALIGN) * ALIGN
        return offset


_filling: _Chunk | None = None
_lock = threading.Lock()  # (a background step compile packs weights while the caller allocates)


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous zeroed CPU tensor in memory that asks to be backed by huge pages."""
    global _filling
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    with _lock:
        if nbytes > CHUNK // 2:
            chunk = _Chunk(-(-nbytes // HUGE_PAGE) * HUGE_PAGE)
        else:
            if _filling is None or _filling.used + nbytes > _filling.end:
                _filling = _Chunk(CHUNK)
            chunk = _filling
        offset = chunk.take(nbytes)
    return torch.frombuffer(chunk.region, dtype=dtype, count=count, offset=offset).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``, in huge pages where :func:`moved` would put it (a CPU
    tensor of at least :data:`MIN_BYTES`, huge pages available): the KV pool's allocators take their memory
    here. It is written once, so its pages are faulted in (and the kernel assembles the huge pages) when the
    pool is made rather than in decode steps. A 2 GiB pool on an Intel Xeon: 0.31 s, where ``torch.zeros`` in
    4 KiB pages took 0.39 s and zeroing then copying into huge pages 0.77 s; a process's first such pool took
    3.3 s, the kernel gathering free huge pages (the copy paid that too)."""
    device = torch.device(device) if device is not None else torch.get_default_device()
    if not _placed_here(device, math.prod(shape) * dtype.itemsize):
        return torch.zeros(shape, dtype=dtype, device=device)
    return empty(tuple(shape), dtype).zero_()


def _placed_here(device: torch.device, nbytes: int) -> bool:
    """Whether a tensor of ``nbytes`` on ``device`` goes to huge pages: a CPU tensor of at least
    :data:`MIN_BYTES`, huge pages available."""
    return device.type == "cpu" and nbytes >= MIN_BYTES and available()


def in_huge_pages(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory lies in a mapping made here (that asked for huge pages)."""
    ptr = t.data_ptr()
    return any(start <= ptr < end for start, end in list(_regions.items()))  # (list: one step under the GIL)


def moved(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in huge pages: a copy when ``t`` is a CPU tensor of at least :data:`MIN_BYTES` and
    huge pages are available and ``t`` is not in them already, else ``t`` itself."""
    if not _placed_here(t.device, t.numel() * t.element_size()) or in_huge_pages(t):
        return t
    out = empty(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out


def move_buffers(gm: "torch.fx.GraphModule") -> int:
    """Move each buffer that ``gm``'s graph reads and :func:`moved` would copy into huge pages, in place
    on its owner module (whoever shares that module sees the new tensor). Parameters stay: they are
    the model's own tensors, shared with its owner. Returns the bytes moved."""
    total = 0
    buffers = dict(gm.named_buffers())
    for target in dict.fromkeys(n.target for n in gm.graph.nodes if n.op == "get_attr"):
        buf = buffers.get(target)
        new = moved(buf) if buf is not None else None
        if new is None or new is buf:
            continue
        owner_name, _, attr = target.rpartition(".")
        owner = gm.get_submodule(owner_name) if owner_name else gm
        owner.register_buffer(attr, new, persistent=attr not in owner._non_persistent_buffers_set)
        total += new.numel() * new.element_size()
    return total
