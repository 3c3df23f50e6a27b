"""The speculation controller: its acceptance estimate, that its plan is the best one (brute force), that
it turns speculation off when drafts lose and on when they win, and that outputs never depend on what it
chooses. (Its forward cost table: test_forward_cost.py.)"""
import itertools
import random

import pytest
from hypothesis import given, settings, strategies as st

import specgraph
from specgraph.runtime.controller import Acceptance, SpeculationController
from specgraph.runtime.draining import finish_seconds
from specgraph.runtime.forward_cost import ForwardCost
from specgraph.runtime.proposers import Draft
from models import make_family, random_prompts


def test_planning_tries_a_verify_the_table_may_have_made_too_dear():
    """Drafts kept 30% of the time add 0.42 tokens for 3: not worth a verify the table reads 1.5x a decode,
    worth one read 15% cheaper (no step has corrected that size yet); the steps then settle it."""
    def planned(verify_seconds: float | None) -> list[int]:
        ctl = SpeculationController(3, ForwardCost({1: 1.0, 2: 1.5, 4: 1.5, 8: 3.0}), probe_budget=None)
        ctl.record(7).acceptance = Acceptance([30.0, 9.0, 2.7], [100.0, 30.0, 9.0])
        plans = [ctl.plan([7], [3], 0)]
        for _ in range(5):  # plain decode steps correct their own size
            ctl.observe_forward(1, 1.0)
        plans.append(ctl.plan([7], [3], 0))
        if verify_seconds is not None:
            for _ in range(5):  # (3, between two corrected sizes, is known from them)
                for n in (1, 2, 4):
                    ctl.observe_forward(n, verify_seconds if n > 1 else 1.0)
            plans.append(ctl.plan([7], [3], 0))
        return plans

    assert planned(None) == [[0], [3]]  # uncorrected: every size alike, then the verify reads 1.275x
    assert planned(1.5) == [[0], [3], [0]]  # it costs what the table said: back to plain decoding
    assert planned(1.2) == [[0], [3], [3]]  # it costs less: speculation stays


def test_acceptance_counts_positions_up_to_the_first_miss():
    acc = Acceptance.prior(3, rate=0.5, weight=0.0, decay=1.0)
    acc.update(drafted=3, accepted=1)  # draft 1 kept, draft 2 missed, draft 3 never tested
    assert acc.rates() == [1.0, 0.0, 0.0] and acc.tries[2] == 0.0  # untested: like the one before
    acc.update(drafted=3, accepted=3)
    assert acc.rates() == [1.0, 0.5, 1.0]
    assert acc.expected_tokens(0) == 1.0
    assert acc.expected_tokens(2) == pytest.approx(1 + 1.0 + 0.5)
    assert acc.gains(3) == pytest.approx([1.0, 0.5, 0.5])
    leaning = Acceptance.prior(3, rate=0.5, weight=1.0, decay=1.0)
    leaning.update(drafted=1, accepted=1)
    assert leaning.rates() == pytest.approx([0.75, 0.75, 0.75])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.floats(0.0, 1.0), min_size=3, max_size=3), min_size=1, max_size=3),
       st.lists(st.floats(0.01, 2.0), min_size=10, max_size=10), st.integers(0, 5))
def test_plan_is_the_best_assignment(rates, costs, other):
    """Over every assignment of draft lengths (brute force), none beats the plan's tokens per
    second under the same cost table (no draft cost; costs need not be monotone)."""
    costs = sorted(costs)  # a forward never gets cheaper with more tokens...
    table = ForwardCost({n + 1: c for n, c in enumerate(costs)})
    ctl = SpeculationController(3, table)
    ids = list(range(len(rates)))
    for i, r in zip(ids, rates):
        ctl.record(i).acceptance = Acceptance([x for x in r], [1.0] * 3)
    caps = [3] * len(ids)
    plan = ctl.plan(ids, caps, other, drafting_cost=False)

    def value(ks):
        tokens = sum(ctl.records[i].acceptance.expected_tokens(k) for i, k in zip(ids, ks))
        return tokens / table(other + len(ids) + sum(ks))

    best = max(value(ks) for ks in itertools.product(range(4), repeat=len(ids)))
    assert value(plan) >= best * (1 - 1e-9)


