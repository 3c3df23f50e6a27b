"""Adaptive speculation: each step, how many drafts each decoding sequence gets (0: none).

A draft is worth verifying when the tokens it is expected to add pay for the larger forward that
verifies it. The controller decides that per step, for the whole batch, from three measurements:

* **target cost** (:class:`~.forward_cost.ForwardCost`): seconds of one target forward by stream size (tokens in
  the step), its shape measured on this machine when the engine starts, scaled by one speed
  factor that every decode step refines (the machine's load moves all sizes together) and
  corrected at the sizes steps use by what they took relative to the rest; planning reads a size
  no step has corrected yet a little cheaper, so a verify the table made too dear gets tried. It is a
  step function on a bucketed program (2..8 tokens run the same 8-token graph), so a second draft
  can be free where the first was not; nothing here assumes more than that it never falls.
* **draft cost**: seconds of one propose call per drafted position, measured on every call
  (a draft model's k single-token steps; near zero for n-gram lookup).
* **acceptance** (:class:`Acceptance`): per sequence and per draft position i, the probability that
  draft i is accepted once drafts 1..i-1 were, from decayed counts. A new sequence starts from
  the engine-wide estimate of the same proposer, weighted as a few observations. A proposer may
  tag each draft with an **evidence class** (``Draft.evidence``; n-gram lookup: the length of the
  suffix it matched), and then each class has its own estimates, per sequence and engine-wide:
  on SmolLM2's replies a 1-token match's first draft was kept 12-23% of the time and a 3-token
  match's 75-80%, so one rate for both verifies the weak drafts and under-drafts the strong ones.
  Drafts that cost nothing and write no cache are made for every sequence before the controller
  chooses (``runtime/drafting.py``), so it plans with each draft's class and length in hand.

With ``a_i`` those conditional rates, k drafts yield ``E(k) = 1 + sum_j prod_{i<=j} a_i`` tokens
per sequence. The (k+1)-th draft's gain ``prod_{i<=k+1} a_i`` never grows with k, so handing out
drafts one at a time to the largest gain gives the most expected tokens for every stream size;
the controller walks the stream sizes that way and keeps the lengths with the most tokens per
predicted second (forward + drafting). While requests wait, every token is throughput; when none
waits the batch drains, and a token counts by the seconds it cuts from finishing the batch
(:meth:`SpeculationController.worth`): in a closed batch whose sequences all need the same number of
steps, drafts for one of them make every step dearer and finish nothing sooner; and since the batch
ends with its slowest sequence, a plan for several is checked over the outcomes, not at each one's
expected tokens (:meth:`SpeculationController.expected_worth`). It decides twice:
before drafting (draft cost counts) and after (drafts are sunk; a draft shorter than asked caps the
length). A sequence left at k = 0 learns nothing from verification, so it keeps learning in one of
two ways:

* **shadow drafts**, where drafting is cheap and touches no cache (n-gram lookup): the proposer
  is asked anyway, the draft is not verified, and as the target's tokens arrive the draft is
  scored against them. That is exactly what verification would have kept, greedy or sampled: a
  verify keeps a deterministic draft while it equals the target's own draw at each position
  (``sampling.PositionNoise``), and those draws are the tokens that arrive. So the estimate stays
  current for free.
* **probes** otherwise: after ``probe_interval`` decode steps without drafts the sequence is given
  ``probe_length`` drafts anyway; each probe after which drafts still do not pay for the sequence
  on its own (a hit now and then is not enough when a draft position is dear) doubles the wait.
  The wait is also long enough that probes cost at most ``probe_budget`` of the time: a probe that
  adds ``x`` seconds to a step of ``t`` waits at least ``x / (probe_budget * t)`` steps, so a dear probe
  (a whole tree for a batch of 4) comes rarely and a cheap one often.

**Token trees** (``draft_tree`` with ``adaptive``): the tree is the largest shape; the chains its
depth allows are the smaller ones. Each step the controller compares the chain plan above with
verifying the whole tree for every decoding sequence (:meth:`SpeculationController.tree_pays`): a
tree's expected tokens per verify are a decayed mean of its accepted root paths per sequence
(:class:`TreeRecord`; before any, the engine-wide mean, and before that the chain estimate at the
tree's depth, which a tree never does worse than), its cost the forward of every node plus the
measured seconds of a tree draft. A tree left unused for ``probe_interval`` steps (and the probe
budget's wait) is verified once anyway, and each probe that gains less than its chain would have
doubles the wait. A verified tree also tells the chain estimate what its first-child chain (the
draft's best guess at each level) would have kept, so the chain plan stays current while trees win.

The choice changes speed only: verification is exact whatever length is chosen, so greedy
output is identical to no speculation and sampling keeps the target's distribution.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .draining import expected_saving, finish_seconds
from .forward_cost import ForwardCost
from .lookup_gate import LookupGate


@dataclass
class Acceptance:
    """Decayed counts of accepted / tried per draft position (conditional on the earlier ones).

    A position's rate leans on the one before it with the weight of ``prior_weight`` observations
    (the first on ``prior_rate``): a position not tried yet is taken to behave like its
    predecessor, and a few observations override that."""

    hits: list[float]
    tries: list[float]
    prior_rate: float = 0.5
    prior_weight: float = 1.0
    decay: float = 0.9

    @classmethod
    def prior(cls, positions: int, rate: float, weight: float = 1.0, decay: float = 0.9) -> "Acceptance":
        return cls([0.0] * positions, [0.0] * positions, rate, weight, decay)

    def rates(self) -> list[float]:
        out, before = [], self.prior_rate
        for h, t in zip(self.hits, self.tries):
            if t + self.prior_weight > 0:
                before = (h + self.prior_weight * before) / (t + self.prior_weight)
            out.append(before)
        return out

    def update(self, drafted: int, accepted: int) -> None:
        """``accepted`` of ``drafted`` drafts were kept: positions up to the first miss were tried."""
        for i in range(min(accepted + 1, drafted)):
            self.hits[i] = self.decay * self.hits[i] + (1.0 if i < accepted else 0.0)
            self.tries[i] = self.decay * self.tries[i] + 1.0

    def gains(self, k: int) -> list[float]:
        """Expected tokens drafts 1..k each add: the chance that it and all before it are accepted."""
        out, p = [], 1.0
        for r in self.rates()[:k]:
            p *= r
            out.append(p)
        return out

    def expected_tokens(self, k: int) -> float:
        """Tokens one verify with ``k`` drafts adds: 1 + the expected accepted prefix."""
        return 1.0 + sum(self.gains(k))

    def copy(self, max_weight: float, decay: float) -> "Acceptance":
        """A new sequence's start: these rates, each position weighted as at most ``max_weight``
        observations."""
        scale = [min(1.0, max_weight / t) if t > 0 else 1.0 for t in self.tries]
        return Acceptance([h * s for h, s in zip(self.hits, scale)], [t * s for t, s in zip(self.tries, scale)],
                          self.prior_rate, self.prior_weight, decay)


@dataclass
class SequenceRecord:
    """What the controller knows of one sequence."""

    acceptance: Acceptance  # every draft of the sequence
    idle_steps: int = 0  # consecutive decode steps without drafts
    probe_interval: int = 0  # idle steps before the next probe (doubles after each probe that fails)
    # unverified drafts waiting for their tokens: (sequence length then, tokens, their evidence class)
    shadows: list[tuple[int, list[int], int | None]] = field(default_factory=list)
    by_evidence: dict[int, Acceptance] = field(default_factory=dict)  # the drafts of each evidence class


@dataclass
class TreeRecord:
    """Tokens per tree verify (1 + the accepted root path), a decayed mean; None before any."""

    tokens: float | None = None
    decay: float = 0.9

    def update(self, tokens: float) -> None:
        self.tokens = tokens if self.tokens is None else self.decay * self.tokens + (1 - self.decay) * tokens


class SpeculationController:
    """Chooses each step's draft lengths (see the module docstring).

    ``max_drafts``: the longest draft any sequence gets. ``forward_cost``: the target's
    :class:`ForwardCost`. ``prior_rate``: the acceptance assumed before any observation (even odds,
    so speculation is tried). ``decay``/``global_decay``: how fast a sequence's / the engine-wide
    estimate forgets; ``start_weight``: how many observations of the engine-wide estimate a new
    sequence starts with; ``probe_budget``: the share of time probes may cost (None: no bound).
    """

    def __init__(self, max_drafts: int, forward_cost: ForwardCost, *, prior_rate: float = 0.5,
                 decay: float = 0.9, global_decay: float = 0.98,
                 start_weight: float = 4.0, probe_interval: int = 16, probe_length: int = 2,
                 probe_budget: float | None = 0.03):
        if max_drafts < 1:
            raise ValueError(f"max_drafts must be >= 1; got {max_drafts}")
        self.max_drafts = max_drafts
        self.forward_cost = forward_cost
        self.prior_rate, self.global_decay = prior_rate, global_decay
        self.global_acceptance = Acceptance.prior(max_drafts, prior_rate, decay=global_decay)
        self.global_by_evidence: dict[int, Acceptance] = {}
        self.decay, self.start_weight = decay, start_weight
        self.probe_interval, self.probe_length, self.probe_budget = probe_interval, probe_length, probe_budget
        self.draft_seconds_per_position = 0.0  # per propose call, per drafted position (batched)
        self._draft_samples = 0
        self.records: dict[int, SequenceRecord] = {}
        self.probes: set[int] = set()  # sequences the last plan before drafting gave drafts only to re-probe
        self.last_rate = 0.0  # expected tokens per second of the last plan
        self.last_saving = 0.0  # seconds the last plan expects to save over its floors' (plain decoding's) step
        self.lookups = LookupGate()  # whether free drafts are looked up this step (runtime/lookup_gate.py)
        # token trees: per-sequence and engine-wide tokens per verify, a tree draft's seconds, and probes
        self.trees: dict[int, TreeRecord] = {}
        self.global_tree = TreeRecord(decay=global_decay)
        self.tree_draft_seconds = 0.0
        self.tree_idle_steps = 0
        self.tree_probe_interval = probe_interval
        self._probing_tree = False

    def engine_wide(self) -> dict:
        """A copy of the engine-wide estimates (acceptance overall and per evidence class, tokens per tree
        verify): what every new sequence starts from (:meth:`forget_acceptance` can return to it)."""
        return copy.deepcopy(dict(acceptance=self.global_acceptance, by_evidence=self.global_by_evidence,
                                  tree=self.global_tree))

    def forget_acceptance(self, start: dict | None = None) -> None:
        """Forget every sequence's estimates, and set the engine-wide ones to ``start`` (an
        :meth:`engine_wide` copy: a served engine's state after earlier traffic) or, by default, to the
        prior. Costs are kept; what lookups saved is forgotten (the lookup gate learns it again in its first
        ``min_looks`` looks: a served engine's savings came from other batches, and on chat at batch 4 the
        savings its warm-up had seen held the gate open through a batch whose looks saved nothing)."""
        start = copy.deepcopy(start) if start is not None else dict(
            acceptance=Acceptance.prior(self.max_drafts, self.prior_rate, decay=self.global_decay), by_evidence={},
            tree=TreeRecord(decay=self.global_decay))
        self.global_acceptance, self.global_by_evidence = start["acceptance"], start["by_evidence"]
        self.global_tree = start["tree"]
        self.records.clear()
        self.trees.clear()
        self.lookups.forget()

    # ---------------------------------------------------------------- decisions
    def record(self, request_id: int) -> SequenceRecord:
        rec = self.records.get(request_id)
        if rec is None:
            acc = self.global_acceptance.copy(self.start_weight, self.decay)
            rec = self.records[request_id] = SequenceRecord(acc, probe_interval=self.probe_interval)
        return rec

    def acceptance(self, request_id: int, evidence: int | None = None) -> Acceptance:
        """The sequence's acceptance estimate for drafts of this evidence class (None: of all its drafts).
        A class the sequence has not drafted in starts from the engine-wide estimate of that class."""
        rec = self.record(request_id)
        if evidence is None:
            return rec.acceptance
        own = rec.by_evidence.get(evidence)
        if own is None:
            shared = self.global_by_evidence.setdefault(
                evidence, Acceptance.prior(self.max_drafts, self.prior_rate, decay=self.global_decay))
            own = rec.by_evidence[evidence] = shared.copy(self.start_weight, self.decay)
        return own

    def _learn(self, request_id: int, evidence: int | None, drafted: int, accepted: int) -> None:
        """``accepted`` of ``drafted`` drafts were (or would have been) kept: the sequence's and the engine-wide
        estimates learn it, overall and for the drafts' evidence class."""
        self.acceptance(request_id, evidence).update(drafted, accepted)
        if evidence is not None:
            self.global_by_evidence[evidence].update(drafted, accepted)
            self.record(request_id).acceptance.update(drafted, accepted)
        self.global_acceptance.update(drafted, accepted)

    def plan(self, request_ids: Sequence[int], caps: Sequence[int], other_tokens: int,
             drafting_cost: bool = True, floors: Sequence[int] | None = None, probe: bool = True,
             remaining: Sequence[int] | None = None, evidence: Sequence[int | None] | None = None) -> list[int]:
        """Draft lengths for the decoding sequences ``request_ids`` (each between its floor and cap).

        ``other_tokens``: stream tokens in the step besides the decodes' own (prefill chunks).
        ``drafting_cost``: count the proposer's time and re-probe idle sequences (before drafting,
        unless ``probe`` is off: shadow drafts keep the estimates current, and a sequence with no
        observation yet, its own or inherited, waits for one); after drafting the time is spent,
        and ``floors`` keeps the probes' drafts. ``remaining``: each sequence's tokens left to its limit,
        given when the batch drains (``other_tokens`` is then 0; see :meth:`worth`). ``evidence``: each
        sequence's draft's evidence class, when the drafts are known (see the module docstring).
        """
        recs = [self.record(r) for r in request_ids]
        rates = [self.acceptance(r, e) for r, e in zip(request_ids, evidence or [None] * len(request_ids))]
        caps = [max(0, min(c, self.max_drafts)) for c in caps]
        if not probe:  # shadow drafts will tell: verify nothing on the prior alone
            caps = [c if acc.tries[0] > 0 else 0 for acc, c in zip(rates, caps)]
        ks = [min(f, c) for f, c in zip(floors or [0] * len(caps), caps)]
        floor_ks = list(ks)
        per_position = self.draft_seconds_per_position if drafting_cost else 0.0
        base = other_tokens + len(recs) + sum(ks)
        curves = [acc.gains(cap) for acc, cap in zip(rates, caps)]
        tokens = [1.0 + sum(c[:k]) for c, k in zip(curves, ks)]
        worth = self.worth(remaining)
        # A sequence's next draft adds prod(rates up to it) tokens, which never grows with its
        # length: taking the largest such gain first gives the most tokens for every stream size.
        # Walk the stream sizes in that order and keep the best worth per second seen.
        best_rate, best = -1.0, list(ks)
        extra = 0
        # Stop once no larger plan can win: none is worth more than taking every draft (worth never falls
        # as tokens grow) or costs less than the cheapest larger stream (drafting counted at today's
        # longest draft, which only grows). On chat at batch 4 that ends the walk at the plain plan.
        ceiling = worth([t + sum(c[k:]) for t, c, k in zip(tokens, curves, ks)])
        cheapest = self._cheapest_from(base, sum(caps) - sum(ks))
        while True:
            seconds = self._plan_seconds(base + extra, ks, per_position)
            rate = worth(tokens) / seconds if seconds > 0 else float("inf")
            if rate > best_rate * (1 + 1e-9):
                best_rate, best = rate, list(ks)
            gains = [(curves[i][k], i) for i, (k, cap) in enumerate(zip(ks, caps)) if k < cap]
            if not gains:
                break
            floor_seconds = cheapest[extra + 1] + per_position * max(ks, default=0)
            if floor_seconds > 0 and ceiling / floor_seconds <= best_rate * (1 + 1e-9):
                break
            gain, i = max(gains)
            ks[i] += 1
            tokens[i] += gain
            extra += 1
        # the walk read each sequence's expected tokens: exact for one sequence, not for several (expected_worth)
        exact = remaining is not None and len(recs) > 1 and best != floor_ks

        worths: dict[tuple[int, ...], float] = {}  # (the exact worth is dear: each plan's once)

        def worth_of(plan: list[int]) -> float:
            key = tuple(plan)
            if key not in worths:
                gains = [c[:k] for c, k in zip(curves, plan)]
                worths[key] = self.expected_worth(remaining, gains) if exact else worth([1.0 + sum(g) for g in gains])
            return worths[key]

        def seconds_of(plan: list[int]) -> float:
            return self._plan_seconds(other_tokens + len(recs) + sum(plan), plan, per_position)

        if exact and worth_of(best) / seconds_of(best) <= worth_of(floor_ks) / seconds_of(floor_ks):
            best, best_rate = floor_ks, worth_of(floor_ks) / seconds_of(floor_ks)
        ks = best
        self.last_rate = best_rate
        self.last_saving = self._saving(ks, floor_ks, worth_of, seconds_of, len(recs), worth) if ks != floor_ks else 0.0
        self.probes = set()
        if not (drafting_cost and probe):  # after drafting (or with shadows) nothing is probed
            return ks
        plain = other_tokens + len(recs) + sum(ks)
        probe_extra = (self.forward_cost(plain + self.probe_length) - self.forward_cost(plain)
                       + per_position * max(0, self.probe_length - max(ks, default=0)))
        stretch = self._probe_stretch(probe_extra, self.forward_cost(plain))
        for i, (rec, cap) in enumerate(zip(recs, caps)):
            if ks[i] == 0 and cap > 0 and rec.idle_steps + 1 >= rec.probe_interval * stretch:
                ks[i] = min(cap, self.probe_length)  # re-probe a sequence speculation was turned off for
                self.probes.add(request_ids[i])
        return ks

    def _saving(self, plan: list[int], floor: list[int], worth_of: Callable[[list[int]], float],
                seconds_of: Callable[[list[int]], float], decodes: int,
                worth: Callable[[Sequence[float]], float]) -> float:
        """Seconds ``plan`` is expected to save over ``floor`` (the lookup gate's measure of a look): what plain
        decode steps of these ``decodes`` sequences would take to make its extra worth, less its extra seconds.
        Priced at a plain decode step's rate, not at this step's: beside a prefill chunk a step's rate is low,
        and at it a draft worth half a token read as a saving of several decode steps."""
        plain_worth = worth([1.0] * decodes)
        if plain_worth <= 0:
            return 0.0
        plain_seconds = self._plan_seconds(decodes, [0] * decodes, 0.0)
        extra_worth = worth_of(plan) - worth_of(floor)
        return extra_worth * plain_seconds / plain_worth - (seconds_of(plan) - seconds_of(floor))

    def _cheapest_from(self, base: int, extra: int) -> list[float]:
        """``out[e]``: the least :meth:`_plan_seconds` reads a forward of ``base + e'`` tokens to cost over
        ``e' >= e`` (up to ``base + extra``), drafting aside."""
        out = [self.forward_cost.optimistic(base + e) for e in range(extra + 1)] + [float("inf")]
        for e in range(extra - 1, -1, -1):
            out[e] = min(out[e], out[e + 1])
        return out

    def _plan_seconds(self, stream: int, lengths: Sequence[int], per_position: float) -> float:
        """What planning reads a step of ``stream`` tokens with these draft lengths to cost."""
        return self.forward_cost.optimistic(stream) + per_position * max(lengths, default=0)

    def tree_tokens(self, request_id: int, depth: int) -> float:
        """Expected tokens one tree verify adds to this sequence (see the module docstring)."""
        own = self.trees.get(request_id)
        if own is not None and own.tokens is not None:
            return own.tokens
        if self.global_tree.tokens is not None:
            return self.global_tree.tokens
        return self.record(request_id).acceptance.expected_tokens(depth)

    def tree_pays(self, request_ids: Sequence[int], depths: Sequence[int], nodes: int, other_tokens: int,
                  chain_rate: float, remaining: Sequence[int] | None = None) -> bool:
        """Whether verifying a tree of ``nodes`` drafts (for each sequence, at most ``depths`` deep) for every
        decoding sequence beats ``chain_rate`` (the chain plan's worth per second, ``remaining`` as given to
        it); a tree unused for ``tree_probe_interval`` steps is tried anyway (a probe)."""
        tokens = [self.tree_tokens(r, d) for r, d in zip(request_ids, depths)]
        stream = other_tokens + len(request_ids) * (1 + nodes)
        seconds = self.forward_cost.optimistic(stream) + self.tree_draft_seconds
        self._probing_tree = False
        if seconds > 0 and self.worth(remaining)(tokens) / seconds > chain_rate:
            self.tree_idle_steps = 0
            return True
        self.tree_idle_steps += 1
        plain = self.forward_cost(other_tokens + len(request_ids))
        extra = self.forward_cost(stream) + self.tree_draft_seconds - plain
        if self.tree_idle_steps >= self.tree_probe_interval * self._probe_stretch(extra, plain):
            self.tree_idle_steps, self._probing_tree = 0, True
            return True
        return False

    def worth(self, remaining: Sequence[int] | None) -> Callable[[Sequence[float]], float]:
        """What one step's expected tokens per sequence are worth.

        While requests wait (``remaining`` None), every token is throughput: worth its count. When the
        batch drains (no request waits and the step has no prefill: its decodes are all the work left),
        a token is worth the seconds it cuts from finishing them. With ``r`` tokens left per sequence
        and the forward cost ``c`` by stream size, plain decoding finishes in ``T(r) = sum_j (r_(j) -
        r_(j-1)) * c(n - j + 1)`` over ``r`` sorted ascending (the batch shrinks as sequences end), and
        a plan's worth is ``T(r) - T(r - tokens)``: drafts for one of several sequences tied at the longest
        remaining length cut almost nothing, for the one that finishes last a whole step per token."""
        if remaining is None:
            return sum
        costs = self._batch_costs(len(remaining))
        now = finish_seconds(remaining, costs)
        return lambda tokens: now - finish_seconds([r - t for r, t in zip(remaining, tokens)], costs)

    def _batch_costs(self, n: int) -> list[float]:
        """``out[j]``: a plain decode step of ``j`` sequences, ``j = 0..n``."""
        return [0.0] + [self.forward_cost(j) for j in range(1, n + 1)]

    def expected_worth(self, remaining: Sequence[int], gains: Sequence[Sequence[float]]) -> float:
        """:meth:`worth` of a draining step, over the outcomes rather than at each sequence's expected tokens
        (:func:`~.draining.expected_saving`; ``gains[i]``: sequence i's drafts' gains, :meth:`Acceptance.gains`
        of its chosen length)."""
        return expected_saving(remaining, gains, self._batch_costs(len(remaining)))

    def _probe_stretch(self, extra_seconds: float, step_seconds: float) -> float:
        """How many times ``probe_interval`` a probe that adds ``extra_seconds`` to a step of ``step_seconds``
        waits, so that probing costs at most ``probe_budget`` of the time (at least once the interval)."""
        if self.probe_budget is None or step_seconds <= 0:
            return 1.0
        return max(1.0, extra_seconds / (self.probe_budget * step_seconds) / self.probe_interval)

    def observe_tree_draft(self, seconds: float) -> None:
        """A propose_tree call (every tree of the step) took ``seconds``."""
        self.tree_draft_seconds += 0.3 * (seconds - self.tree_draft_seconds) if self.tree_draft_seconds else seconds

    def observe_tree(self, request_id: int, depth: int, accepted: int) -> None:
        """A tree verify of the sequence kept a root path of ``accepted`` drafts; a probe that gained less
        than the chain of the tree's depth would have doubles the wait for the next one."""
        chain = self.record(request_id).acceptance.expected_tokens(depth)
        self.trees.setdefault(request_id, TreeRecord(decay=self.decay)).update(1 + accepted)
        self.global_tree.update(1 + accepted)
        if self._probing_tree:
            self.tree_probe_interval = self.probe_interval if 1 + accepted >= chain else 2 * self.tree_probe_interval

    # -------------------------------------------------------------- observations
    def observe_draft(self, seconds: float, longest: int) -> None:
        """A propose call took ``seconds`` for drafts of at most ``longest`` positions."""
        if longest <= 0:
            return
        sample = seconds / longest
        if self._draft_samples >= 3:  # a draft model's first call on a request also reads its prompt
            sample = min(sample, 2.0 * self.draft_seconds_per_position)
        self._draft_samples += 1
        w = max(0.2, 1.0 / self._draft_samples)
        self.draft_seconds_per_position += w * (sample - self.draft_seconds_per_position)

    def observe_forward(self, stream_tokens: int, seconds: float) -> None:
        """A decode/verify step (no prefill chunk in it) of ``stream_tokens`` took ``seconds``, drafting aside (its
        scheduling, metadata, forward, and the sampling or verification after it)."""
        self.forward_cost.observe(stream_tokens, seconds)

    def observe_decode(self, request_id: int, drafted: int, accepted: int, evidence: int | None = None) -> None:
        """One decode step of a sequence: ``drafted`` drafts (of that evidence class) verified, ``accepted`` kept."""
        rec = self.record(request_id)
        if drafted:
            self._learn(request_id, evidence, drafted, accepted)
            if rec.idle_steps + 1 >= rec.probe_interval:  # a probe: back off unless drafts pay again now
                rec.probe_interval = self.probe_interval if self._drafts_pay(rec.acceptance) else 2 * rec.probe_interval
            rec.idle_steps = 0
        else:
            rec.idle_steps += 1

    def _drafts_pay(self, acceptance: Acceptance) -> bool:
        """Whether some draft length beats a plain decode for one sequence on its own (drafting counted)."""
        plain = 1.0 / self.forward_cost(1)
        return any(acceptance.expected_tokens(k) / (self.forward_cost(1 + k) + self.draft_seconds_per_position * k)
                   > plain for k in range(1, self.max_drafts + 1))

    def wants_shadow(self, request_id: int) -> bool:
        """Whether to draft for this sequence without verifying (see the module docstring): fewer than
        ``max_drafts`` shadow drafts wait (each waits at most that many steps), and drafting a position
        costs under 2% of a 1-token forward. Every step's draft is a sample of what a verify would have
        kept at that step, so each one that is scored teaches the estimate."""
        return (len(self.record(request_id).shadows) < self.max_drafts
                and self.draft_seconds_per_position <= 0.02 * self.forward_cost(1))

    def shadow(self, request_id: int, length: int, tokens: list[int], evidence: int | None = None) -> None:
        """An unverified draft (of that evidence class) of the tokens after the first ``length`` of the sequence."""
        if tokens:
            self.record(request_id).shadows.append((length, list(tokens), evidence))

    def has_shadow(self, request_id: int) -> bool:
        """A shadow draft of the sequence waits for its tokens (so :meth:`score_shadow` needs them)."""
        rec = self.records.get(request_id)
        return rec is not None and bool(rec.shadows)

    def score_shadow(self, request_id: int, token_ids: Sequence[int]) -> None:
        """Score the pending shadow drafts against the sequence's tokens so far, each once decided."""
        rec = self.records.get(request_id)
        if rec is None:
            return
        waiting = []
        for start, draft, evidence in rec.shadows:
            seen = token_ids[start:start + len(draft)]
            matched = 0
            while matched < len(seen) and seen[matched] == draft[matched]:
                matched += 1
            if matched < len(seen) or len(seen) == len(draft):  # a miss, or every draft token matched
                self._learn(request_id, evidence, len(draft), matched)
            else:
                waiting.append((start, draft, evidence))
        rec.shadows = waiting

    def release(self, request_id: int) -> None:
        self.records.pop(request_id, None)
        self.trees.pop(request_id, None)
