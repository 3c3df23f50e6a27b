import random
import time

import pytest
import torch

from specgraph.runtime.proposers.base import Draft, DraftRequest, Proposer
from specgraph.runtime.proposers.ngram import NgramProposer
from specgraph.runtime.sampling import SamplingParams


def draft(tokens: list[int], k: int, **kwargs) -> list[int]:
    (out,) = NgramProposer(**kwargs).propose([DraftRequest(0, tokens, num_prompt_tokens=len(tokens), k=k)])
    assert out.probs is None  # deterministic proposal
    return out.token_ids


def reference(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Brute force: longest n first, then the latest earlier start."""
    length = len(tokens)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_is_a_proposer():
    p = NgramProposer()
    assert isinstance(p, Proposer)
    assert p.name == "ngram:3"
    p.on_verified(0, 3)  # a no-op: the next propose indexes the new tokens
    p.release(0)
    # a sampling request: the deterministic proposal ignores params and generator
    request = DraftRequest(0, [1, 2, 1], 3, 2, SamplingParams(temperature=0.8), torch.Generator())
    assert p.propose([request]) == [Draft([2, 1], evidence=1)]  # matched the 1-gram [1]


def test_worked_example():
    # [4, 1, 2] never occurred before; [1, 2] did at position 0, followed by 3, 4, 1.
    assert draft([1, 2, 3, 4, 1, 2], k=3) == [3, 4, 1]


def test_no_match_gives_empty_draft():
    assert draft([1, 2, 3], k=4) == []
    assert draft([], k=4) == []
    assert draft([7], k=4) == []
    assert draft([1, 2, 1], k=0) == []  # nothing wanted


def test_k_truncates_and_end_of_sequence_truncates():
    assert draft([5, 6, 7, 8, 5], k=2) == [6, 7]
    assert draft([5, 6, 7, 5], k=5) == [6, 7, 5]  # only 3 tokens follow the match
    assert draft([1, 1, 1], k=4) == [1]  # [1, 1] at 0 overlaps the suffix; one token follows it


def test_prefers_longest_ngram():
    tokens = [1, 2, 3, 10, 11, 3, 20, 1, 2, 3]
    assert draft(tokens, k=2, max_ngram=3) == [10, 11]  # [1, 2, 3] matches at 0
    assert draft(tokens, k=2, max_ngram=1) == [20, 1]  # [3] matches most recently at 5


def test_prefers_most_recent_match():
    assert draft([1, 2, 7, 1, 2, 8, 1, 2], k=3) == [8, 1, 2]


def test_min_ngram():
    tokens = [4, 9, 5, 9]  # only the 1-gram [9] occurred before
    assert draft(tokens, k=2, min_ngram=1) == [5, 9]
    assert draft(tokens, k=2, min_ngram=2) == []


def test_batch_keeps_request_order():
    requests = [
        DraftRequest(7, [1, 2, 1], num_prompt_tokens=2, k=2),
        DraftRequest(3, [1, 2, 3], num_prompt_tokens=3, k=2),
        DraftRequest(5, [9, 8, 9], num_prompt_tokens=1, k=1),
    ]
    assert NgramProposer().propose(requests) == [Draft([2, 1], evidence=1), Draft([]), Draft([8], evidence=1)]


@pytest.mark.parametrize("max_ngram, min_ngram", [(1, 1), (3, 1), (4, 2)])
def test_matches_brute_force(max_ngram, min_ngram):
    rng = random.Random(max_ngram * 10 + min_ngram)
    proposer = NgramProposer(max_ngram=max_ngram, min_ngram=min_ngram)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 25))]
        k = rng.randrange(0, 6)
        assert proposer.lookup(tokens, k) == reference(tokens, k, max_ngram, min_ngram), (tokens, k)


@pytest.mark.parametrize("max_ngram, min_ngram", [(1, 1), (3, 1), (4, 2)])
def test_a_kept_index_drafts_as_a_fresh_scan_while_the_sequence_grows(max_ngram, min_ngram):
    """The per-request index, extended step by step (one token or an accepted run at a time), drafts what
    the brute force does on the whole sequence; a sequence that does not continue the indexed one (a
    reused id) is re-indexed, and ``release`` forgets it."""
    rng = random.Random(max_ngram * 7 + min_ngram)
    proposer = NgramProposer(max_ngram=max_ngram, min_ngram=min_ngram)
    for rid in range(20):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 6))]
        for _ in range(30):
            k = rng.randrange(0, 5)
            (out,) = proposer.propose([DraftRequest(rid % 3, tokens, num_prompt_tokens=1, k=k)])
            assert out.token_ids == reference(tokens, k, max_ngram, min_ngram), (tokens, k)
            tokens = tokens + [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
        if rid % 2:
            proposer.release(rid % 3)
    assert set(proposer._indexes) <= {0, 1, 2}


def test_long_context():
    rng = random.Random(0)
    tokens = [rng.randrange(30_000) for _ in range(4000)]
    tokens += tokens[1000:1010]  # the output copies a span of the prompt
    proposer = NgramProposer(max_ngram=4)
    start = time.perf_counter()
    for _ in range(50):
        (out,) = proposer.propose([DraftRequest(0, tokens, num_prompt_tokens=4000, k=5)])
    elapsed = time.perf_counter() - start
    assert out.token_ids == tokens[1010:1015]
    print(f"ngram lookup over {len(tokens)} tokens: {elapsed / 50 * 1e6:.0f} us")  # not asserted


@pytest.mark.parametrize("spec, max_ngram", [("ngram", 3), ("ngram:5", 5), ("ngram:1", 1), (" ngram:2 ", 2)])
def test_from_spec(spec, max_ngram):
    p = NgramProposer.from_spec(spec)
    assert p.max_ngram == max_ngram and p.min_ngram == 1
    assert NgramProposer.from_spec(p.name).max_ngram == max_ngram


@pytest.mark.parametrize("spec", ["", "eagle", "ngram:", "ngram:0", "ngram:-1", "ngram:x", "ngram:2:1", "NGRAM"])
def test_from_spec_rejects_bad_specs(spec):
    with pytest.raises(ValueError, match="'ngram:N'"):
        NgramProposer.from_spec(spec)


def test_bad_sizes():
    with pytest.raises(ValueError):
        NgramProposer(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError):
        NgramProposer(max_ngram=0, min_ngram=0)


def test_a_draft_carries_the_length_of_the_suffix_it_matched():
    p = NgramProposer(max_ngram=3)
    seq = [5, 6, 7, 8, 1, 6, 7, 9, 6, 7]  # [6, 7] occurred before (twice), [9, 6, 7] did not
    assert p.longest_match(seq) == (6, 2)  # the most recent earlier [6, 7] ends at 6, followed by 9
    assert p.propose([DraftRequest(0, seq, 2, 3)]) == [Draft([9, 6, 7], evidence=2)]
    assert p.propose([DraftRequest(0, [1, 2, 3, 1, 2, 3], 2, 2)])[0].evidence == 3
    assert p.longest_match([1, 2, 3]) is None and p.propose([DraftRequest(0, [1, 2, 3], 2, 2)]) == [Draft([])]
