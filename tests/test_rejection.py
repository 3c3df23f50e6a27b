"""Rejection sampling: greedy tables, and emitted tokens distributed as the target's p.

The distribution tests need no model. The target table ``p [k + 1, V]`` is fixed per
position (it does not depend on the drafted prefix), so the ``i``-th emitted token of a
verification must be distributed exactly as ``p_i``, conditioned on the output being at
least ``i + 1`` long (that event depends only on earlier positions' coins and drafts,
which are independent of position ``i``'s). Each check is a chi-square goodness-of-fit
test; a correct sampler fails one with probability ``ALPHA`` (seeds are fixed, so the
suite is deterministic), and the same test must reject deliberately wrong accept rules.
"""

import pytest
import torch

from specgraph.runtime.rejection import (
    PLACEHOLDER_TOKEN_ID,
    accept_probability,
    pad_outputs,
    verify,
    verify_greedy,
    verify_sampling,
)
from specgraph.runtime.sampling import PositionNoise, SamplingParams, draw_token, probabilities, sample

ALPHA = 1e-4  # a correct sampler passes each goodness-of-fit test with probability 1 - ALPHA
V = 6
K = 2


def logits_for(argmaxes: list[int], vocab: int = 5) -> torch.Tensor:
    """``[len(argmaxes), vocab]`` logits whose row-wise argmax is ``argmaxes``."""
    return torch.randn(len(argmaxes), vocab, generator=torch.Generator().manual_seed(1)) * 0.1 + 5 * torch.eye(
        vocab
    )[argmaxes]


# ----------------------------------------------------------------------------- greedy tables


@pytest.mark.parametrize(
    "draft, target_argmax, expected",
    [
        ([], [2], [2]),  # no draft: a plain decode step
        ([3, 1, 4], [3, 1, 4, 0], [3, 1, 4, 0]),  # all accepted: k + 1 tokens, bonus last
        ([2, 1, 4], [3, 1, 4, 0], [3]),  # first rejected: only the target's token
        ([3, 1, 2], [3, 1, 4, 0], [3, 1, 4]),  # mismatch at the end: recovered = target argmax
        ([3, 2, 4], [3, 1, 4, 0], [3, 1]),  # mismatch in the middle: later matches don't count
        ([0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]),  # repeated tokens
    ],
)
def test_verify_greedy_table(draft, target_argmax, expected):
    assert verify_greedy(draft, logits_for(target_argmax)) == expected


def test_verify_greedy_checks_shapes():
    with pytest.raises(AssertionError, match="k \\+ 1"):
        verify_greedy([1, 2], torch.zeros(2, 5))


def test_verify_dispatches_on_params():
    logits = logits_for([3, 1, 4, 0])
    assert verify([3, 2, 4], None, logits, SamplingParams(temperature=0.0), None, 0) == [3, 1]
    # Near-zero temperature: the target is (numerically) certain, so sampling == greedy.
    g = PositionNoise(0)
    assert verify([3, 1, 4], None, logits, SamplingParams(temperature=1e-3), g, 0) == [3, 1, 4, 0]
    assert verify([3, 2, 4], None, logits, SamplingParams(temperature=1e-3), g, 4) == [3, 1]
    assert verify([3, 1, 4], None, logits, SamplingParams(temperature=1.0, top_k=1), g, 8) == [3, 1, 4, 0]


def test_pad_outputs_uses_placeholder():
    padded = pad_outputs([[5], [1, 2, 3], []], width=3)
    assert padded.tolist() == [[5, -1, -1], [1, 2, 3], [-1, -1, -1]]
    assert PLACEHOLDER_TOKEN_ID == -1


# ----------------------------------------------------------------------------- sampling basics


def test_accept_probability():
    assert accept_probability(0.2, 0.4) == pytest.approx(0.5)
    assert accept_probability(0.5, 0.25) == 1.0
    assert accept_probability(0.0, 0.3) == 0.0
    assert accept_probability(0.1, 0.0) == 1.0 and accept_probability(0.0, 0.0) == 0.0


