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

Sampling follows speculative sampling (Leviathan et al., arXiv 2211.17192, Algorithm 1;
Chen et al., arXiv 2302.01318, Algorithm 2): keep draft token ``x ~ q`` with probability
``min(1, p(x) / q(x))``; on rejection draw from the residual. Each emitted token is then
distributed exactly as the target's ``p``, whatever ``q`` is; a good ``q`` only makes
acceptance likelier. A deterministic proposal (n-gram lookup) is the one-hot ``q``: keep
``x`` with probability ``p(x)``, otherwise draw from ``p`` with ``x`` removed.

All functions are pure: the only state they touch is the caller's ``torch.Generator``,
so a request seeded the same way replays the same tokens. Batched callers that need a
fixed-width tensor pad with :data:`PLACEHOLDER_TOKEN_ID` via :func:`pad_outputs`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .sampling import SamplingParams, probabilities

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
    target_ids = target_logits.argmax(dim=-1).tolist()  # [k + 1]
    out: list[int] = []
    for draft, target in zip(draft_tokens, target_ids):
        out.append(target)  # accepted draft (== target) or the recovered token
        if draft != target:
            return out
    out.append(target_ids[k])  # bonus
    return out


def verify_sampling(
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator,
    accept_rule: AcceptRule | None = None,
) -> list[int]:
    """Speculative sampling of one sequence's draft (arXiv 2211.17192, 2302.01318).

    Parameters
    ----------
    draft_tokens : list[int]
        ``k`` drafted tokens, ``x_i ~ q_i``.
    draft_probs : Tensor or None
        ``[k, V]`` draft distributions ``q_i``; ``None``: deterministic draft (one-hot ``q``).
    target_probs : Tensor
        ``[k + 1, V]`` target distributions ``p_i`` (after temperature/top-k/top-p).
    generator : torch.Generator
        The only source of randomness: exactly ``k + 1`` uniforms are drawn from it per
        call, whatever the outcome. It may live on another device than ``target_probs``
        (e.g. a per-request CPU generator with CUDA probabilities).
    accept_rule : callable, optional
        ``(p(x), q(x)) -> keep probability``; default :func:`accept_probability`.
        Tests inject wrong rules here to check that the statistical test has power.

    Returns
    -------
    list[int]
        ``1 .. k + 1`` tokens; the ``i``-th is distributed as ``p_i`` when the target rows
        do not depend on the drafted prefix (and in general, as the target's conditional).

    Example
    -------
    >>> p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])  # the target is certain
    >>> verify_sampling([1], None, p, torch.Generator().manual_seed(0))
    [1, 2]
    >>> verify_sampling([0], None, p, torch.Generator().manual_seed(0))
    [1]
    """
    k = len(draft_tokens)
    assert target_probs.ndim == 2 and target_probs.shape[0] == k + 1, (
        f"target_probs must be [k + 1 = {k + 1}, V]; got {tuple(target_probs.shape)}"
    )
    if draft_probs is not None:
        assert draft_probs.shape == (k, target_probs.shape[1]), (
            f"draft_probs must be [k = {k}, V = {target_probs.shape[1]}]; got {tuple(draft_probs.shape)}"
        )
    rule = accept_probability if accept_rule is None else accept_rule
    # k + 1 uniforms, always: k accept/reject coins + 1 for the recovered or bonus draw, so
    # the generator advances by the same amount whatever the outcome.
    uniforms = torch.rand(k + 1, dtype=torch.float64, generator=generator, device=generator.device).tolist()
    if k:
        index = torch.tensor(draft_tokens, device=target_probs.device).view(k, 1)  # [k, 1]
        p_draft = target_probs[:k].gather(1, index).view(k).tolist()  # [k] p_i(x_i)
        q_draft = [1.0] * k if draft_probs is None else draft_probs.gather(1, index).view(k).tolist()
    for i in range(k):
        if uniforms[i] < rule(p_draft[i], q_draft[i]):
            continue  # accepted
        p = target_probs[i]  # [V]
        if draft_probs is None:
            residual = p.clone()  # max(p - onehot(x), 0) = p with x removed
            residual[draft_tokens[i]] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_(min=0.0)
        # An all-zero residual means p <= q everywhere, i.e. p == q up to rounding:
        # rejection then has probability ~0, and p itself is the right distribution.
        recovered = _draw(residual, uniforms[k]) if float(residual.sum()) > 0.0 else _draw(p, uniforms[k])
        return draft_tokens[:i] + [recovered]
    return draft_tokens + [_draw(target_probs[k], uniforms[k])]  # all accepted + bonus


def verify(
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> list[int]:
    """Greedy or sampled verification of ``target_logits [k + 1, V]``, as ``params`` asks.

    ``draft_probs [k, V]`` must come from the same ``params`` for the sampled case to be
    efficient (any ``q`` is *correct*). ``generator`` may be ``None`` only when greedy.
    """
    if params.greedy:
        return verify_greedy(draft_tokens, target_logits)
    assert generator is not None, "sampled verification needs a generator"
    return verify_sampling(draft_tokens, draft_probs, probabilities(target_logits, params), generator)


def pad_outputs(outputs: list[list[int]], width: int) -> torch.Tensor:
    """``[B, width]`` int64 tensor of per-sequence outputs, padded with ``PLACEHOLDER_TOKEN_ID``."""
    padded = torch.full((len(outputs), width), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)  # [B, width]
    for row, tokens in enumerate(outputs):
        assert len(tokens) <= width, f"output of {len(tokens)} tokens does not fit width {width}"
        padded[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    return padded


def _draw(weights: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from unnormalised ``weights [V]`` (>= 0, positive sum) with ``u ~ U[0, 1)``.

    Zero-weight tokens are never drawn: ``searchsorted(right=True)`` returns the first index
    whose cumulative weight exceeds ``u * total``, and a zero weight does not raise it.
    """
    cdf = weights.double().cumsum(0)  # [V]
    index = int(torch.searchsorted(cdf, cdf[-1:] * u, right=True))
    if index >= cdf.shape[0]:  # u * total rounded up to total: take the last token with weight
        index = int(torch.nonzero(weights).max())
    return index