def test_plan_speculates_when_it_pays_and_not_when_it_does_not():
    flat = ForwardCost({1: 1.0, 8: 1.05, 9: 2.0})  # a bucketed step: 2..8 tokens cost about one token
    ctl = SpeculationController(4, flat)
    ctl.record(1).acceptance = Acceptance.prior(4, 0.6)
    assert ctl.plan([1], [4], 0) == [4]
    # the saving it predicts: what plain decoding takes to make its expected tokens, less its own step
    tokens = 1 + sum(0.6 ** j for j in range(1, 5))
    assert ctl.last_saving == pytest.approx(tokens * flat.optimistic(1) - flat.optimistic(5)) and ctl.last_saving > 1
    steep = ForwardCost({1: 1.0, 2: 2.0, 8: 8.0})  # each token costs a forward's worth
    ctl = SpeculationController(4, steep)
    ctl.record(1).acceptance = Acceptance.prior(4, 0.6)
    assert ctl.plan([1], [4], 0) == [0] and ctl.last_saving == 0.0
    assert ctl.plan([1], [0], 0) == [0]  # a cap of 0 is kept


def test_a_plan_beside_a_prefill_chunk_prices_its_saving_at_a_plain_decode_steps_rate():
    """Beside a 100-token prefill chunk a step is slow, and its tokens per second low: the saving the lookup
    gate is told is what plain decode steps would take for the extra tokens, less the extra seconds, not the
    step's tokens at its own rate (which read these 1.3 extra tokens as 6.4 s saved, 7.5 decode steps)."""
    table = ForwardCost({1: 1.0, 8: 1.05, 9: 2.0, 200: 10.0})
    ctl = SpeculationController(4, table)
    ctl.record(1).acceptance = Acceptance.prior(4, 0.6)
    assert ctl.plan([1], [4], 100) == [4]
    extra_tokens = sum(0.6 ** j for j in range(1, 5))
    want = extra_tokens * table.optimistic(1) - (table.optimistic(105) - table.optimistic(101))
    assert ctl.last_saving == pytest.approx(want) and want < 2 * table.optimistic(1)


def test_each_evidence_class_learns_its_own_acceptance_and_a_new_sequence_inherits_it():
    """n-gram drafts from a 3-token match are kept far more often than from a 1-token one: with a verify
    at 1.4x a decode, one sequence verifies its strong drafts and not its weak ones, and a new sequence
    starts from what the others taught each class (shadow drafts teach as verified ones do)."""
    ctl = SpeculationController(4, ForwardCost({1: 1.0, 2: 1.4, 5: 1.4, 8: 2.0}), probe_budget=None)
    for _ in range(20):
        ctl.observe_decode(1, 4, 3, evidence=3)  # strong: 3 of 4 kept
        ctl.shadow(1, 10, [5, 6, 7], evidence=1)  # weak: the first would have missed
        ctl.score_shadow(1, [0] * 10 + [9])
    assert ctl.acceptance(1, 3).rates()[0] > 0.9 and ctl.acceptance(1, 1).rates()[0] < 0.1
    assert ctl.plan([1], [4], 0, drafting_cost=False, probe=False, evidence=[3])[0] > 0
    assert ctl.plan([1], [4], 0, drafting_cost=False, probe=False, evidence=[1]) == [0]
    assert ctl.plan([2], [4], 0, drafting_cost=False, probe=False, evidence=[3])[0] > 0  # inherited
    assert ctl.plan([2], [4], 0, drafting_cost=False, probe=False, evidence=[1]) == [0]
    assert ctl.plan([2], [4], 0, drafting_cost=False, probe=False, evidence=[2]) == [0]  # nothing seen yet
    served = ctl.engine_wide()
    ctl.forget_acceptance()  # back to the prior: nothing seen
    assert ctl.plan([1], [4], 0, drafting_cost=False, probe=False, evidence=[3]) == [0]
    for _ in range(2):  # back to a served engine's state, whatever the runs in between learned
        ctl.forget_acceptance(served)
        assert ctl.acceptance(3, 3).rates()[0] >= 0.9
        for _ in range(30):
            ctl.observe_decode(3, 4, 0, evidence=3)
        assert ctl.acceptance(4, 3).rates()[0] < 0.5  # a later sequence inherits the misses


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.lists(st.floats(0.0, 1.0), max_size=3)), min_size=1, max_size=4))
def test_expected_worth_of_a_draining_step_is_the_mean_over_its_outcomes(batch):
    """Brute force over every combination of tokens the sequences may emit (independent)."""
    ctl = SpeculationController(4, ForwardCost({1: 1.0, 4: 1.3, 5: 1.4, 8: 1.4, 9: 2.0}))
    remaining = [r for r, _ in batch]
    costs = ctl._batch_costs(len(remaining))
    gains = [list(itertools.accumulate(rates, lambda a, b: a * b)) for _, rates in batch]  # P(x >= j)
    mean = 0.0
    for xs in itertools.product(*[range(len(g) + 1) for g in gains]):
        p = 1.0
        for g, x in zip(gains, xs):
            p *= (g[x - 1] if x else 1.0) - (g[x] if x < len(g) else 0.0)
        after = finish_seconds([r - 1 - x for r, x in zip(remaining, xs)], costs)
        mean += p * (finish_seconds(remaining, costs) - after)
    assert ctl.expected_worth(remaining, gains) == pytest.approx(mean, abs=1e-9)