def test_certain_target():
    p = torch.eye(4)[[1, 2, 3]]  # [3, 4]: the target always wants 1, 2, 3
    g = torch.Generator().manual_seed(0)
    q = torch.full((2, 4), 0.25)
    assert verify_sampling([1, 2], q, p, *uniforms(g, 2)) == [1, 2, 3]
    assert verify_sampling([1, 0], q, p, *uniforms(g, 2)) == [1, 2]  # p(0) == 0: always rejected
    assert verify_sampling([0, 2], None, p, *uniforms(g, 2)) == [1]
    assert verify_sampling([], None, p[:1], *uniforms(g, 0)) == [1]


def uniforms(g: torch.Generator, k: int) -> tuple[list[float], list[float]]:
    """Fresh draw and coin uniforms for a verify of ``k`` drafts (``k + 1`` positions)."""
    u = torch.rand(2, k + 1, dtype=torch.float64, generator=g).tolist()
    return u[0], u[1][:k]


def test_same_seed_same_outputs_and_no_global_rng():
    p = torch.softmax(torch.randn(K + 1, V, generator=torch.Generator().manual_seed(3)), -1)
    q = torch.softmax(torch.randn(K, V, generator=torch.Generator().manual_seed(4)), -1)
    drafts = torch.multinomial(q, 200, replacement=True, generator=torch.Generator().manual_seed(5)).T.tolist()

    def run(seed: int, global_seed: int) -> list[list[int]]:
        torch.manual_seed(global_seed)  # the global RNG must not matter
        noise = PositionNoise(seed)
        return [verify_sampling(d, q, p, noise.draws(3 * i, K + 1), noise.coins(3 * i, K)) for i, d in enumerate(drafts)]

    first = run(0, 0)
    assert run(0, 123) == first
    assert run(1, 0) != first
    assert {len(out) for out in first} == {1, 2, 3}


def test_position_noise_is_keyed_by_position_and_not_the_generators_stream():
    a, b = PositionNoise(7), PositionNoise(7)
    assert a.draws(0, 3) + a.draws(3, 200) == b.draws(0, 203)  # however the positions are asked for
    assert a.coins(5, 2) == b.coins(5, 2) and a.draws(0, 4) != a.coins(0, 4)
    same_seed = torch.rand(4, dtype=torch.float64, generator=torch.Generator().manual_seed(7)).tolist()
    assert a.draws(0, 4) != same_seed and PositionNoise(8).draws(0, 4) != a.draws(0, 4)


def test_deterministic_drafts_emit_plain_sampling_tokens():
    """With a one-hot draft, a verify emits exactly what plain decoding draws at the same positions from the
    same uniforms: whatever was drafted, the tokens do not change, only how many come per forward."""
    g = torch.Generator().manual_seed(11)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    for trial in range(300):
        logits = torch.randn(K + 1, V, generator=g) * 2
        noise, start = PositionNoise(trial), trial % 5
        plain = [sample(logits[i], params, noise, start + i) for i in range(K + 1)]
        draft = plain[:K] if trial % 3 == 0 else torch.randint(0, V, (K,), generator=g).tolist()
        out = verify(draft, None, logits, params, noise, start)
        assert out == plain[:len(out)]
        agree = next((i for i in range(K) if draft[i] != plain[i]), K)
        assert len(out) == agree + 1


def test_draw_token_follows_the_weights():
    w = random_probs(1, 21, zeros=2)[0] * 3.0  # unnormalised, with zeros
    g = torch.Generator().manual_seed(22)
    draws = [draw_token(w, u) for u in torch.rand(12_000, dtype=torch.float64, generator=g).tolist()]
    assert chi2_pvalue(draws, w / w.sum()) > ALPHA
    assert draw_token(torch.tensor([0.0, 2.0, 0.0]), 0.999999999) == 1


# ----------------------------------------------------------------------------- distributions


