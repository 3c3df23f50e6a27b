"""The one interface every draft proposer implements.

A proposer guesses the next few tokens of each running sequence; the target model then
scores all of them in one forward pass and :mod:`specgraph.runtime.rejection` keeps the
longest prefix the target agrees with. The engine only ever talks to proposers through
:class:`Proposer`, with the two dataclasses below as the boundary, so a new proposer
(n-gram lookup, a small draft model, EAGLE heads, ...) never needs engine changes.

Glossary
--------
committed tokens
    Prompt plus every generated token the target has verified. A proposer sees only
    these (``DraftRequest.token_ids``), never its own unverified guesses.
draft tokens
    The ``0..k`` tokens a proposer guesses for one sequence (``Draft.token_ids``).
    Fewer than ``k``, or none, is always allowed: the engine then verifies fewer
    positions (with an empty draft it is a plain decode step).
draft distribution ``q``
    For a sampling drafter, the distribution each draft token was sampled from
    (``Draft.probs``, one row per draft token). ``None`` means the proposal is
    deterministic (``q`` is one-hot on the drafted token), as for n-gram lookup.
verified / committed count
    After verification the engine reports how many tokens it appended to the
    sequence (accepted draft tokens + 1 bonus/recovered token) through
    :meth:`Proposer.on_verified`, so stateful proposers can roll their caches forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from ..sampling import SamplingParams

if TYPE_CHECKING:
    from ...compiler.options import BackendOptions
    from ...compiler.program import DecoderProgram
    from ..kv_manager import KVCacheManager


@dataclass
class DraftRequest:
    """What a proposer sees of one sequence."""

    request_id: int
    token_ids: list[int]  # prompt + generated so far (committed tokens only)
    num_prompt_tokens: int
    k: int  # how many draft tokens are wanted (upper bound)
    # How the request samples; a sampling drafter draws x_i ~ q_i with these (and reports q in
    # Draft.probs). None / greedy: draft with argmax. Deterministic proposers ignore both.
    params: SamplingParams | None = None
    generator: torch.Generator | None = None


@dataclass
class Draft:
    """A proposer's guess for one sequence."""

    token_ids: list[int]  # 0..k drafted tokens
    # [len(token_ids), V] float32: q per drafted token; None = deterministic (one-hot) proposal
    probs: torch.Tensor | None = None
    # a token tree: parents[i] < i is the draft node token i follows, -1 the last committed token
    # (runtime/token_tree.py); None: a chain. Trees are verified as deterministic candidates (no probs).
    parents: list[int] | None = None
    # how much the proposer's evidence backs the draft, as a small class the controller keeps acceptance
    # per (n-gram lookup: the matched suffix's length); None: no such signal
    evidence: int | None = None

    def __post_init__(self) -> None:
        if self.probs is not None:
            assert self.probs.ndim == 2 and self.probs.shape[0] == len(self.token_ids), (
                f"Draft.probs must be [{len(self.token_ids)}, V]; got {tuple(self.probs.shape)}"
            )
        if self.parents is not None:
            assert self.probs is None and len(self.parents) == len(self.token_ids), "a tree draft has one parent per token"
            assert all(-1 <= p < i for i, p in enumerate(self.parents)), "tree parents must precede their children"


@runtime_checkable
class Proposer(Protocol):
    """Guesses draft tokens for a batch of sequences.

    ``propose`` returns exactly one :class:`Draft` per request, in order. The two hooks
    are bookkeeping only: stateless proposers implement them as no-ops.
    """

    name: str
    # Optional ``writes_cache = False``: proposing touches no KV cache, so the engine may ask for
    # drafts it will not verify (the adaptive controller scores them against the target's tokens,
    # see ``runtime/controller.py``). Without it, every draft asked for has its cache slots.

    def propose(self, requests: list[DraftRequest]) -> list[Draft]: ...

    # Optional ``propose_tree(requests, shape) -> list[Draft]`` (``shape``: a token_tree.TreeShape; each
    # Draft with ``parents``): the proposer drafts token trees, for ``Engine(draft_tree=...)``.

    def on_verified(self, request_id: int, num_committed: int) -> None:
        """``num_committed`` tokens were appended to the sequence after verification."""
        ...

    def release(self, request_id: int) -> None:
        """The sequence finished or was aborted: drop any per-request state."""
        ...


@dataclass(frozen=True)
class DraftContext:
    """What a proposer factory may use of the target (the engine hands this over, nothing else).

    ``weight_dtype`` / ``calibration``: a draft model's own weight storage and the ids its int8/fp8
    weights are calibrated on (None: the target's)."""

    model: torch.nn.Module  # the target model as given (layer_skip takes its first layers)
    program: "DecoderProgram"  # the target's compiled program (vocabulary, layers, options)
    kv: "KVCacheManager"  # the block tables drafts are written through
    kv_cache: list[Any]  # the target's layer caches
    page_size: int
    num_blocks: int
    table_width: int
    device: torch.device
    weight_dtype: str | None = None
    calibration: tuple[int, ...] | None = None

    def options(self, weight_dtype: str | None = None) -> "BackendOptions":
        """Compile options for a drafter: the target's cache format and lowering, ``weight_dtype``
        (default: the target's) and the calibration ids."""
        from ...compiler.options import BackendOptions

        t = self.program.compiled.context.options
        return BackendOptions(page_size=self.page_size, lowering=self.program.lowering, kv_dtype=t.kv_dtype,
                              kv_hot_window=t.kv_hot_window, tree_nodes=t.tree_nodes, weight_dtype=weight_dtype or t.weight_dtype,
                              weight_calibration=t.weight_calibration if self.calibration is None else self.calibration)

    def refuse_own_weight_dtype(self, draft: str, why: str) -> None:
        """A draft without weights of its own cannot take another weight dtype than the target's.
        (The target's options are read only when a dtype is asked for: a ready proposer may wrap
        any program.)"""
        if self.weight_dtype is None:
            return
        target = self.program.compiled.context.options.weight_dtype
        if self.weight_dtype != target:
            raise ValueError(f"draft_weight_dtype={self.weight_dtype!r} needs a draft model: draft={draft!r} takes "
                             f"the target's weight_dtype={target!r} ({why})")