def test_a_draining_plan_that_pays_only_at_the_expected_tokens_is_not_taken():
    """Four sequences tied at 40 tokens, drafts kept 60% of the time: at each one's expected tokens (2.5 more
    per verify) drafting all of them pays; but the batch ends with its slowest, and over the outcomes the
    verify's 1.5x cost is not repaid."""
    ctl = SpeculationController(3, ForwardCost({1: 1.0, 4: 1.0, 16: 1.5}), probe_budget=None)
    for i in range(4):
        ctl.record(i).acceptance = Acceptance.prior(3, 0.6, weight=1e9)
    curves = [ctl.record(i).acceptance.gains(3) for i in range(4)]
    expected = ctl.worth([40] * 4)([1 + sum(c) for c in curves]) / 1.5
    assert expected > ctl.worth([40] * 4)([1.0] * 4) / 1.0  # what the walk reads: drafting pays
    assert ctl.expected_worth([40] * 4, curves) / 1.5 < 1.0  # over the outcomes it does not
    assert ctl.plan(list(range(4)), [3] * 4, 0, drafting_cost=False, remaining=[40] * 4) == [0] * 4
    ctl.forward_cost = ForwardCost({1: 1.0, 4: 1.0, 16: 1.05})  # nearly free: now it pays either way
    assert ctl.plan(list(range(4)), [3] * 4, 0, drafting_cost=False, remaining=[40] * 4) == [3] * 4


def test_a_draining_batch_values_tokens_by_the_time_they_cut_from_finishing_it():
    """With requests waiting, every token counts; when the batch drains, drafts for one of several sequences
    tied at the longest remaining length cut (almost) nothing, while drafts for the one that finishes last,
    or for all of them, do."""
    bucketed = ForwardCost({1: 1.0, 4: 1.3, 5: 1.4, 8: 1.4, 9: 3.0})
    ctl = SpeculationController(4, bucketed)
    for i in range(4):
        ctl.record(i).acceptance = Acceptance.prior(4, 0.5 if i == 0 else 0.0, weight=1e9)
    ids, caps = [0, 1, 2, 3], [4] * 4
    assert ctl.plan(ids, caps, 0, drafting_cost=False) == [4, 0, 0, 0]  # throughput: one good draft pays
    assert ctl.plan(ids, caps, 0, drafting_cost=False, remaining=[64] * 4) == [0] * 4  # tied: it cuts nothing
    assert ctl.plan(ids, caps, 0, drafting_cost=False, remaining=[64, 10, 10, 10]) == [4, 0, 0, 0]  # the last one
    for i in range(4):
        ctl.record(i).acceptance = Acceptance.prior(4, 0.5, weight=1e9)
    assert sum(ctl.plan(ids, caps, 0, drafting_cost=False, remaining=[64] * 4)) == 4  # all of them advance
    worth = ctl.worth([64, 10, 10, 10])
    assert worth([1, 1, 1, 1]) == pytest.approx(bucketed(4))  # a plain step cuts one step of the batch
    assert worth([2, 1, 1, 1]) == pytest.approx(bucketed(4) + bucketed(1))
    assert ctl.worth(None)([2, 1, 1, 1]) == 5


