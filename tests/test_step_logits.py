"""A step's logits as the host reads them (runtime/step_logits.py): each row's target token is its own argmax
(ties and NaNs included) or its own draw, made only when read on the CPU; from a device only the tokens come
back, and whole rows exactly for the requests that read them."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from specgraph.runtime.proposers.base import Draft
from specgraph.runtime.sampling import PositionNoise, SamplingParams, draw_token, probabilities
import specgraph.runtime.step_logits as step_logits
from specgraph.runtime.step_logits import (RowsWanted, device_draws, fetch_rows, host_rows, row_argmax,
                                           rows_from_device, rows_wanted)

GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)
KINDS = (GREEDY, SAMPLED, SamplingParams(temperature=1.3, top_k=5))  # sequences drawn together by their sampling
SPANS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.booleans()), min_size=1, max_size=5)


def _step(spans, vocab, dtype, seed, nan):
    """Random logits with few distinct values (many ties) and each sequence's RowsWanted."""
    g = torch.Generator().manual_seed(seed)
    wanted = [RowsWanted(n, KINDS[kind], torch.rand(n, generator=g).tolist() if kind else [], whole)
              for n, kind, whole in spans]
    logits = torch.randint(-2, 3, (sum(w.count for w in wanted), vocab), generator=g).to(dtype)
    if nan and logits.numel():
        logits.view(-1)[torch.randint(logits.numel(), (1,), generator=g)] = float("nan")
    return logits, wanted


def _expected(row: torch.Tensor, w: RowsWanted, m: int) -> int:
    return int(torch.argmax(row)) if w.params.greedy else draw_token(probabilities(row, w.params), w.uniforms[m])


@settings(max_examples=60, deadline=None)
@given(SPANS, st.integers(1, 40), st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       st.integers(0, 2**31 - 1), st.booleans())
def test_each_rows_token_is_its_own_argmax_or_draw(spans, vocab, dtype, seed, nan):
    logits, wanted = _step(spans, vocab, dtype, seed, nan)
    if nan and any(not w.params.greedy for w in wanted):
        logits = torch.nan_to_num(logits)  # (a NaN row has no distribution to draw from)
    draws = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(step_logits, "draw", lambda *a: draws.append(a) or draw_token(probabilities(a[0], a[1]), a[2]))
        targets = host_rows(logits, wanted)
        assert draws == []  # on the CPU a sampled row is drawn when read, not before
        at = 0
        for w, target in zip(wanted, targets):
            mine = logits[at:at + w.count]
            assert len(target) == w.count
            assert [target.token(m) for m in range(w.count)] == [_expected(row, w, m) for m, row in enumerate(mine)]
            at += w.count


@settings(max_examples=40, deadline=None)
@given(SPANS, st.integers(1, 40), st.integers(0, 2**31 - 1))
def test_from_a_device_only_tokens_come_back_but_for_whole_rows(spans, vocab, seed):
    """The device path, run on CPU tensors: the same tokens, and rows only where a request wants them whole."""
    logits, wanted = _step(spans, vocab, torch.float32, seed, False)
    starts = [0]
    for w in wanted:
        starts.append(starts[-1] + w.count)
    for i, (w, target) in enumerate(zip(wanted, rows_from_device(logits, wanted, starts))):
        mine = logits[starts[i]:starts[i + 1]]
        assert [target.token(m) for m in range(w.count)] == [_expected(row, w, m) for m, row in enumerate(mine)]
        if w.whole and w.count:
            assert torch.equal(target.whole(), mine)
        else:
            assert target.logits is None


def test_a_row_the_device_cannot_draw_from_is_drawn_again_on_the_host():
    logits = torch.tensor([[0.0, float("nan"), 1.0]])  # no finite CDF
    w = RowsWanted(1, SamplingParams(temperature=1.0), [0.5])
    assert int(device_draws(logits, w.params, w.uniforms)[0]) == 3  # past the end: the host draws
    (target,) = rows_from_device(logits, [w], [0, 1])
    assert target.token(0) == draw_token(probabilities(logits[0], w.params), 0.5)
    assert torch.equal(target.whole().nan_to_num(), logits.nan_to_num())


def test_rows_fetched_from_a_device_are_the_picked_sequences_in_order():
    logits = torch.arange(7 * 3, dtype=torch.float32).view(7, 3)
    rows = fetch_rows(logits, [0, 2, 2, 5, 7], [0, 3])  # four sequences: 2, 0, 3 and 2 rows
    assert sorted(rows) == [0, 3]
    assert torch.equal(rows[0], logits[0:2]) and torch.equal(rows[3], logits[5:7])


def test_the_numpy_argmax_takes_the_first_of_equal_maxima_as_torch_does():
    x = torch.tensor([[1.0, 3.0, 3.0], [float("nan"), 2.0, float("nan")], [0.0, 0.0, 0.0], [-1.0, float("inf"), 5.0]])
    assert row_argmax(x) == x.argmax(dim=-1).tolist() == [1, 0, 0, 1]


class _Request:
    def __init__(self, params, logprobs=None, outputs=3):
        self.params, self.logprobs, self.output_ids = params, logprobs, [0] * outputs
        self.noise = PositionNoise(7) if not params.greedy else None


def test_a_row_reads_the_uniform_of_the_output_position_its_node_decides():
    r = _Request(SAMPLED)
    draws = PositionNoise(7).draws(3, 4)
    assert rows_wanted(r, None, 1).uniforms == draws[:1]
    assert rows_wanted(r, Draft([5, 6, 7]), 4).uniforms == draws[:4]
    tree = Draft([5, 6, 7], parents=[-1, -1, 0])  # depths: root 0, nodes 1 and 2 at 1, node 3 at 2
    assert rows_wanted(r, tree, 4).uniforms == [draws[0], draws[1], draws[1], draws[2]]
    assert rows_wanted(_Request(GREEDY), tree, 4).uniforms == []


def test_only_logprobs_or_a_sampled_drafts_rejection_wants_whole_rows():
    q = torch.full((2, 5), 0.2)
    assert not rows_wanted(_Request(GREEDY), Draft([1, 2], probs=q), 3).whole
    assert not rows_wanted(_Request(SAMPLED), Draft([1, 2]), 3).whole  # a deterministic draft: tokens decide
    assert rows_wanted(_Request(SAMPLED), Draft([1, 2], probs=q), 3).whole
    assert rows_wanted(_Request(GREEDY, logprobs=2), None, 1).whole


def test_rows_not_brought_to_the_host_are_refused_by_name():
    logits = torch.zeros(1, 4)
    w = RowsWanted(1, GREEDY)
    (target,) = rows_from_device(logits, [w], [0, 1])
    with pytest.raises(RuntimeError, match="not brought to the host"):
        target.whole()


def test_the_step_logits_benchmark_runs_and_its_two_paths_agree(capsys):
    """benchmarks/bench_step_logits.py asserts that the old path and step_logits pick the same tokens."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_step_logits

    assert bench_step_logits.main(["--vocab", "64", "--ks", "0,2", "--repeats", "3"]) == 0
    assert "step_logits (us)" in capsys.readouterr().out
