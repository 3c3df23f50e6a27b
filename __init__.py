"""specgraph: compile cache-free decoders into paged, quantized, speculative incremental decoders.

    compiled = torch.compile(model, backend="specgraph")
    model, tokenizer = specgraph.load_model("smollm2-135m-instruct")
    engine = specgraph.Engine(model, tokenizer=tokenizer, draft="ngram")
"""
from .compiler.backend import backend, register, specgraph_backend
from .compiler.options import BackendOptions
from .compiler.passes import GraphPass, PassContext, PassResult, graph_pass
from .compiler.pattern import rewrite

__all__ = ["backend", "register", "specgraph_backend", "BackendOptions", "GraphPass", "PassContext",
           "PassResult", "graph_pass", "rewrite", "load_model", "Engine"]


def __getattr__(name):  # heavy runtime pieces load on first use
    if name == "load_model":
        from .runtime.loader import load_model

        return load_model
    if name == "Engine":
        from .runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'specgraph' has no attribute {name!r}")