def test_an_idle_sequence_is_probed_with_backoff_and_its_probe_survives_the_second_plan():
    ctl = SpeculationController(4, ForwardCost({1: 1.0, 2: 1.1, 8: 2.0}), probe_interval=3, probe_length=2,
                                probe_budget=None)
    ctl.record(7).acceptance = Acceptance.prior(4, 0.01)

    def steps(n, accepted=0):
        out = []
        for _ in range(n):
            out.append(ctl.plan([7], [4], 0)[0])
            ctl.observe_decode(7, out[-1], accepted if out[-1] else 0)
        return out

    assert steps(9) == [0, 0, 2, 0, 0, 0, 0, 0, 2]  # a failed probe doubles the wait: 3, then 6
    assert steps(11) == [0] * 11 and ctl.plan([7], [4], 0) == [2] and 7 in ctl.probes
    assert ctl.plan([7], [2], 0, drafting_cost=False, floors=[2]) == [2]  # kept after drafting
    ctl.observe_decode(7, 2, 1)  # a probe after which drafts pay: back to the first interval
    assert ctl.records[7].probe_interval == 3 and ctl.plan([7], [4], 0)[0] > 0


def test_a_probe_with_a_hit_that_does_not_make_drafts_pay_still_backs_off():
    """Where a draft position is dear (each token a forward's worth), one accepted draft in a probe does not
    bring speculation back: the wait doubles as after a miss."""
    ctl = SpeculationController(4, ForwardCost({1: 1.0, 2: 2.0, 8: 8.0}), probe_interval=3, probe_length=2,
                                probe_budget=None)
    ctl.record(7).acceptance = Acceptance.prior(4, 0.01)
    for _ in range(2):
        assert ctl.plan([7], [4], 0) == [0]
        ctl.observe_decode(7, 0, 0)
    assert ctl.plan([7], [4], 0) == [2]  # the probe
    ctl.observe_decode(7, 2, 1)
    assert ctl.records[7].probe_interval == 6 and ctl.plan([7], [4], 0) == [0]


def test_probes_wait_long_enough_to_cost_at_most_their_budget():
    """A probe that adds x seconds to a step of t waits at least x / (budget * t) idle steps: a cheap probe
    keeps the base interval, a dear one (each token as dear as a forward) comes rarely."""
    def first_probe(cost):
        ctl = SpeculationController(4, cost, probe_interval=4, probe_length=2, probe_budget=0.05)
        ctl.record(7).acceptance = Acceptance.prior(4, 0.01)
        for step in range(1, 200):
            if ctl.plan([7], [4], 0)[0]:
                return step
            ctl.observe_decode(7, 0, 0)

    assert first_probe(ForwardCost({1: 1.0, 2: 1.02, 8: 1.2})) == 4  # +5% a probe: the interval alone
    assert first_probe(ForwardCost({1: 1.0, 2: 2.0, 8: 8.0})) == 40  # +2 forwards a probe: 2 / (0.05 * 1)
    steep = SpeculationController(3, ForwardCost({1: 1.0, 2: 2.0, 8: 8.0}), probe_interval=4, probe_budget=0.1)
    steep.observe_tree(1, 3, 0)  # a tree of 6 adds 6 forwards: probed after 60 idle steps
    assert [steep.tree_pays([1], [3], 6, 0, 1.0) for _ in range(60)] == [False] * 59 + [True]

def test_shadow_drafts_are_scored_when_the_target_decides_them():
    ctl = SpeculationController(3, ForwardCost({1: 1.0, 8: 1.0}))  # verifying is free...
    ctl.record(4).acceptance = Acceptance.prior(3, 0.5, weight=0.0, decay=1.0)
    assert ctl.plan([4], [3], 0, probe=False) == [0]  # ...but with shadows nothing runs on the prior alone
    assert ctl.wants_shadow(4)
    ctl.shadow(4, 10, [5, 6, 7])  # drafted after the first 10 tokens
    ctl.shadow(4, 11, [6, 7, 8])  # and after 11: each step's draft is a sample
    ctl.shadow(4, 12, [1, 2, 3])
    assert not ctl.wants_shadow(4)  # at most max_drafts wait
    ctl.score_shadow(4, list(range(10)) + [5])  # the first's first draft right, the rest undecided
    assert len(ctl.records[4].shadows) == 3
    ctl.score_shadow(4, list(range(10)) + [5, 9, 1])  # first: 1 of 2 kept; second: 0 of 1; third: 1 so far
    assert [s[0] for s in ctl.records[4].shadows] == [12] and ctl.wants_shadow(4)
    assert ctl.records[4].acceptance.rates() == [0.5, 0.0, 0.0]


