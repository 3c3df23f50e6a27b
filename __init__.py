"""specgraph: compile cache-free decoders into paged, quantized, speculative incremental decoders.

    compiled = torch.compile(model, backend="specgraph")
    model, tokenizer = specgraph.load_model("smollm2-135m-instruct")
    engine = specgraph.Engine(model, tokenizer=tokenizer, draft="ngram")
"""
# Absolute imports: this file is also the repository root's __init__.py, which pytest (8+) imports
# as a bare module when it sets up the root as a package (under a directory name that need not be
# an identifier, e.g. a CI clone in /tmp/tmp.XXXX); relative imports would fail there. Importing
# the installed package by name works both ways and never loads a second copy of the modules.
from specgraph.compiler.backend import backend, register, specgraph_backend
from specgraph.compiler.options import BackendOptions
from specgraph.compiler.passes import GraphPass, PassContext, PassResult, graph_pass
from specgraph.compiler.pattern import rewrite
from specgraph.compiler.analysis import UnsupportedAttentionError, UnsupportedModelError

__all__ = ["backend", "register", "specgraph_backend", "BackendOptions", "GraphPass", "PassContext",
           "PassResult", "graph_pass", "rewrite", "load_model", "Engine", "UnsupportedAttentionError",
           "UnsupportedModelError", "distill"]


def __getattr__(name):  # heavy runtime pieces load on first use
    if name == "load_model":
        from specgraph.runtime.loader import load_model

        return load_model
    if name == "Engine":
        from specgraph.runtime.engine import Engine

        return Engine
    if name == "distill":
        from specgraph.runtime.heads.distill import distill

        return distill
    raise AttributeError(f"module 'specgraph' has no attribute {name!r}")
