"""The target's forward cost by stream size (``runtime/forward_cost.py``): the measured shape, made
non-decreasing and interpolated, scaled by the machine's speed and corrected at the sizes steps use."""
import pytest

from specgraph.runtime import forward_cost as forward_cost_module
from specgraph.runtime.forward_cost import ForwardCost, cost_sizes, non_decreasing


def test_forward_cost_interpolates_extrapolates_and_follows_observations():
    cost = ForwardCost({1: 1.0, 8: 1.0, 16: 3.0})
    assert cost(4) == 1.0 and cost(12) == 2.0 and cost(20) == 4.0 and cost(1) == 1.0
    cost.observe(8, 100.0)  # a pause, then another: the measured table still holds (the median)
    cost.observe(8, 100.0)
    assert cost(8) == 1.0
    for seconds in (2.0, 2.0):  # a majority of recent steps moves it, and every size with it
        cost.observe(8, seconds)
    assert cost(8) == 2.0 and cost(16) == 6.0 and cost(12) == 4.0
    for _ in range(15):  # the window forgets the start and the pauses alike; any size's steps count
        cost.observe(12, 3.0)  # 1.5x the shape at 12
    assert cost(1) == 1.5 and cost(16) == 4.5
    assert cost.as_dict() == {1: 1.5, 8: 1.5, 16: 4.5}
    with pytest.raises(ValueError, match="stream sizes"):
        ForwardCost({})


def test_forward_cost_corrects_the_sizes_steps_use():
    """A start-up table that read 4 tokens 1.1x one (another process shared the cores) where steps take
    1.4x: the steps correct each size they use, relative to the others, whatever the machine's speed."""
    cost = ForwardCost({1: 1.0, 4: 1.1, 8: 2.0})
    for _ in range(10):  # a third of the steps verify 3 drafts
        for n, seconds in ((1, 1.0), (1, 1.0), (4, 1.4)):
            cost.observe(n, seconds)
    assert cost(1) == pytest.approx(1.0) and cost(4) == pytest.approx(1.4)
    assert cost(2) == pytest.approx(1.0 + 0.4 / 3)  # between corrected sizes: linear
    assert cost(8) == pytest.approx(2.0 * 1.4 / 1.1)  # beyond: the nearest correction
    assert cost.corrections == pytest.approx({1: 1.0, 4: 1.4 / 1.1})
    for _ in range(10):  # the machine slows down 2x: every size with it, the correction stays
        for n, seconds in ((1, 2.0), (1, 2.0), (4, 2.8)):
            cost.observe(n, seconds)
    assert cost(1) == pytest.approx(2.0) and cost(4) == pytest.approx(2.8)
    alone = ForwardCost({1: 1.0, 4: 1.1})
    for _ in range(10):  # one size alone tells the speed, not its cost relative to the others
        alone.observe(4, 2.2)
    assert alone.corrections == {4: 1.0} and alone(1) == pytest.approx(2.0) and alone(4) == pytest.approx(2.2)


def test_forward_cost_moves_a_correction_only_past_its_resolution():
    """A correction that moves by less than ``resolution`` stays (no table rebuild per step), one that moves
    more is taken; the speed factor still moves every read, kept optimistic shares included."""
    cost = ForwardCost({1: 1.0, 4: 1.1, 8: 2.0}, resolution=0.05)

    def steps(one: float, four: float) -> None:
        for _ in range(20):  # two decodes per verify: the speed factor is the decodes'
            for n, seconds in ((1, one), (1, one), (4, four)):
                cost.observe(n, seconds)

    steps(1.0, 1.4)
    first = cost.corrections[4]
    before = cost.optimistic(6)
    steps(1.0, 1.4 * 1.03)  # 3% dearer: inside the resolution
    assert cost.corrections[4] == first
    steps(1.0, 1.4 * 1.2)  # 20% dearer: taken
    assert cost.corrections[4] == pytest.approx(first * 1.2) and cost.optimistic(6) > before
    speed = cost.optimistic(6) / cost.scale
    steps(2.0, 2 * 1.4 * 1.2)  # the machine slows 2x: the kept reads scale with it
    assert cost.optimistic(6) == pytest.approx(speed * cost.scale) and cost.scale == pytest.approx(2.0, rel=0.05)


def test_a_size_not_corrected_yet_never_reads_cheaper_than_a_smaller_corrected_one():
    """4 decodes fill one bucket; a 5th token costs 12% more. Read 15% cheaper, it would cost less than the
    corrected 4-token step, and a batch would verify anything until every larger size was corrected."""
    cost = ForwardCost({1: 0.8, 4: 1.0, 5: 1.12, 8: 1.12, 9: 1.7})
    for _ in range(5):
        cost.observe(4, 1.0)
        cost.observe(1, 0.8)
    assert cost.optimistic(4) == pytest.approx(1.0)  # corrected: as estimated
    assert cost.optimistic(5) == pytest.approx(1.0)  # not below the corrected 4
    assert cost.optimistic(9) == pytest.approx(1.7 * 0.85)  # far enough above: the discount applies


def test_forward_cost_never_falls_with_the_stream():
    """Timing noise that put a larger stream below a smaller one is pooled away (least squares)."""
    cost = ForwardCost({1: 35.0, 2: 56.0, 3: 54.0, 4: 39.0, 8: 60.0})
    table = cost.as_dict()
    assert all(table[a] <= table[b] for a, b in zip(sorted(table), sorted(table)[1:]))
    assert table[2] == table[3] == table[4] == pytest.approx((56 + 54 + 39) / 3) and table[1] == 35.0
    assert non_decreasing([3.0, 1.0, 2.0, 5.0]) == [2.0, 2.0, 2.0, 5.0]


def test_measured_shape_survives_a_slow_spell(monkeypatch):
    """A slow spell as long as one size's repeats slows a round, not a size: the best of the rounds
    is the true shape (the factor learns speed, so a bent shape would stay bent)."""
    clock = {"now": 0.0, "calls": 0}

    def run(n):  # n stream tokens cost n seconds, twice that during calls 6..8
        clock["calls"] += 1
        clock["now"] += n * (2.0 if 6 <= clock["calls"] <= 8 else 1.0)

    monkeypatch.setattr(forward_cost_module.time, "perf_counter", lambda: clock["now"])
    cost = forward_cost_module.measure_forward_cost(run, [1, 2, 3, 4], repeats=3)
    assert cost.as_dict() == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}


def test_cost_sizes_cover_each_bucket_edge():
    sizes = cost_sizes(40, buckets=(1, 16))
    assert set(range(1, 13)) | {16, 17, 40} <= set(sizes) and sizes == sorted(set(sizes)) and max(sizes) == 40
    assert len(sizes) < 20 and cost_sizes(3) == [1, 2, 3]