# ------------------------------------------------------------------------------ engine level
class _ScriptedProposer:
    """Drafts the reference continuation (``right``) or wrong tokens."""

    name = "scripted"

    def __init__(self, reference: dict[tuple, list[int]], right: bool, vocab: int):
        self.reference, self.right, self.vocab = reference, right, vocab

    def propose(self, requests):
        out = []
        for r in requests:
            prompt, done = tuple(r.token_ids[:r.num_prompt_tokens]), r.token_ids[r.num_prompt_tokens:]
            future = self.reference[prompt][len(done):len(done) + r.k]
            out.append(Draft([t if self.right else (t + 1) % self.vocab for t in future]))
        return out

    def on_verified(self, request_id, num_committed):
        pass

    def release(self, request_id):
        pass


def _reference(model, prompts, n):
    plain = specgraph.Engine(model, lowering="eager", num_blocks=64, page_size=8)
    return {tuple(p): r.token_ids for p, r in zip(prompts, plain.generate(prompts, max_new_tokens=n, ignore_eos=True))}


@pytest.mark.parametrize("right", [True, False])
def test_adaptive_follows_acceptance_under_a_measured_cost(right):
    """On a machine where each token a step adds costs a tenth of a 1-token forward, drafts that are always right are
    verified at full length nearly every step; drafts that are always wrong are dropped after
    a few tries, apart from the periodic probe. The output is the target's either way."""
    model = make_family("llama")
    prompts = random_prompts("llama", [7, 9])
    want = _reference(model, prompts, 40)
    spec = specgraph.Engine(model, lowering="eager", num_blocks=64, page_size=8, num_draft_tokens=4,
                            draft=_ScriptedProposer(want, right, 64))
    assert spec.adaptive and spec.controller is not None
    spec.controller.forward_cost = ForwardCost({1: 1.0, 20: 2.9})  # pinned: tiny-model timings are noise
    spec.controller.observe_forward = lambda n, s: None
    got = spec.generate(prompts, max_new_tokens=40, ignore_eos=True)
    assert {tuple(p): r.token_ids for p, r in zip(prompts, got)} == want
    s = spec.stats
    assert len(s["requests"]) == 2 and all(r["decode_steps"] > 0 for r in s["requests"])
    if right:
        assert s["mean_accepted_tokens"] > 3.5
        for r in s["requests"]:  # every step but the last (one token left: nothing to draft)
            assert r["speculated_steps"] >= r["decode_steps"] - 1 and r["mean_draft_length"] > 3, r
    else:
        assert s["speculated_fraction"] < 0.25 and s["mean_accepted_tokens"] == 1.0


def test_a_steps_cost_counts_its_host_work_but_not_its_drafting(monkeypatch):
    """The controller prices a step from its start to its end: scheduling and the rest of a step's host work
    count (on a GPU they are a large part of a 2 ms step), the drafting call does not (it is priced per
    drafted position). Here scheduling sleeps 30 ms and drafting 200 ms (its cost kept at 0, so every step drafts)."""
    import time

    model = make_family("llama")
    prompts = random_prompts("llama", [7])
    want = _reference(model, prompts, 12)

    class SlowProposer(_ScriptedProposer):
        def propose(self, requests):
            time.sleep(0.2)
            return super().propose(requests)

    spec = specgraph.Engine(model, lowering="eager", num_blocks=64, page_size=8, num_draft_tokens=2,
                            draft=SlowProposer(want, True, 64))
    schedule = spec.scheduler.schedule
    monkeypatch.setattr(spec.scheduler, "schedule", lambda: (time.sleep(0.03), schedule())[1])
    seen = []
    spec.controller.observe_forward = lambda n, seconds: seen.append(seconds)
    spec.controller.observe_draft = lambda seconds, longest: None
    got = spec.generate(prompts, max_new_tokens=12, ignore_eos=True)
    assert got[0].token_ids == want[tuple(prompts[0])]
    assert spec.stats["speculated_fraction"] > 0 and seen  # drafts were made, and steps observed
    assert all(0.03 <= s < 0.2 for s in seen), seen


