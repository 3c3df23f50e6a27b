"""Prompt-lookup (n-gram) drafting: guess that the text repeats itself.

If the last ``n`` committed tokens already occurred earlier in the sequence (prompt or
generated text alike), propose the tokens that followed that earlier occurrence. This
costs no model call and works well for code edits, summarisation and retrieval-style
prompts where the output copies spans of the input.

The search is stateless (the whole sequence is scanned with numpy on every call), so
``on_verified`` and ``release`` are no-ops: a scan of a few thousand tokens is a few
tens of microseconds, far below one target forward pass.
"""

from __future__ import annotations

import numpy as np

from .base import Draft, DraftContext, DraftRequest

_VALID_SPECS = "'ngram' or 'ngram:N' (N >= 1, the longest n-gram to match)"


class NgramProposer:
    """Propose the continuation of the most recent earlier occurrence of the suffix.

    For ``n`` from ``max_ngram`` down to ``min_ngram``: find the most recent earlier
    occurrence of the last ``n`` tokens (the trailing occurrence itself does not count;
    earlier occurrences may overlap it) and propose up to ``k`` tokens that followed it.
    The first ``n`` with a match wins, so longer contexts are preferred. The draft is
    shorter than ``k`` when the match is close to the end of the sequence, and empty
    when no suffix of length ``>= min_ngram`` occurred before.

    Parameters
    ----------
    max_ngram : int
        Longest suffix to look up.
    min_ngram : int
        Shortest suffix to look up (``1 <= min_ngram <= max_ngram``).

    Example
    -------
    >>> p = NgramProposer(max_ngram=3)
    >>> # suffix [4, 1, 2] never occurred before; [1, 2] did, at position 0, followed by 3, 4, 1
    >>> p.propose([DraftRequest(0, [1, 2, 3, 4, 1, 2], num_prompt_tokens=4, k=3)])[0].token_ids
    [3, 4, 1]
    >>> p.propose([DraftRequest(0, [1, 2, 3, 4, 1, 2], num_prompt_tokens=4, k=9)])[0].token_ids
    [3, 4, 1, 2]
    >>> p.propose([DraftRequest(0, [1, 2, 3], num_prompt_tokens=3, k=3)])[0].token_ids
    []
    """

    writes_cache = False  # drafting reads token ids only: the engine may draft without verifying

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram; got min_ngram={min_ngram}, max_ngram={max_ngram}"
            )
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.name = f"ngram:{max_ngram}"

    @classmethod
    def from_spec(cls, spec: str) -> NgramProposer:
        """Parse ``"ngram"`` (defaults) or ``"ngram:N"`` (``max_ngram=N``)."""
        kind, sep, arg = spec.strip().partition(":")
        if kind != "ngram":
            raise ValueError(f"unknown proposer spec {spec!r}; expected {_VALID_SPECS}")
        if not sep:
            return cls()
        try:
            n = int(arg)
        except ValueError:
            raise ValueError(f"bad proposer spec {spec!r}; expected {_VALID_SPECS}") from None
        if n < 1:
            raise ValueError(f"bad proposer spec {spec!r}; expected {_VALID_SPECS}")
        return cls(max_ngram=n)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft(self.lookup(r.token_ids, r.k)) for r in requests]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """The draft for one sequence (see the class docstring)."""
        length = len(token_ids)
        if k <= 0 or length < self.min_ngram + 1:  # a match needs one token after it
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
        # ends: positions e < L-1 where an earlier occurrence of the suffix would end.
        # Start with the 1-gram (tokens[e] == last token) and extend one token to the
        # left per round, keeping only the ends whose window still matches; the survivors
        # of round n are exactly the ends of earlier n-gram occurrences.
        ends = np.flatnonzero(tokens[: length - 1] == tokens[-1])
        best_end = -1
        for n in range(1, min(self.max_ngram, length - 1) + 1):
            if n > 1:
                ends = ends[ends >= n - 1]  # the window [e-n+1, e] must start at >= 0
                ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
            if ends.size == 0:
                break
            if n >= self.min_ngram:
                best_end = int(ends[-1])  # most recent occurrence of the longest n so far
        if best_end < 0:
            return []
        return [int(t) for t in token_ids[best_end + 1 : best_end + 1 + k]]

    def on_verified(self, request_id: int, num_committed: int) -> None:
        pass  # stateless: the next propose() rescans the committed tokens

    def release(self, request_id: int) -> None:
        pass


def _ngram(arg: str, ctx: DraftContext) -> NgramProposer:
    spec = f"ngram:{arg}" if arg else "ngram"
    ctx.refuse_own_weight_dtype(spec, "it has no weights")
    return NgramProposer.from_spec(spec)


def _register() -> None:
    from . import register_proposer

    register_proposer("ngram", _ngram, "ngram, ngram:N")


_register()
