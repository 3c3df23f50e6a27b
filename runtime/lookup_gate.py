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
times a look's cost) and trusted only after ``min_looks`` looks, or fewer where a look is dear against a
step: those first looks at a batch size spend at most ``explore_steps`` decode steps' worth of host time (at
least ``least_looks`` looks). On a 2-core CPU a look is about 1% of a batch-4 step and all 16 are made. On
an H100, where a step is a 3.3 ms CUDA-graph replay, a look as dear as on that CPU (0.2 ms; not measured on
the GPU's host) would be about 6% of one, and run V's 22 looks per 64-token batch of chat would cost about
what adaptive decoding lost there against none (2%); the gate would make 4 first looks, not 16.
The means weigh every look by its age alone: a mean that starts at its first sample keeps that sample's
weight for dozens of looks, and one early strong match held the gate open for a whole closed batch of chat
that never speculated again.

While looking is worth its cost every step looks. Otherwise a look comes every ``cost / saving`` steps
(at most every ``max_wait``), so the estimates stay current and a sequence whose text turns repetitive is
seen within a few steps: a look whose plan saves many times the cost reopens the gate at once. A
sequence's first decode step always looks (``look_next``): a prompt full of code to copy opens the gate
on its first step, not up to ``max_wait`` steps later. The savings are kept by batch size
(:class:`LookupGate`).
A skipped step is a plain decode: the choice changes speed only, never the output.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


class LookupGate:
    """``should_look(decodes)`` each step (``decodes``: the step's decoding sequences); ``spend(seconds)`` for the
    host time of the last look (lookups, plan, and the scoring of its shadow drafts, which may come steps
    later); ``observe_saving(seconds)`` per look.

    Savings are kept by batch size (decoding sequences, in powers of two): the same drafts that save a third
    of a step for one sequence save nothing for four tied sequences of a closed batch, and one mean over all
    sizes let what looks had saved at one size open the gate at another."""

    def __init__(self, decay: float = 0.97, max_wait: int = 8, min_looks: int = 16, least_looks: int = 4,
                 explore_steps: float = 0.25):
        if max_wait < 1:
            raise ValueError(f"max_wait must be >= 1; got {max_wait}")
        self.decay, self.max_wait, self.min_looks = decay, max_wait, min_looks
        self.least_looks, self.explore_steps = least_looks, explore_steps
        self._step_seconds: float | None = None  # a plain decode step's, at the current step's batch size
        self._by_size: dict[int, Savings] = {}  # batch size class -> what its looks' plans predicted to save
        self._size = 1  # the batch size class of the current step
        self.cost = DecayedMean(decay)  # host seconds of a look
        self._spent = 0.0  # host seconds of the last look so far
        self._waited = 0  # steps since the last look
        self.skipped = 0  # steps that did not look

    @property
    def saving(self) -> DecayedMean:
        """Seconds a look's plan predicts to save, at the current step's batch size."""
        return self._savings().mean

    @property
    def looks(self) -> int:
        """Savings observed at the current step's batch size since the gate was made or forgot."""
        return self._savings().looks

    def _savings(self) -> Savings:
        out = self._by_size.get(self._size)
        if out is None:
            out = self._by_size[self._size] = Savings(DecayedMean(self.decay))
        return out

    def trusted_after(self) -> int:
        """Looks at a batch size before its mean saving is trusted: ``min_looks``, or as many as cost
        ``explore_steps`` plain decode steps (never fewer than ``least_looks``), whichever is fewer."""
        cost = self.cost.value
        if not cost or not self._step_seconds:
            return self.min_looks
        return max(min(self.least_looks, self.min_looks),
                   min(self.min_looks, math.floor(self.explore_steps * self._step_seconds / cost)))

    def wait(self) -> int:
        """Steps from one look to the next: 1 while looking is worth its cost."""
        saving, cost = self.saving.value, self.cost.value
        if self.looks < self.trusted_after() or cost is None or saving is None or saving >= cost:
            return 1
        return min(self.max_wait, math.floor(cost / saving) if saving > 0 else self.max_wait)

    def should_look(self, decodes: int = 1, step_seconds: float | None = None) -> bool:
        """Whether this step looks; ``step_seconds``: what a plain decode step of these ``decodes`` costs (None:
        unknown, and the first ``min_looks`` looks are all made)."""
        self._size = 1 << max(0, decodes - 1).bit_length()
        self._step_seconds = step_seconds
        self._waited += 1
        if self._waited < self.wait():
            self.skipped += 1
            return False
        self._waited = 0
        if self._spent:  # the previous look's cost is complete: its shadows were scored on the steps since
            self.cost.add(self._spent)
            self._spent = 0.0
        return True

    def forget(self) -> None:
        """Forget the savings (with the acceptance they came from); the cost, this machine's, is kept."""
        self._by_size, self._waited = {}, 0

    def look_next(self) -> None:
        """The next :meth:`should_look` looks (a sequence starts decoding: its drafts are unknown)."""
        self._waited = self.max_wait

    def spend(self, seconds: float) -> None:
        self._spent += seconds

    def observe_saving(self, seconds: float) -> None:
        savings = self._savings()
        savings.mean.add(max(0.0, seconds))
        savings.looks += 1


@dataclass
class Savings:
    """What the looks at one batch size predicted to save, and how many looks that is."""

    mean: DecayedMean
    looks: int = 0


class DecayedMean:
    """``sum(decay**age * x) / sum(decay**age)`` over the samples so far (None before any): each sample
    weighs by its age alone, the first as little as any other of its age."""

    def __init__(self, decay: float):
        self.decay, self._sum, self._weight = decay, 0.0, 0.0

    @property
    def value(self) -> float | None:
        return self._sum / self._weight if self._weight else None

    def add(self, sample: float) -> None:
        self._sum = self.decay * self._sum + sample
        self._weight = self.decay * self._weight + 1.0