@pytest.mark.parametrize("family, draft", [("llama", "layer_skip:1"), ("gpt2", "layer_skip:1"), ("llama", "ngram")])
def test_greedy_output_does_not_depend_on_the_chosen_lengths(family, draft, monkeypatch):
    """Whatever lengths the controller picks (here random, before and after drafting; with ngram,
    after looking at every sequence's draft, and the drafts not verified become shadow drafts), greedy speculation returns the target's
    tokens, at batch 1 and batch 3."""
    model = make_family(family)
    rng = random.Random(0)
    spec = specgraph.Engine(model, lowering="eager", num_blocks=64, page_size=8, draft=draft, num_draft_tokens=3)
    monkeypatch.setattr(spec.controller, "plan", lambda ids, caps, other, drafting_cost=True, floors=None, probe=True,
                        remaining=None, evidence=None:
                        [rng.randint(0, c) for c in caps])
    for prompts in (random_prompts(family, [8]), random_prompts(family, [5, 9, 7], seed=2)):
        want = _reference(model, prompts, 12)
        got = spec.generate(prompts, max_new_tokens=12, ignore_eos=True)
        assert {tuple(p): r.token_ids for p, r in zip(prompts, got)} == want
    assert 0 < spec.stats["speculated_fraction"] < 1
    cost = spec.controller.forward_cost  # the reported table: the shape, scaled and corrected at the sizes used
    assert spec.stats["forward_cost_scale"] == cost.scale > 0
    assert spec.stats["forward_cost_corrections"] == cost.corrections
    assert spec.stats["forward_cost_s"] == pytest.approx({n: cost(n) for n in cost.sizes})


def test_adaptive_needs_a_draft_and_fixed_lengths_stay_fixed():
    model = make_family("llama")
    with pytest.raises(ValueError, match="adaptive=True .* needs a draft"):
        specgraph.Engine(model, lowering="eager", num_blocks=64, adaptive=True)
    prompts = random_prompts("llama", [7])
    want = _reference(model, prompts, 10)
    fixed = specgraph.Engine(model, lowering="eager", num_blocks=64, page_size=8, num_draft_tokens=3,
                             draft=_ScriptedProposer(want, False, 64), adaptive=False)
    assert fixed.controller is None
    fixed.generate(prompts, max_new_tokens=10, ignore_eos=True)
    (r,) = fixed.stats["requests"]
    # every step drafts all it may: 3, then fewer as the last tokens near (wrong drafts: 1 token a step)
    assert r["draft_lengths"] == {0: 1, 1: 1, 2: 1, 3: 6}
    fixed.reset_stats()  # a generate call whose requests cap drafts at 0 does not speculate
    assert [r.token_ids for r in fixed.generate(prompts, max_new_tokens=10, ignore_eos=True, num_draft_tokens=0)] \
        == [want[tuple(prompts[0])]]
    (r,) = fixed.stats["requests"]
    assert r["draft_lengths"] == {0: 9} and fixed.stats["verify_steps"] == 0  # (the first token: prefill)
    with pytest.raises(ValueError, match="num_draft_tokens must be >= 0"):
        fixed.generate(prompts, max_new_tokens=10, num_draft_tokens=-1)


def test_a_tree_is_verified_where_its_paths_pay_and_probed_with_backoff_where_they_do_not():
    cheap = SpeculationController(3, ForwardCost({1: 1.0, 8: 1.0, 30: 1.2}), probe_interval=4)
    cheap.plan([1], [3], 0)
    cheap.observe_tree(1, 3, 3)  # a full path of 3: 4 tokens per verify
    assert cheap.tree_tokens(1, 3) == 4.0 and cheap.tree_tokens(2, 3) == 4.0  # (the engine-wide mean for others)
    assert cheap.tree_pays([1], [3], 6, 0, cheap.last_rate)
    steep = SpeculationController(3, ForwardCost({1: 1.0, 2: 2.0, 8: 8.0}), probe_interval=4, probe_budget=None)
    steep.observe_tree(1, 3, 0)  # nothing accepted: 1 token per verify of 7 tokens
    decisions = [steep.tree_pays([1], [3], 6, 0, 1.0) for _ in range(8)]
    assert decisions == [False, False, False, True, False, False, False, True]  # a probe every 4 steps
    steep.observe_tree(1, 3, 0)  # the probe gained less than the chain: the wait doubles
    assert [steep.tree_pays([1], [3], 6, 0, 1.0) for _ in range(8)] == [False] * 7 + [True]


