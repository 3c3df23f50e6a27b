"""Token sampling: greedy, temperature, top-k, top-p, with each request's random numbers keyed by position.

A sampled request draws the token at output position ``j`` by inverse CDF from a uniform that belongs
to ``j`` alone (:class:`PositionNoise`). Plain decoding and a verify step that keeps ``a`` drafts read
the same uniforms for the same positions, so with deterministic drafts (n-gram lookup, a tree's
candidates) the verify emits exactly the tokens plain decoding would have: a seeded sampled request
gives the same text with or without speculation, whatever length the controller picks, as greedy does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks tokens. ``temperature == 0`` is greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0; got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0; got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from: ``[..., V]`` logits -> probabilities (float32).

    Temperature first, then top-k, then top-p (the smallest set of tokens whose mass reaches
    ``top_p``, always keeping the most likely one).
    """
    x = logits.float() / max(params.temperature, 1e-6)
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each token
        sorted_p = sorted_p.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


class PositionNoise:
    """A sampled request's uniforms by output position (0: its first new token): position ``j`` has one
    for the token drawn there (:meth:`draws`) and one for an accept-or-reject coin (:meth:`coins`), the
    same however the request's steps split its positions and whatever else it drew (a draft model's own
    samples use the request's ``generator``, a separate stream). ``seed`` is mixed (splitmix64) before
    seeding, so a generator seeded with the same number is not the same stream."""

    BLOCK = 64  # positions drawn at a time

    def __init__(self, seed: int):
        self._gen = torch.Generator().manual_seed(_splitmix64(seed))
        self._pairs: list[list[float]] = []  # [draw, coin] per position

    def _fill(self, end: int) -> None:
        while len(self._pairs) < end:
            self._pairs += torch.rand(self.BLOCK, 2, dtype=torch.float64, generator=self._gen).tolist()

    def draws(self, start: int, count: int) -> list[float]:
        """The draw uniforms of positions ``start .. start + count - 1``."""
        self._fill(start + count)
        return [pair[0] for pair in self._pairs[start:start + count]]

    def coins(self, start: int, count: int) -> list[float]:
        """The coin uniforms of positions ``start .. start + count - 1``."""
        self._fill(start + count)
        return [pair[1] for pair in self._pairs[start:start + count]]


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def draw_token(weights: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from unnormalised ``weights [V]`` (>= 0, positive sum) with ``u ~ U[0, 1)``.

    Zero-weight tokens are never drawn: ``searchsorted(right=True)`` returns the first index
    whose cumulative weight exceeds ``u * total``, and a zero weight does not raise it.
    """
    cdf = weights.double().cumsum(0)  # [V]
    index = int(torch.searchsorted(cdf, cdf[-1:] * u, right=True))
    if index >= cdf.shape[0]:  # u * total rounded up to total: take the last token with weight
        index = int(torch.nonzero(weights).max())
    return index


def sample(logits: torch.Tensor, params: SamplingParams, noise: PositionNoise | None, position: int) -> int:
    """The token at output ``position`` from ``logits [V]``: the argmax, or the draw of the position's uniform."""
    if params.greedy:
        return int(torch.argmax(logits))
    assert noise is not None, "a sampled request needs its PositionNoise"
    return draw(logits, params, noise.draws(position, 1)[0])


def draw(logits: torch.Tensor, params: SamplingParams, u: float) -> int:
    """The token ``params`` draws from ``logits [V]`` with the uniform ``u`` (inverse CDF)."""
    return draw_token(probabilities(logits, params), u)


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """``log p(token)`` under the model's own distribution (softmax of the raw logits, before
    temperature or truncation) and the ``top`` most likely tokens with theirs."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logp.topk(min(top, logp.numel()))
    return float(logp[token]), list(zip(ids.tolist(), values.tolist()))
