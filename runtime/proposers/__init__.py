"""Draft proposers for speculative decoding, and the factory that builds one from a spec."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .base import Draft, DraftRequest, Proposer

if TYPE_CHECKING:
    from ..engine import Engine

SPECS = ("ngram", "ngram:N", "layer_skip:K", "an nn.Module draft model with the target's vocabulary",
         "an object implementing Proposer")


def make_proposer(draft, engine: "Engine", weight_dtype: str | None = None,
                  calibration: tuple[int, ...] | None = None) -> Proposer:
    """``"ngram"``, ``"ngram:N"``, ``"layer_skip:K"``, a draft ``nn.Module`` or a ready proposer -> a proposer.

    ``weight_dtype``: the storage of a draft model's linears (None: the target's). Only a draft
    ``nn.Module`` has weights of its own; ``layer_skip`` runs on the target's weights, so it takes
    the target's dtype, and asking for another is an error rather than a silent copy.
    ``calibration``: the token ids a draft model's int8/fp8 weights are calibrated on (None: the
    target's; a draft in its own dtype needs its own, since a float target has none).
    """
    from ...compiler.options import BackendOptions
    from ...compiler.program import compile_decoder
    from .model import ModelProposer, first_layers
    from .ngram import NgramProposer

    def target() -> BackendOptions:  # read only for drafts compiled here (a ready proposer may wrap any program)
        return engine.program.compiled.context.options

    if weight_dtype is not None and not isinstance(draft, torch.nn.Module) and weight_dtype != target().weight_dtype:
        owner = "it runs on the target's weights" if str(draft).startswith("layer_skip") else "it has no weights"
        raise ValueError(f"draft_weight_dtype={weight_dtype!r} needs a draft model: draft={draft!r} takes the "
                         f"target's weight_dtype={target().weight_dtype!r} ({owner})")

    def options(weight_dtype: str | None = None) -> BackendOptions:  # the target's cache format
        t = target()
        return BackendOptions(page_size=engine.page_size, lowering=engine.program.lowering, kv_dtype=t.kv_dtype,
                              weight_dtype=weight_dtype or t.weight_dtype,
                              weight_calibration=t.weight_calibration if calibration is None else calibration)

    if isinstance(draft, torch.nn.Module):
        program = compile_decoder(draft, options(weight_dtype))
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
