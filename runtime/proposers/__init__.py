"""Draft proposers for speculative decoding: a registry of kinds, and the factory that builds one from a spec.

Each kind registers itself in its own module (:func:`register_proposer`): a factory that takes
the spec's argument (``"8"`` of ``"layer_skip:8"``, ``""`` of ``"ngram"``) and the
:class:`DraftContext`, the only view of the target a proposer gets. A new kind of draft is one
module that registers; nothing else changes.
"""
from __future__ import annotations

from typing import Callable

import torch

from .base import Draft, DraftContext, DraftRequest, Proposer

_KINDS: dict[str, tuple[Callable[[str, DraftContext], Proposer], str]] = {}  # kind -> (factory, spec help)
_MODULE_FACTORY: list[Callable[[torch.nn.Module, DraftContext], Proposer]] = []


def register_proposer(kind: str, factory: Callable[[str, DraftContext], Proposer], spec_help: str) -> None:
    """Make ``draft="<kind>"`` / ``"<kind>:<arg>"`` build ``factory(arg, ctx)``."""
    _KINDS[kind] = (factory, spec_help)


def register_draft_model(factory: Callable[[torch.nn.Module, DraftContext], Proposer]) -> None:
    """What ``draft=<an nn.Module>`` builds."""
    _MODULE_FACTORY[:] = [factory]


def specs() -> list[str]:
    """The accepted ``draft=`` forms, for error messages and help."""
    return [help for _, help in _KINDS.values()] + ["an nn.Module draft model with the target's vocabulary",
                                                    "an object implementing Proposer"]


def make_proposer(draft, ctx: DraftContext) -> Proposer:
    """A registered spec (``"ngram"``, ``"ngram:N"``, ``"layer_skip:K"``, ...), a draft ``nn.Module``
    or a ready proposer -> a proposer."""
    if isinstance(draft, torch.nn.Module):
        return _MODULE_FACTORY[0](draft, ctx)
    if isinstance(draft, Proposer):
        ctx.refuse_own_weight_dtype(getattr(draft, "name", repr(draft)), "a ready proposer keeps its own weights")
        return draft
    kind, _, arg = draft.partition(":") if isinstance(draft, str) else ("", "", "")
    if kind not in _KINDS:
        raise ValueError(f"draft={draft!r} is not supported; valid: {', '.join(specs())}")
    return _KINDS[kind][0](arg, ctx)


from . import model, ngram  # noqa: E402  (each registers its kinds on import)

__all__ = ["Draft", "DraftContext", "DraftRequest", "Proposer", "make_proposer", "register_proposer",
           "register_draft_model", "specs", "model", "ngram"]
