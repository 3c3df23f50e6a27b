"""Draft proposers for speculative decoding: a registry of kinds, and the factory that builds one from a spec.

Each kind registers itself in its own module (:func:`register_proposer`): a factory that takes
the spec's argument (``"8"`` of ``"layer_skip:8"``, ``""`` of ``"ngram"``) and the
:class:`DraftContext`, the only view of the target a proposer gets. A new kind of draft is one
module that registers; nothing else changes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from .base import Draft, DraftContext, DraftRequest, Proposer


@dataclass(frozen=True)
class Kind:
    """A registered ``draft=`` kind. ``features``: its proposers read the target's hidden states (the engine
    compiles the target with ``hidden_states`` and calls ``proposer.on_features``); ``default_tree``: the
    token-tree shape it drafts when the engine is given none; ``extra_tree_nodes``: nodes its proposers add
    to each tree beyond the shape's (``"<kind>+ngram"``'s lookup branch)."""

    factory: Callable[[str, DraftContext], Proposer]
    spec_help: str
    features: bool = False
    default_tree: str | None = None
    extra_tree_nodes: int = 0


_KINDS: dict[str, Kind] = {}
_MODULE_FACTORY: list[Callable[[torch.nn.Module, DraftContext], Proposer]] = []


def register_proposer(kind: str, factory: Callable[[str, DraftContext], Proposer], spec_help: str,
                      features: bool = False, default_tree: str | None = None) -> None:
    """Make ``draft="<kind>"`` / ``"<kind>:<arg>"`` build ``factory(arg, ctx)`` (see :class:`Kind`)."""
    _KINDS[kind] = Kind(factory, spec_help, features, default_tree)


def kind_of(draft) -> Kind | None:
    """The registered kind of a string spec (None for modules, ready proposers and unknown kinds); a spec
    ``"<kind spec>+ngram[:N]"`` is that kind with a prompt-lookup branch in its trees (``lookup_branch.py``)."""
    if not isinstance(draft, str):
        return None
    primary, lookup = split_lookup(draft)
    kind = _KINDS.get(primary.partition(":")[0])
    if lookup is None or kind is None:
        return kind
    return replace(kind, factory=lambda arg, ctx: LookupBranch(kind.factory(arg, ctx), NgramProposer.from_spec(lookup)),
                   extra_tree_nodes=BRANCH_NODES)


def split_lookup(spec: str) -> tuple[str, str | None]:
    """``"eagle:PATH+ngram:3"`` -> ``("eagle:PATH", "ngram:3")``; a spec without a lookup branch -> ``(spec, None)``."""
    primary, plus, lookup = spec.rpartition("+")
    return (primary, lookup) if plus and primary and lookup.partition(":")[0] == "ngram" else (spec, None)


def register_draft_model(factory: Callable[[torch.nn.Module, DraftContext], Proposer]) -> None:
    """What ``draft=<an nn.Module>`` builds."""
    _MODULE_FACTORY[:] = [factory]


def specs() -> list[str]:
    """The accepted ``draft=`` forms, for error messages and help."""
    return [k.spec_help for k in _KINDS.values()] + ["<a kind that drafts trees>+ngram (a lookup branch in its trees)",
                                                    "an nn.Module draft model with the target's vocabulary",
                                                    "an object implementing Proposer"]


def make_proposer(draft, ctx: DraftContext) -> Proposer:
    """A registered spec (``"ngram"``, ``"ngram:N"``, ``"layer_skip:K"``, ...), a draft ``nn.Module``
    or a ready proposer -> a proposer."""
    if isinstance(draft, torch.nn.Module):
        return _MODULE_FACTORY[0](draft, ctx)
    if isinstance(draft, Proposer):
        ctx.refuse_own_weight_dtype(getattr(draft, "name", repr(draft)), "a ready proposer keeps its own weights")
        return draft
    kind = kind_of(draft)
    if kind is None:
        raise ValueError(f"draft={draft!r} is not supported; valid: {', '.join(specs())}")
    return kind.factory(split_lookup(draft)[0].partition(":")[2], ctx)


from . import eagle, medusa, model, ngram  # noqa: E402  (each registers its kinds on import)
from .lookup_branch import BRANCH_NODES, LookupBranch  # noqa: E402
from .ngram import NgramProposer  # noqa: E402

__all__ = ["Draft", "DraftContext", "DraftRequest", "Kind", "Proposer", "make_proposer", "register_proposer",
           "register_draft_model", "kind_of", "specs", "eagle", "medusa", "model", "ngram"]
