"""Verify one sequence's draft against the target model: rejection sampling.

The target scores the last committed token and the ``k`` draft tokens in one forward
pass, giving ``k + 1`` next-token distributions ``p_0 .. p_k``; row ``i`` is the target's
distribution for the token after draft position ``i - 1`` (row 0: after the committed
text). These functions decide which draft tokens to keep and which token to add.

Glossary
--------
accepted tokens
    The longest prefix of the draft the target keeps.
recovered token
    The token emitted in place of the first rejected draft token: the target argmax
    (greedy) or a sample from the residual ``normalize(max(p_i - q_i, 0))`` (sampling).
bonus token
    When every draft token is accepted, one more token from ``p_k`` for free.
output
    ``accepted + [recovered or bonus]``: always ``1 .. k + 1`` tokens, so every
    verification step makes progress even with an empty or useless draft.

Sampling with a deterministic draft (n-gram lookup: a one-hot ``q``) draws each row's token
from ``p_i`` with position ``i``'s own uniform (:class:`~.sampling.PositionNoise`) and keeps draft
``x_i`` while the draw equals it: exactly the tokens plain decoding draws from the same uniforms,
and ``x_i`` is kept with probability ``p_i(x_i)``, as rejection sampling with a one-hot ``q`` keeps
it. A sampled draft (``x ~ q``) follows speculative sampling (Leviathan et al., arXiv 2211.17192,
Algorithm 1; Chen et al., arXiv 2302.01318, Algorithm 2): keep ``x`` with probability
``min(1, p(x) / q(x))`` (the position's coin); on rejection draw from the residual (the position's
draw uniform). Each emitted token is then distributed exactly as the target's ``p``, whatever ``q``
is; a good ``q`` only makes acceptance likelier.

All functions are pure: the uniforms come from the caller, so a request seeded the same way
replays the same tokens. Batched callers that need a fixed-width tensor pad with
:data:`PLACEHOLDER_TOKEN_ID` via :func:`pad_outputs`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .sampling import PositionNoise, SamplingParams, draw_token, probabilities

PLACEHOLDER_TOKEN_ID = -1  # fills the slots after a sequence's output in padded tensors

AcceptRule = Callable[[float, float], float]  # (p(x), q(x)) -> probability of keeping x


def accept_probability(p: float, q: float) -> float:
    """``min(1, p / q)``; a token the draft could not have produced (``q == 0``) is kept
    iff the target allows it (only reachable with a degenerate draft distribution)."""
    if q <= 0.0:
        return 1.0 if p > 0.0 else 0.0
    return min(1.0, p / q)


def verify_greedy(draft_tokens: list[int], target_logits: torch.Tensor) -> list[int]:
    """Keep the draft prefix that matches the target argmax, then add the target argmax.

    Parameters
    ----------
    draft_tokens : list[int]
        ``k`` drafted tokens (``k >= 0``).
    target_logits : Tensor
        ``[k + 1, V]`` target logits (or probabilities: only the argmax is used).

    Returns
    -------
    list[int]
        ``1 .. k + 1`` tokens.

    Example
    -------
    >>> logits = torch.eye(5)[[3, 1, 4]]  # target argmax per position: 3, 1, 4
    >>> verify_greedy([3, 1], logits), verify_greedy([3, 2], logits), verify_greedy([0, 1], logits)
    ([3, 1, 4], [3, 1], [3])
    """
    k = len(draft_tokens)
    assert target_logits.ndim == 2 and target_logits.shape[0] == k + 1, (
        f"target_logits must be [k + 1 = {k + 1}, V]; got {tuple(target_logits.shape)}"
    )
    return accept_matching(draft_tokens, target_logits.argmax(dim=-1).tolist().__getitem__)


def accept_matching(draft_tokens: list[int], target_token: Callable[[int], int]) -> list[int]:
    """Keep the draft while it equals the target's own token at each position (``target_token(i)``: the argmax,
    or the draw of position ``i``'s uniform, of row ``i``; asked only for the rows reached), then add the
    target's token where they differ, or the bonus after the last draft."""
    out: list[int] = []
    for i, draft in enumerate(draft_tokens):
        out.append(target_token(i))  # accepted draft (== target) or the recovered token
        if out[-1] != draft:
            return out
    out.append(target_token(len(draft_tokens)))  # bonus
    return out


