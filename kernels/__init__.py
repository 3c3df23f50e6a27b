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

# When the checkout's root is on sys.path (``python -m pytest`` or ``python -c`` run from it), this
# folder is importable under the bare name ``kernels`` too, and shadows Hugging Face's ``kernels``
# package, which transformers >= 5.25 requires and imports. Under that name the package hands over:
# it loads the installed ``kernels`` from the rest of sys.path and leaves it in sys.modules, which
# is what the import statement returns. Without one installed it stays inert (registering the
# specgraph:: ops a second time from copies of these modules would fail).
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
elif __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    _elsewhere = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != _checkout]
    _installed = importlib.machinery.PathFinder.find_spec(__name__, _elsewhere)
    if _installed is not None:
        _module = importlib.util.module_from_spec(_installed)
        sys.modules[__name__] = _module
        _installed.loader.exec_module(_module)