def chi2_pvalue(samples: list[int], probs: torch.Tensor) -> float:
    """Goodness-of-fit p-value of ``samples`` against ``probs [V]``; tokens with ``p == 0``
    must never appear (p-value 0 otherwise)."""
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    probs = probs.double()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = counts.sum() * probs[support]
    assert expected.min() >= 5, "too few samples for the chi-square approximation"
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def random_probs(rows: int, seed: int, zeros: int = 0) -> torch.Tensor:
    """``[rows, V]`` random distributions bounded away from 0, with ``zeros`` entries per row set to 0."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(rows, V, generator=g) + 0.1
    if zeros:
        drop = torch.rand(rows, V, generator=g).argsort(dim=-1)[:, :zeros]
        w.scatter_(1, drop, 0.0)
    return w / w.sum(-1, keepdim=True)


def emitted_pvalues(p, q, draft_source, trials, seed, accept_rule=None) -> list[float]:
    """Run ``trials`` verifications with drafts ``x_i ~ draft_source_i`` and target ``p``;
    return the chi-square p-value of every output position against ``p_i``.

    ``q`` is what the verifier is told (``None``: one-hot, deterministic proposal);
    ``draft_source`` is where the draft tokens actually come from.
    """
    drafts = torch.multinomial(draft_source, trials, replacement=True, generator=torch.Generator().manual_seed(seed))
    drafts = drafts.T.tolist()  # [trials, K]
    g = torch.Generator().manual_seed(seed + 1)
    outputs = [verify_sampling(d, q, p, *uniforms(g, K), accept_rule=accept_rule) for d in drafts]
    return [chi2_pvalue([out[i] for out in outputs if len(out) > i], p[i]) for i in range(K + 1)]


CASES = {
    # name: (target p [K + 1, V], draft q [K, V] told to the verifier, where drafts come from)
    "random_q": (random_probs(K + 1, 10), random_probs(K, 11), random_probs(K, 11)),
    # deterministic proposal (n-gram): q is one-hot on whatever token was drafted
    "one_hot": (random_probs(K + 1, 12), None, random_probs(K, 13)),
    # top-k-like target with zeros the draft does not know about, and a draft with zeros
    "zeros": (random_probs(K + 1, 14, zeros=2), random_probs(K, 15, zeros=2), random_probs(K, 15, zeros=2)),
    # q == p: every draft is accepted, the residual would be all zero
    "q_equals_p": (random_probs(K + 1, 16), random_probs(K + 1, 16)[:K], random_probs(K + 1, 16)[:K]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_emitted_tokens_follow_target(case):
    p, q, source = CASES[case]
    pvalues = emitted_pvalues(p, q, source, trials=12_000, seed=100)
    assert min(pvalues) > ALPHA, pvalues


WRONG_RULES = {
    "always_accept": lambda p, q: 1.0,
    "inverted_ratio": lambda p, q: min(1.0, q / p) if p > 0 else 1.0,
    "accept_by_p": lambda p, q: p,  # the one-hot rule applied to a sampled draft
}


@pytest.mark.parametrize("rule", list(WRONG_RULES))
def test_wrong_accept_rules_fail_the_same_test(rule):
    p, q, source = CASES["random_q"]
    pvalues = emitted_pvalues(p, q, source, trials=6_000, seed=200, accept_rule=WRONG_RULES[rule])
    assert min(pvalues) < ALPHA, pvalues


def test_wrong_residual_fails_the_same_test():
    # Telling the verifier q is one-hot while drafts are sampled with a known q is still
    # correct (any deterministic x works); telling it the wrong q is not.
    p, q, source = CASES["random_q"]
    wrong_q = random_probs(K, 99)
    pvalues = emitted_pvalues(p, wrong_q, source, trials=6_000, seed=300)
    assert min(pvalues) < ALPHA, pvalues
    pvalues = emitted_pvalues(p, None, source, trials=6_000, seed=300)
    assert min(pvalues) > ALPHA, pvalues


def test_verify_samples_from_processed_target():
    # verify() applies temperature/top-k before sampling: tokens outside the top-2 never appear.
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(7))
    params = SamplingParams(temperature=0.7, top_k=2)
    target = probabilities(logits, params)
    noise = PositionNoise(8)
    outputs = [verify([t], None, logits, params, noise, 2 * i) for i, t in enumerate(t for t in range(V) for _ in range(100))]
    first = [out[0] for out in outputs]
    assert chi2_pvalue(first, target[0]) > ALPHA