def test_adaptive_trees_follow_the_cost_and_keep_greedy_output():
    """With a tree, the controller verifies it where verifying is cheap and falls back to chains or nothing where
    it is dear (costs pinned: tiny-model timings are noise); the tokens are the target's either way."""
    model = make_family("llama")
    prompts = [p * 3 for p in random_prompts("llama", [7, 9])]  # repeats: n-gram trees find them
    want = _reference(model, prompts, 30)
    spec = specgraph.Engine(model, lowering="eager", num_blocks=64, page_size=8, draft="ngram",
                            draft_tree="static:2,2,1")
    assert spec.adaptive and spec.draft_tree == "static:2,2,1"
    spec.controller.observe_forward = lambda n, s: None
    for cost, trees in ((ForwardCost({1: 1.0, 40: 1.0}), True), (ForwardCost({1: 1.0, 2: 10.0, 40: 400.0}), False)):
        spec.controller.forward_cost = cost
        spec.controller.forget_acceptance()
        spec.reset_stats()
        got = spec.generate(prompts, max_new_tokens=30, ignore_eos=True)
        assert {tuple(p): r.token_ids for p, r in zip(prompts, got)} == want
        s = spec.stats
        if trees:
            assert s["tree_nodes_verified"] > 0 and s["mean_accepted_tokens"] > 1.5
        else:
            assert s["speculated_fraction"] < 0.25


def test_the_forward_cost_table_is_measured_once_per_machine(tmp_path, monkeypatch):
    """With the graph cache on, the controller's cost table is kept beside the program's entry: a second
    Engine of the same program on this machine loads it instead of measuring."""
    import specgraph.runtime.drafting as drafting

    monkeypatch.setenv("SPECGRAPH_GRAPH_CACHE", str(tmp_path))
    measured = []
    real = drafting.measure_target_cost
    monkeypatch.setattr(drafting, "measure_target_cost", lambda *a: measured.append(a) or real(*a))
    model = make_family("llama")
    first = specgraph.Engine(model, lowering="eager", num_blocks=64, page_size=8, draft="ngram")
    second = specgraph.Engine(model, lowering="eager", num_blocks=64, page_size=8, draft="ngram")
    assert len(measured) == 1 and list((tmp_path / "measurements").glob("*forward-cost*.json"))
    assert second.controller.forward_cost.as_dict() == pytest.approx(first.controller.forward_cost.as_dict())


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_walk_stops_early_only_where_no_larger_plan_can_win(data):
    """``plan`` ends its walk over stream sizes once no larger plan can beat the best so far (worth never
    exceeds taking every draft, cost never below the cheapest larger stream): the lengths and the rate it
    chooses are those of the whole walk, for any acceptance, cost table, floors, draining or not."""
    max_drafts = data.draw(st.integers(1, 6))
    sizes = sorted(data.draw(st.sets(st.integers(2, 40), min_size=1, max_size=5)))
    seconds = sorted(data.draw(st.lists(st.floats(0.5, 5.0), min_size=len(sizes), max_size=len(sizes))))
    cost = ForwardCost({1: 0.5, **dict(zip(sizes, seconds))})
    batch = data.draw(st.integers(1, 5))
    ids = list(range(batch))
    caps = [data.draw(st.integers(0, max_drafts)) for _ in ids]
    floors = [data.draw(st.integers(0, c)) for c in caps]
    remaining = [data.draw(st.integers(1, 12)) for _ in ids] if data.draw(st.booleans()) else None
    other = 0 if remaining is not None else data.draw(st.integers(0, 6))
    per_position = data.draw(st.sampled_from([0.0, 0.01, 0.3]))

    observed = [(i, d, data.draw(st.integers(0, d))) for i in ids for _ in range(data.draw(st.integers(0, 3)))
                for d in [data.draw(st.integers(1, max_drafts))]]

    def controller() -> SpeculationController:
        ctl = SpeculationController(max_drafts, cost, probe_budget=None)
        ctl.draft_seconds_per_position = per_position
        for i, drafted, accepted in observed:
            ctl.observe_decode(i, drafted, accepted)
        return ctl

    pruned, whole = controller(), controller()
    whole._cheapest_from = lambda base, extra: [0.0] * (extra + 2)  # never stops early
    args = dict(drafting_cost=data.draw(st.booleans()), floors=floors, probe=False, remaining=remaining)
    assert pruned.plan(ids, caps, other, **args) == whole.plan(ids, caps, other, **args)
    assert pruned.last_rate == whole.last_rate