def verify_sampling(
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    draws: list[float],
    coins: list[float],
    accept_rule: AcceptRule | None = None,
) -> list[int]:
    """Lossless sampled verification of one sequence's draft (see the module docstring).

    Parameters
    ----------
    draft_tokens : list[int]
        ``k`` drafted tokens, ``x_i ~ q_i``.
    draft_probs : Tensor or None
        ``[k, V]`` draft distributions ``q_i``; ``None``: deterministic draft (one-hot ``q``).
    target_probs : Tensor
        ``[k + 1, V]`` target distributions ``p_i`` (after temperature/top-k/top-p).
    draws, coins : list[float]
        The ``k + 1`` draw and ``k`` coin uniforms of the positions the rows decide (the only
        randomness; a deterministic draft reads no coin).
    accept_rule : callable, optional
        ``(p(x), q(x)) -> keep probability``: verify by rejection with this rule, also for a
        deterministic draft (default: :func:`accept_probability` for sampled drafts). Tests
        inject wrong rules here to check that the statistical test has power.

    Returns
    -------
    list[int]
        ``1 .. k + 1`` tokens; the ``i``-th is distributed as the target's conditional ``p_i``.

    Example
    -------
    >>> p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])  # the target is certain
    >>> verify_sampling([1], None, p, [0.3, 0.8], [0.5]), verify_sampling([0], None, p, [0.3, 0.8], [0.5])
    ([1, 2], [1])
    """
    k = len(draft_tokens)
    assert target_probs.ndim == 2 and target_probs.shape[0] == k + 1, (
        f"target_probs must be [k + 1 = {k + 1}, V]; got {tuple(target_probs.shape)}"
    )
    assert len(draws) >= k + 1 and len(coins) >= k, f"need {k + 1} draws and {k} coins"
    if draft_probs is None and accept_rule is None:  # the target's own draws decide (plain decoding's tokens)
        return accept_matching(draft_tokens, lambda i: draw_token(target_probs[i], draws[i]))
    if draft_probs is not None:
        assert draft_probs.shape == (k, target_probs.shape[1]), (
            f"draft_probs must be [k = {k}, V = {target_probs.shape[1]}]; got {tuple(draft_probs.shape)}"
        )
    rule = accept_probability if accept_rule is None else accept_rule
    if k:
        index = torch.tensor(draft_tokens, device=target_probs.device).view(k, 1)  # [k, 1]
        p_draft = target_probs[:k].gather(1, index).view(k).tolist()  # [k] p_i(x_i)
        q_draft = [1.0] * k if draft_probs is None else draft_probs.gather(1, index).view(k).tolist()
    for i in range(k):
        if coins[i] < rule(p_draft[i], q_draft[i]):
            continue  # accepted
        p = target_probs[i]  # [V]
        if draft_probs is None:
            residual = p.clone()  # max(p - onehot(x), 0) = p with x removed
            residual[draft_tokens[i]] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_(min=0.0)
        # An all-zero residual means p <= q everywhere, i.e. p == q up to rounding:
        # rejection then has probability ~0, and p itself is the right distribution.
        recovered = draw_token(residual, draws[i]) if float(residual.sum()) > 0.0 else draw_token(p, draws[i])
        return draft_tokens[:i] + [recovered]
    return draft_tokens + [draw_token(target_probs[k], draws[k])]  # all accepted + bonus


def verify(
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: SamplingParams,
    noise: PositionNoise | None,
    position: int,
) -> list[int]:
    """Greedy or sampled verification of ``target_logits [k + 1, V]``, as ``params`` asks; the rows
    decide output positions ``position .. position + k`` (``noise`` may be ``None`` only when greedy).

    ``draft_probs [k, V]`` must come from the same ``params`` for the sampled case to be
    efficient (any ``q`` is *correct*).
    """
    if params.greedy:
        return verify_greedy(draft_tokens, target_logits)
    assert noise is not None, "sampled verification needs the request's PositionNoise"
    k = len(draft_tokens)
    return verify_sampling(draft_tokens, draft_probs, probabilities(target_logits, params),
                           noise.draws(position, k + 1), noise.coins(position, k))


def pad_outputs(outputs: list[list[int]], width: int) -> torch.Tensor:
    """``[B, width]`` int64 tensor of per-sequence outputs, padded with ``PLACEHOLDER_TOKEN_ID``."""
    padded = torch.full((len(outputs), width), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)  # [B, width]
    for row, tokens in enumerate(outputs):
        assert len(tokens) <= width, f"output of {len(tokens)} tokens does not fit width {width}"
        padded[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    return padded
