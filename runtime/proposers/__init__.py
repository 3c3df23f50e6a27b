"""Draft proposers for speculative decoding, and the factory that builds one from a spec."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .base import Draft, DraftRequest, Proposer

if TYPE_CHECKING:
    from ..engine import Engine

SPECS = ("ngram", "ngram:N", "layer_skip:K", "an nn.Module draft model with the target's vocabulary",
         "an object implementing Proposer")


def make_proposer(draft, engine: "Engine") -> Proposer:
    """``"ngram"``, ``"ngram:N"``, ``"layer_skip:K"``, a draft ``nn.Module`` or a ready proposer -> a proposer."""
    from ...compiler.options import BackendOptions
    from ...compiler.program import compile_decoder
    from .model import ModelProposer, first_layers
    from .ngram import NgramProposer

    def options() -> BackendOptions:  # a draft program is compiled like the target's (its cache and weight formats)
        target = engine.program.compiled.context.options
        return BackendOptions(page_size=engine.page_size, lowering=engine.program.lowering, kv_dtype=target.kv_dtype,
                              weight_dtype=target.weight_dtype)

    if isinstance(draft, torch.nn.Module):
        program = compile_decoder(draft, options())
        if program.vocab_size != engine.program.vocab_size:
            raise ValueError(f"draft model vocabulary {program.vocab_size} != target vocabulary "
                             f"{engine.program.vocab_size}; speculative decoding needs the same tokenizer")
        cache = program.new_kv_cache(engine.num_blocks, device=engine.device)
        program.compile_steps(cache, engine.table_width)
        return ModelProposer("draft_model", program, cache, engine.kv, engine.page_size, shares_target_cache=False)
    if isinstance(draft, Proposer):
        return draft
    if not isinstance(draft, str):
        raise ValueError(f"draft={draft!r} is not supported; valid: {', '.join(SPECS)}")
    kind, _, arg = draft.partition(":")
    if kind == "ngram":
        return NgramProposer.from_spec(draft)
    if kind == "layer_skip":
        if not arg.isdigit():
            raise ValueError(f"draft={draft!r}: layer_skip needs a layer count, e.g. 'layer_skip:8'")
        keep = int(arg)
        model = first_layers(engine.model, engine.program.num_layers, keep)
        program = compile_decoder(model, options())
        program.compile_steps(engine.kv_cache[:keep], engine.table_width)
        return ModelProposer(draft, program, engine.kv_cache[:keep], engine.kv, engine.page_size,
                             shares_target_cache=True)
    raise ValueError(f"draft={draft!r} is not supported; valid: {', '.join(SPECS)}")


__all__ = ["Draft", "DraftRequest", "Proposer", "make_proposer", "SPECS"]
