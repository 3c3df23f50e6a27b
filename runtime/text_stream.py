"""Text of a growing token list, released as it becomes final (streaming output).

A tail that could still grow into a stop string, or an incomplete UTF-8 character (decoded as
U+FFFD), is held back until more tokens or the end arrive; a stop string ends the text before it.
"""
from __future__ import annotations


def releasable(text: str, stops: list[str], final: bool) -> tuple[int, bool]:
    """How many characters of ``text`` may be shown, and whether a stop string ends it."""
    cut = min((text.index(s) for s in stops if s in text), default=None)
    if cut is not None:
        return cut, True
    if final:
        return len(text), False
    keep = len(text)
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                keep = min(keep, len(text) - k)
                break
    while keep and text[keep - 1] == "\ufffd":
        keep -= 1
    return keep, False


class TextStream:
    """``add(token)`` / ``finish()`` return the newly releasable text; ``stopped`` once a stop string showed."""

    def __init__(self, tokenizer, stops: list[str] | tuple[str, ...] = ()):
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.tokens: list[int] = []
        self.shown = 0  # characters already released
        self.stopped = False

    def add(self, token: int) -> str:
        self.tokens.append(token)
        return self._release(final=False)

    def finish(self) -> str:
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        keep, self.stopped = releasable(text, self.stops, final)
        new = text[self.shown:keep] if keep > self.shown else ""
        self.shown = max(self.shown, keep)
        return new
