"""runtime/lookup_gate.py: free drafts are looked up every step while their plans save more than the lookups
cost (and for the first min_looks looks), every cost/saving steps (at most max_wait) otherwise, and a large
saving reopens the gate at once."""
import pytest

from specgraph.runtime.lookup_gate import DecayedMean, LookupGate


def _looks(gate: LookupGate, steps: int, saving: float, cost: float, step_seconds: float | None = None) -> list[int]:
    """The steps (0-based) that looked, each look costing ``cost`` host seconds and predicting ``saving``."""
    looked = []
    for step in range(steps):
        if gate.should_look(1, step_seconds):
            looked.append(step)
            gate.spend(cost)
            gate.observe_saving(saving)
    return looked


def test_lookups_that_save_more_than_they_cost_run_every_step():
    gate = LookupGate()
    assert _looks(gate, 20, saving=1e-3, cost=2e-4) == list(range(20))
    assert gate.skipped == 0


def test_lookups_that_save_nothing_run_every_max_wait_steps_after_min_looks():
    gate = LookupGate(max_wait=8, min_looks=4)
    looked = _looks(gate, 45, saving=0.0, cost=2e-4)
    assert looked == [0, 1, 2, 3, 11, 19, 27, 35, 43]
    assert gate.skipped == 45 - len(looked)


def test_looks_dear_against_a_step_are_trusted_after_fewer_of_them():
    """A look of 0.2 ms: 1% of a 24 ms CPU step, and all 16 first looks are made; 6% of a 3.3 ms GPU step, and
    after 4 (a quarter of a step's host time) a gate whose looks save nothing waits max_wait steps."""
    cpu = _looks(LookupGate(max_wait=8, min_looks=16), 45, saving=0.0, cost=2e-4, step_seconds=24e-3)
    assert cpu[:16] == list(range(16)) and cpu[16:] == [23, 31, 39]
    gpu = _looks(LookupGate(max_wait=8, min_looks=16), 45, saving=0.0, cost=2e-4, step_seconds=3.3e-3)
    assert gpu == [0, 1, 2, 3, 11, 19, 27, 35, 43]
    tiny = LookupGate(min_looks=16, least_looks=4)
    tiny.cost.add(1.0)
    tiny.should_look(1, 1e-3)
    assert tiny.trusted_after() == 4  # never fewer than least_looks
    assert _looks(LookupGate(), 20, saving=1e-3, cost=2e-4, step_seconds=3.3e-3) == list(range(20))  # saving pays


def test_a_small_saving_waits_cost_over_saving_steps():
    gate = LookupGate(max_wait=8, min_looks=0)
    gate.saving.add(5e-5)
    gate.cost.add(2e-4)
    assert gate.wait() == 4
    gate.forget()
    gate.saving.add(1.9e-4)
    assert gate.wait() == 1  # (floor: a wait of one step costs what it saves)


def test_savings_are_kept_by_batch_size():
    """Lookups that save much for one sequence (code at batch 1) and nothing for four (chat in a closed batch):
    the gate looks every step at batch 1 and shuts at batch 4 (3 and 4 sequences share a class)."""
    gate = LookupGate(max_wait=8, min_looks=4)
    for step in range(40):
        decodes = 1 if step % 2 else 4 - step % 4 // 2  # batch 1, then 4 or 3
        if gate.should_look(decodes):
            gate.spend(2e-4)
            gate.observe_saving(1e-2 if decodes == 1 else 0.0)
    gate.should_look(1)
    assert gate.wait() == 1 and gate.looks >= 4
    gate.should_look(3)
    assert gate.wait() == 8 and gate.saving.value == 0.0
    gate.forget()
    assert gate.looks == 0 and gate.wait() == 1


def test_one_early_strong_match_does_not_hold_the_gate_open():
    """Chat in a closed batch: one look's plan saves much (a strong match), every later one nothing. The
    means weigh looks by age alone, so that first saving counts as one look among many and the gate shuts
    once the saving it predicts per look falls below a look's cost."""
    gate = LookupGate(max_wait=8, min_looks=16)
    gate.should_look()
    gate.spend(3e-4)
    gate.observe_saving(7e-3)
    looked = _looks(gate, 63, saving=0.0, cost=3e-4)
    assert gate.saving.value < gate.cost.value
    assert len(looked) < 45  # (a mean that started at 7e-3 stayed above 3e-4 for 100 looks: every step looked)


def test_decayed_mean_weighs_samples_by_age_alone():
    mean = DecayedMean(0.5)
    assert mean.value is None
    for x in (8.0, 0.0, 0.0):
        mean.add(x)
    assert mean.value == pytest.approx(8.0 * 0.25 / (1 + 0.5 + 0.25))


def test_a_large_saving_reopens_the_gate_and_forget_keeps_the_cost():
    gate = LookupGate(max_wait=8, min_looks=4)
    _looks(gate, 20, saving=0.0, cost=2e-4)
    assert gate.wait() == 8
    gate.observe_saving(1e-2)  # a look whose plan verifies a strong draft
    assert gate.wait() == 1
    gate.forget()
    assert gate.saving.value is None and gate.looks == 0 and gate.cost.value == pytest.approx(2e-4)
    assert gate.wait() == 1


def test_a_new_sequence_looks_at_once_through_a_shut_gate():
    gate = LookupGate(max_wait=8, min_looks=4)
    _looks(gate, 20, saving=0.0, cost=2e-4)
    assert gate.wait() == 8 and not gate.should_look()
    gate.look_next()  # a sequence starts decoding
    assert gate.should_look() and not gate.should_look()


def test_max_wait_must_be_positive():
    with pytest.raises(ValueError, match="max_wait"):
        LookupGate(max_wait=0)


def test_an_engine_whose_lookups_do_not_pay_skips_them_and_keeps_greedy_output():
    """With n-gram drafts and the gate shut (lookups priced far above what their plans save), only every
    max_wait-th decode step looks up drafts; the output is the target's, on repeating and random prompts."""
    import specgraph
    from models import make_family, random_prompts

    model = make_family("llama")
    prompts = [p * 3 for p in random_prompts("llama", [5, 4], seed=3)] + random_prompts("llama", [9], seed=4)
    plain = specgraph.Engine(model, lowering="eager", num_blocks=64, page_size=8)
    want = [r.token_ids for r in plain.generate(prompts, max_new_tokens=24, ignore_eos=True)]
    spec = specgraph.Engine(model, lowering="eager", num_blocks=64, page_size=8, draft="ngram", num_draft_tokens=3)
    gate = spec.controller.lookups
    gate.max_wait, gate.min_looks = 4, 0
    assert gate.should_look(3)  # (three sequences decode: the class of 3-4 learns a look that saved nothing)
    gate.observe_saving(0.0)
    gate.cost.add(1.0)
    gate.observe_saving = lambda seconds: None  # (keep it shut)
    gate.spend = lambda seconds: None
    assert [r.token_ids for r in spec.generate(prompts, max_new_tokens=24, ignore_eos=True)] == want
    steps = spec.stats["decode_forwards"] // len(prompts)  # (every step decodes all three: the same budget)
    assert spec.stats["draft_lookups_skipped"] >= steps - -(-steps // 4) - 1 > 0
