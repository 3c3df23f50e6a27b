"""Paged-KV kernels: Triton kernels beside pure-torch references, exposed as ``specgraph::`` ops.

Importing this package registers ``torch.ops.specgraph.cache_write`` and
``torch.ops.specgraph.paged_attention`` (defined in ``ops.py``; not re-exported here,
because their names would shadow the ``cache_write`` / ``paged_attention`` submodules),
and their quantized-cache twins ``cache_write_{fp8,int4}`` / ``paged_attention_{fp8,int4}``
(``quant_ops.py``; schemes, layouts and the ``QUANT_SCHEMES`` registry in ``quant.py``).
Each op's implementations (Triton, C++ for CPU, torch reference) register in ``registry.py``,
whose ``select`` is the one rule that picks an implementation per call.
Set ``TRITON_INTERPRET=1`` *before* the first import to run the Triton kernels on CPU
tensors (tests only; see ``config.py``).
"""

# When the repo root is on sys.path (``python -m pytest`` from the checkout), transformers probes
# for Hugging Face's own ``kernels`` package with ``import kernels`` and would import this folder
# a second time under that bare name, registering every specgraph:: op again from copies of these
# modules. Imported under any name but ``specgraph.kernels``, the package stays inert.
if __name__ == "specgraph.kernels":
    from . import ops  # noqa: F401  (registers the specgraph:: ops)
    from . import quant_ops  # noqa: F401  (registers the quantized-cache specgraph:: ops)
    from . import registry
    from .cache_write import cache_write_ref, cache_write_triton
    from .config import triton_kernels_forced, use_triton_kernels
    from .paged_attention import paged_attention_ref, paged_attention_triton
    from .quant import QUANT_SCHEMES, QuantKVCache, QuantScheme, get_scheme

    __all__ = [
        "QUANT_SCHEMES",
        "QuantKVCache",
        "QuantScheme",
        "cache_write_ref",
        "cache_write_triton",
        "get_scheme",
        "ops",
        "paged_attention_ref",
        "paged_attention_triton",
        "quant_ops",
        "registry",
        "triton_kernels_forced",
        "use_triton_kernels",
    ]
