"""One registry of kernel implementations, and the one rule that picks an implementation per call.

Every implementation of a ``specgraph::`` op (Triton, C++ for CPU, the pure-torch reference, a
future CUDA one) registers once, in the module that defines it, with what it supports:

* ``devices``: where its tensors may live (``"cpu"``, ``"cuda"``);
* ``applies(*args)``: optionally, whether it takes this call (dtypes, layouts, or where a
  measurement says it pays, as the C++ attention kernel does);
* ``priority``: among those that take the call, the highest wins. The reference registers for
  every device with priority 0 and takes every call, so some implementation always runs.

:func:`select` is the rule: inside ``config.use_triton_kernels()`` the ``"triton"`` implementation
(CPU tensors then run in the Triton interpreter); otherwise the highest-priority implementation
for the device of the call's first tensor that takes the call. The custom ops' bodies
(``ops.py``, ``quant_ops.py``, run by Inductor's extern calls and by eager callers) and the eager
lowering (``compiler/lowering.py``) both call :func:`dispatch`, so no other place decides.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .config import triton_kernels_forced


@dataclass(frozen=True)
class Implementation:
    op: str  # the op's name in the specgraph namespace, e.g. "paged_attention"
    name: str  # "triton", "cpp", "reference", ...
    fn: Callable
    devices: tuple[str, ...]
    applies: Callable[..., bool] | None = None
    priority: int = 0


_IMPLEMENTATIONS: dict[str, list[Implementation]] = {}


def register(op: str, name: str, fn: Callable, devices: tuple[str, ...], applies: Callable[..., bool] | None = None,
             priority: int = 0) -> None:
    """Register ``fn`` as implementation ``name`` of ``specgraph::<op>`` (re-registering replaces it)."""
    impls = [i for i in _IMPLEMENTATIONS.get(op, []) if i.name != name]
    impls.append(Implementation(op, name, fn, tuple(devices), applies, priority))
    impls.sort(key=lambda i: -i.priority)
    _IMPLEMENTATIONS[op] = impls


def implementations(op: str) -> list[Implementation]:
    """The registered implementations of ``op``, highest priority first."""
    if op not in _IMPLEMENTATIONS:
        raise KeyError(f"no implementation registered for specgraph::{op}; known ops: {sorted(_IMPLEMENTATIONS)}")
    return list(_IMPLEMENTATIONS[op])


def select(op: str, *args) -> Implementation:
    """The implementation that runs this call of ``op`` (see the module docstring)."""
    impls = implementations(op)
    if triton_kernels_forced():
        for impl in impls:
            if impl.name == "triton":
                return impl
        raise RuntimeError(f"Triton is forced but specgraph::{op} has no Triton implementation")
    device = next((a.device.type for a in args if hasattr(a, "device")), "cpu")
    for impl in impls:
        if device in impl.devices and (impl.applies is None or impl.applies(*args)):
            return impl
    raise RuntimeError(f"no implementation of specgraph::{op} runs on {device} for this call "
                       f"(registered: {[(i.name, i.devices) for i in impls]})")


def dispatch(op: str, *args):
    """Run ``op`` on ``args`` with the implementation :func:`select` picks."""
    return select(op, *args).fn(*args)
