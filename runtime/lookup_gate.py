"""Whether a step looks up drafts at all: free drafts are not free host time.

Drafting that writes no cache (n-gram lookup) is done for every decoding sequence before the controller
chooses (``runtime/drafting.py``), and the drafts it does not verify are scored as shadow drafts. That is
host work on every step, lookups + plan + scoring: about 0.2 ms on a 2-core CPU, 1% of a SmolLM2 decode.
Where the plans keep choosing plain decoding (open chat in a closed batch of four, where drafts for some
sequences finish nothing sooner) it is all loss, and adaptive decoding reads ~1% slower than none.

The gate weighs what looking is worth against what it costs, both measured: each look's plan predicts the
seconds it saves over plain decoding (:attr:`~.controller.SpeculationController.last_saving`, 0 when it
chose plain decoding), and the host seconds of each look are timed; both are decayed means over looks,
the saving's with a long memory (in chat a strong match comes every few dozen steps and saves 20-50
times a look's cost) and trusted only after ``min_looks`` looks. While looking is worth its cost every
step looks. Otherwise a look comes every ``cost / saving`` steps (at most every ``max_wait``), so the
estimates stay current and a sequence whose text turns repetitive is seen within a few steps: a look
whose plan saves many times the cost reopens the gate at once.
A skipped step is a plain decode: the choice changes speed only, never the output.
"""
from __future__ import annotations

import math


class LookupGate:
    """``should_look()`` each step; ``spend(seconds)`` for the host time of the last look (lookups, plan, and
    the scoring of its shadow drafts, which may come steps later); ``observe_saving(seconds)`` per look."""

    def __init__(self, decay: float = 0.97, max_wait: int = 8, min_looks: int = 16):
        if max_wait < 1:
            raise ValueError(f"max_wait must be >= 1; got {max_wait}")
        self.decay, self.max_wait, self.min_looks = decay, max_wait, min_looks
        self.saving: float | None = None  # decayed mean seconds a look's plan predicts to save
        self.looks = 0  # savings observed since the gate was made or forgot
        self.cost: float | None = None  # decayed mean host seconds of a look
        self._spent = 0.0  # host seconds of the last look so far
        self._waited = 0  # steps since the last look
        self.skipped = 0  # steps that did not look

    def wait(self) -> int:
        """Steps from one look to the next: 1 while looking is worth its cost."""
        if self.looks < self.min_looks or self.cost is None or self.saving >= self.cost:
            return 1
        return min(self.max_wait, math.floor(self.cost / self.saving) if self.saving > 0 else self.max_wait)

    def should_look(self) -> bool:
        self._waited += 1
        if self._waited < self.wait():
            self.skipped += 1
            return False
        self._waited = 0
        if self._spent:  # the previous look's cost is complete: its shadows were scored on the steps since
            self.cost = self._mean(self.cost, self._spent)
            self._spent = 0.0
        return True

    def forget(self) -> None:
        """Forget the savings (with the acceptance they came from); the cost, this machine's, is kept."""
        self.saving, self.looks, self._waited = None, 0, 0

    def spend(self, seconds: float) -> None:
        self._spent += seconds

    def observe_saving(self, seconds: float) -> None:
        self.saving = self._mean(self.saving, max(0.0, seconds))
        self.looks += 1

    def _mean(self, mean: float | None, sample: float) -> float:
        return sample if mean is None else mean + (1.0 - self.decay) * (sample - mean)
