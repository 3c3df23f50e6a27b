"""benchmarks/replay_controller.py: its modelled rates on synthetic records (no model): a plain decode
makes a token per forward, and on text that repeats itself the controller drafts and wins."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from replay_controller import replay, step_cost  # noqa: E402

BUCKETS = {1: 0.020, 4: 0.024, 8: 0.026, 16: 0.040, 32: 0.060}


def _records(repeating: bool):
    phrase = list(range(100, 120))
    out = []
    for i in range(4):
        prompt = [1, 2, 3] + phrase if repeating else [1, 2, 3]
        output = (phrase * 4)[:48] if repeating else [200 + (7 * j + i) % 50 for j in range(48)]
        out.append({"group": "code", "temp": 0.0, "prompt": prompt, "output": output})
    return out


def test_step_cost_takes_the_smallest_bucket_that_holds_the_stream():
    assert step_cost(BUCKETS, 1) == 0.020 and step_cost(BUCKETS, 3) == 0.024 and step_cost(BUCKETS, 9) == 0.040
    assert step_cost(BUCKETS, 64) == pytest.approx(0.120)


@pytest.mark.parametrize("batch", [1, 4])
def test_plain_decoding_makes_a_token_per_forward_and_repeating_text_rewards_the_controller(batch):
    common = dict(buckets=BUCKETS, max_drafts=4, new_tokens=48, noise=0.1, pauses=0.05)
    plain = replay(_records(True), batch, "none", drain=True, **common)
    assert plain == pytest.approx(batch / step_cost(BUCKETS, batch))
    host = []
    adaptive = replay(_records(True), batch, "adaptive", drain=True, host=host, **common)
    fixed = replay(_records(True), batch, 4, drain=False, **common)
    assert adaptive > 1.5 * plain and fixed > 1.5 * plain
    (seconds, steps), = host  # the real time of the drafting and controller calls, and the steps they served
    assert 0 < seconds < 5 and 0 < steps < len(_records(True)) * 48
    # text that never repeats: no drafts (nothing matches), the same rate as plain decoding
    assert replay(_records(False), batch, "adaptive", drain=True, **common) == pytest.approx(
        replay(_records(False), batch, "none", drain=True, **common))


def test_slow_spells_cost_every_policy_real_time():
    """A slow spell is the machine's, not the observation's: plain decoding pays for it too."""
    common = dict(buckets=BUCKETS, max_drafts=4, new_tokens=48, noise=0.0, pauses=0.0)
    calm = replay(_records(True), 1, "none", drain=True, **common)
    slowed = replay(_records(True), 1, "none", drain=True, slow=0.5, slow_factor=2.0, period=10, **common)
    assert 0.55 * calm < slowed < 0.9 * calm
