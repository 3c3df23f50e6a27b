"""Prompt-lookup (n-gram) drafting: guess that the text repeats itself.

If the last ``n`` committed tokens already occurred earlier in the sequence (prompt or
generated text alike), propose the tokens that followed that earlier occurrence. This
costs no model call and works well for code edits, summarisation and retrieval-style
prompts where the output copies spans of the input.

Each request keeps an :class:`NgramIndex` (every n-gram's end positions), extended by the tokens
committed since its last draft, so a lookup is a few dictionary reads whatever the sequence's
length: with the adaptive controller the proposer drafts for every decoding sequence on every
step (its unverified drafts keep the acceptance estimate current), so a whole-sequence scan per
step was most of what a step that speculates nothing cost beyond plain decoding. ``release``
drops a request's index.
"""

from __future__ import annotations

from ..token_tree import TreeBuilder
from .base import Draft, DraftContext, DraftRequest

MAX_OCCURRENCES = 64  # earlier occurrences of the suffix a tree is built from
_VALID_SPECS = "'ngram' or 'ngram:N' (N >= 1, the longest n-gram to match)"


class NgramIndex:
    """Where each n-gram (``n <= max_ngram``) of one growing token sequence ends, most recent last.

    Position ``e`` is indexed once the token after it exists (a match must have a continuation), so a
    sequence of length ``L`` holds the ends ``0..L-2``: its suffix never matches itself. :meth:`sync`
    extends the index by the tokens appended since the last call, or rebuilds it when the tokens do
    not continue the indexed ones.
    """

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._ends: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_ngram)]

    def sync(self, token_ids: list[int]) -> "NgramIndex":
        """Index ``token_ids``: extended when they continue the indexed tokens, else rebuilt."""
        done = len(self.tokens)
        if len(token_ids) < done or token_ids[:done] != self.tokens:
            self.tokens, self._ends = [], [{} for _ in range(self.max_ngram)]
            done = 0
        tokens = self.tokens
        tokens.extend(int(t) for t in token_ids[done:])
        for e in range(max(0, done - 1), len(tokens) - 1):
            for n in range(1, min(self.max_ngram, e + 1) + 1):
                self._ends[n - 1].setdefault(tuple(tokens[e - n + 1:e + 1]), []).append(e)
        return self

    def matches(self, min_ngram: int = 1) -> list[tuple[int, list[int]]]:
        """(n, ends of the earlier occurrences of the last n tokens, most recent last) for each n from
        ``min_ngram`` up to the longest suffix that occurred before. Read-only lists."""
        tokens, out = self.tokens, []
        for n in range(1, min(self.max_ngram, len(tokens) - 1) + 1):
            ends = self._ends[n - 1].get(tuple(tokens[len(tokens) - n:]))
            if not ends:  # a longer suffix cannot occur where this one does not
                break
            if n >= min_ngram:
                out.append((n, ends))
        return out


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
        self._indexes: dict[int, NgramIndex] = {}  # request id -> its tokens' index (see the module docstring)

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
        """Each request's draft (:meth:`draft`), from its kept index."""
        return [self._draft(self._index(r), r.k) for r in requests]

    def draft(self, token_ids: list[int], k: int) -> Draft:
        """Up to ``k`` tokens that followed :meth:`longest_match`; the draft's ``evidence`` is the length of
        the suffix it matched (longer matches are kept more often: on SmolLM2's replies, 12-23% of 1-token
        matches' first drafts against 75-80% of 3-token ones)."""
        return self._draft(self._fresh(token_ids), k) if k > 0 else Draft([])

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """The draft's tokens for one sequence (see the class docstring)."""
        return self.draft(token_ids, k).token_ids

    def longest_match(self, token_ids: list[int]) -> tuple[int, int] | None:
        """(end, n): where the most recent earlier occurrence of the longest matching suffix ends, and its
        length ``n``; None when no suffix of at least ``min_ngram`` tokens occurred before."""
        return self._longest_match(self._fresh(token_ids))

    def occurrences(self, token_ids: list[int], limit: int = MAX_OCCURRENCES) -> list[int]:
        """Ends of earlier occurrences of the sequence's suffix: those of the longest matching n-gram first
        (``n <= max_ngram``), then of shorter ones down to ``min_ngram``; most recent first within each n."""
        return self._occurrences(self._fresh(token_ids), limit)

    def _index(self, r: DraftRequest) -> NgramIndex:
        index = self._indexes.get(r.request_id)
        if index is None:
            index = self._indexes[r.request_id] = NgramIndex(self.max_ngram)
        return index.sync(r.token_ids)

    def _fresh(self, token_ids: list[int]) -> NgramIndex:
        return NgramIndex(self.max_ngram).sync(token_ids)

    def _draft(self, index: NgramIndex, k: int) -> Draft:
        match = self._longest_match(index) if k > 0 else None
        if match is None:
            return Draft([])
        end, n = match
        return Draft(index.tokens[end + 1:end + 1 + k], evidence=n)

    def _longest_match(self, index: NgramIndex) -> tuple[int, int] | None:
        by_n = index.matches(self.min_ngram)
        return (by_n[-1][1][-1], by_n[-1][0]) if by_n else None

    def _occurrences(self, index: NgramIndex, limit: int) -> list[int]:
        out: list[int] = []
        seen: set[int] = set()
        for _, ends in reversed(index.matches(self.min_ngram)):  # longest n first
            for e in reversed(ends):
                if e not in seen:
                    seen.add(e)
                    out.append(e)
                    if len(out) == limit:
                        return out
        return out

    def propose_tree(self, requests: list[DraftRequest], shape) -> list[Draft]:
        """Trees of the continuations of the suffix's earlier occurrences (:meth:`occurrences`): a node's
        children are the distinct tokens that followed its path, the one of the most recent longest match
        first (so the tree holds :meth:`lookup`'s chain), then by how many occurrences continue with them;
        a child's probability is that count over its parent's."""
        out = []
        for r in requests:
            index = self._index(r)
            ends = self._occurrences(index, MAX_OCCURRENCES)
            depth = min(r.k, shape.depth)
            counts: dict[tuple[int, ...], int] = {(): len(ends)}
            children: dict[tuple[int, ...], list[int]] = {}
            for e in ends:  # primary continuation first: children lists keep first-seen order
                cont = tuple(index.tokens[e + 1:e + 1 + depth])
                for d in range(1, len(cont) + 1):
                    path = cont[:d]
                    if path not in counts:
                        counts[path] = 0
                        children.setdefault(cont[:d - 1], []).append(cont[d - 1])
                    counts[path] += 1
            builder = TreeBuilder(shape, max_depth=depth)
            while not builder.done:
                cands = []
                for node in builder.frontier:
                    path = tuple(builder.path(node))
                    kids = children.get(path, [])
                    ranked = kids[:1] + sorted(kids[1:], key=lambda t: -counts[path + (t,)])
                    cands.append([(t, counts[path + (t,)] / counts[path]) for t in ranked])
                builder.add_level(cands)
            tokens, parents = builder.result()
            out.append(Draft(tokens, parents=parents))
        return out

    def on_verified(self, request_id: int, num_committed: int) -> None:
        pass  # the next propose() indexes the tokens committed since

    def release(self, request_id: int) -> None:
        self._indexes.pop(request_id, None)


def _ngram(arg: str, ctx: DraftContext) -> NgramProposer:
    spec = f"ngram:{arg}" if arg else "ngram"
    ctx.refuse_own_weight_dtype(spec, "it has no weights")
    return NgramProposer.from_spec(spec)


def _register() -> None:
    from . import register_proposer

    register_proposer("ngram", _ngram, "ngram, ngram:N")


_register()
