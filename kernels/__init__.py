"""Paged-KV kernels: Triton kernels beside pure-torch references, exposed as ``specgraph::`` ops.

Importing this package registers ``torch.ops.specgraph.cache_write`` and
``torch.ops.specgraph.paged_attention`` (defined in ``ops.py``; not re-exported here,
because their names would shadow the ``cache_write`` / ``paged_attention`` submodules).
Set ``TRITON_INTERPRET=1`` *before* the first import to run the Triton kernels on CPU
tensors (tests only; see ``config.py``).
"""

from . import ops  # noqa: F401  (registers the specgraph:: ops)
from .cache_write import cache_write_ref, cache_write_triton
from .config import triton_kernels_forced, use_triton_kernels
from .paged_attention import paged_attention_ref, paged_attention_triton

__all__ = [
    "cache_write_ref",
    "cache_write_triton",
    "ops",
    "paged_attention_ref",
    "paged_attention_triton",
    "triton_kernels_forced",
    "use_triton_kernels",
]
