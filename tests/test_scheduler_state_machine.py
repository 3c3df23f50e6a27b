"""Hypothesis state machine over the real Engine, Scheduler, KVCacheManager and prefix cache.

The model is replaced by a *hash-chain decoder*: the "K/V" a token writes to its cache slot is
``chain(value at position p - 1, token)``, read through the block table exactly as attention
reads the cache, and the greedy next token is ``value % VOCAB``. So a cache slot holds the right
value only if every earlier slot of that sequence did, and a sequence whose cache was overwritten
by another's, copied wrongly or served a wrong prefix hit produces different tokens. Everything
the runtime does (admission, prefix hits, eviction, preemption, forks with copy-on-write,
speculative drafts and rollback, cancellation) runs for real; only the forward is a few lines.

Checked after every step: reference counts equal the block-table owners, only running requests
hold blocks, no write into a shared or cached block, every running request's cached values equal
its own chain, and progress (the oldest running request gains a token; an idle pool admits). At
the end: every request finished with exactly the reference output and the pool holds only
evictable cached blocks.
"""
from __future__ import annotations

import random
from unittest import mock

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import specgraph
from specgraph.runtime.forward_cost import ForwardCost
from specgraph.runtime import engine as engine_module
from specgraph.runtime.proposers.base import Draft

VOCAB = 31
ROOT = 12345
MODULUS = (1 << 61) - 1
MAX_PROMPT, MAX_NEW = 40, 12
PREFIXES = [random.Random(i).choices(range(VOCAB), k=MAX_PROMPT) for i in range(3)]


def chain(prev: int, token: int) -> int:
    return (prev * 1_000_003 + token + 7) % MODULUS


def chain_values(tokens: list[int]) -> list[int]:
    out, v = [], ROOT
    for t in tokens:
        v = chain(v, t)
        out.append(v)
    return out


def reference(prompt: list[int], max_new: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_new):
        tokens.append(chain_values(tokens)[-1] % VOCAB)
    return tokens[len(prompt):]


class HashChainProgram:
    """Stands in for a DecoderProgram: same call signature, same cache addressing."""

    num_layers = 1
    vocab_size = VOCAB

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.kv = None  # the engine's KVCacheManager, set after the engine is built

    def kv_bytes_per_token(self) -> int:
        return 8

    recompiles = 0  # nothing is compiled: the step is plain Python
    captures = 0  # no CUDA graphs either
    buckets = ()  # no static step graphs
    compiling = False
    hot_cold = False  # one kind of page
    cache_key = None  # not in the graph cache: nothing measured is kept
    lowering = "eager"

    def compile_steps(self, kv_cache, table_width, progress=None, background=False):
        pass

    def new_kv_cache(self, num_blocks: int, device="cpu", num_cold: int = 0):
        return [(torch.full((num_blocks, self.page_size), -1, dtype=torch.int64),)]

    def __call__(self, input_ids, meta, kv_cache):
        cache, page = kv_cache[0][0].view(-1), self.page_size
        ids, pos, slots = input_ids.tolist(), meta.positions.tolist(), meta.slot_mapping.tolist()
        qsl, tables = meta.query_start_loc.tolist(), meta.block_tables.tolist()
        values = [0] * len(ids)
        for s in range(len(qsl) - 1):
            for i in range(qsl[s], qsl[s + 1]):
                p = pos[i]
                prev = ROOT if p == 0 else int(cache[tables[s][(p - 1) // page] * page + (p - 1) % page])
                block = slots[i] // page
                if self.kv is not None:  # None while the engine is being built (its cost measurement)
                    assert self.kv.block_pool.ref_count(block) == 1, f"write into shared block {block}"
                    assert self.kv.block_pool.block_key(block) is None, f"write into cached block {block}"
                values[i] = chain(prev, ids[i])
                cache[slots[i]] = values[i]
        rows = meta.logits_indices.tolist()
        logits = torch.full((len(rows), VOCAB), -1e4)
        for m, i in enumerate(rows):
            logits[m, values[i] % VOCAB] = 0.0
        return logits


class NoisyProposer:
    """Drafts the reference continuation, each token right with probability ``accept`` (else wrong)."""

    name = "noisy"

    def __init__(self, accept: float, seed: int):
        self.accept, self.rng = accept, random.Random(seed)

    def propose(self, requests):
        out = []
        for r in requests:
            k = self.rng.randint(0, r.k)  # fewer than k drafts must be fine too
            tokens = []
            for t in reference(r.token_ids, k):
                tokens.append(t if self.rng.random() < self.accept else (t + 1 + self.rng.randrange(VOCAB - 1)) % VOCAB)
            out.append(Draft(tokens))
        return out

    def on_verified(self, request_id, num_committed):
        pass

    def release(self, request_id):
        pass


class _Dummy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))


def make_engine(page_size: int, num_blocks: int, **kwargs) -> specgraph.Engine:
    program = HashChainProgram(page_size)
    with mock.patch.object(engine_module, "compile_decoder", lambda model, options, progress=None: program):
        engine = specgraph.Engine(_Dummy(), page_size=page_size, num_blocks=num_blocks, **kwargs)
    program.kv = engine.kv
    return engine


REACHED = {"examples": 0, "preemptions": 0, "evictions": 0, "cow_copies": 0, "forks": 0, "aborts": 0}


class EngineMachine(RuleBasedStateMachine):
    @initialize(page=st.sampled_from([8, 8, 16]), slack=st.sampled_from([0, 0, 1, 2, 4, 8]), max_num_seqs=st.integers(2, 8),
                budget=st.sampled_from([3, 8, 64]), speculate=st.booleans(), k=st.integers(1, 4),
                accept=st.floats(0.0, 1.0), prefix_caching=st.sampled_from([True, True, False]),
                seed=st.integers(0, 1 << 16), adaptive=st.booleans())
    def setup(self, page, slack, max_num_seqs, budget, speculate, k, accept, prefix_caching, seed, adaptive):
        fits_one = -(-(MAX_PROMPT + MAX_NEW) // page)  # the largest request, alone
        draft = NoisyProposer(accept, seed) if speculate else None
        self.engine = make_engine(page, fits_one + 1 + slack, max_num_seqs=max_num_seqs, max_tokens_per_step=budget,
                                  prefix_caching=prefix_caching, draft=draft, num_draft_tokens=k,
                                  adaptive=adaptive and speculate)
        if self.engine.controller is not None:  # decisions from acceptance only: hypothesis replays must agree
            self.engine.controller.forward_cost = ForwardCost({1: 1.0, 8: 1.3, 32: 4.0})
            self.engine.controller.observe_forward = lambda n, seconds: None
            self.engine.controller.observe_draft = lambda seconds, longest: None
        self.requests = []
        self.aborted = set()

    @rule(arrivals=st.lists(st.tuples(st.integers(-1, len(PREFIXES) - 1), st.integers(0, MAX_PROMPT),
                                      st.lists(st.integers(0, VOCAB - 1), max_size=12), st.integers(1, MAX_NEW),
                                      st.sampled_from([1, 1, 2, 3])), min_size=1, max_size=4))
    def submit(self, arrivals):
        for prefix, prefix_len, suffix, max_new, n in arrivals:
            prompt = ((PREFIXES[prefix][:prefix_len] if prefix >= 0 else []) + suffix)[:MAX_PROMPT] or [1]
            self.requests += self.engine.submit(prompt, max_new_tokens=max_new, n=n, ignore_eos=True)

    @precondition(lambda self: self.engine.has_unfinished())
    @rule()
    def step(self):
        scheduler = self.engine.scheduler
        oldest = scheduler.running[0] if scheduler.running else None
        before = oldest.num_computed if oldest else None
        finished = self.engine.step()
        if oldest is not None:
            assert oldest.finished or (oldest in scheduler.running and oldest.num_computed > before), \
                "the oldest running request made no progress"
        else:
            assert scheduler.running or finished, "an idle pool admitted nothing"

    @precondition(lambda self: any(not r.finished for r in self.requests))
    @rule(data=st.data())
    def abort(self, data):
        live = [r for r in self.requests if not r.finished]
        victim = data.draw(st.sampled_from(live))
        self.engine.abort(victim)
        self.aborted.add(victim.request_id)
        assert victim.finished

    @invariant()
    def cache_is_consistent(self):
        engine = self.engine
        engine.kv.check_invariants()
        running = {r.request_id for r in engine.scheduler.running}
        assert set(engine.kv.sequence_ids()) == running, "a request that is not running holds blocks"
        cache, page = engine.kv_cache[0][0].view(-1), engine.page_size
        for r in engine.scheduler.running:
            table = engine.kv.block_table(r.request_id)
            want = chain_values(r.all_ids[:r.num_computed])
            got = [int(cache[table[p // page] * page + p % page]) for p in range(r.num_computed)]
            assert got == want, f"request {r.request_id}: its cached K/V is not its own"

    def teardown(self):
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        bound = sum(len(r.prompt_ids) + r.max_new_tokens + 1 for r in self.requests) + 1
        for _ in range(bound):
            if not engine.has_unfinished():
                break
            engine.step()
            self.cache_is_consistent()
        assert not engine.has_unfinished(), f"no progress within {bound} steps"
        for r in self.requests:
            assert r.finished
            if r.request_id in self.aborted:
                assert r.finish_reason == "abort" and len(r.output_ids) <= r.max_new_tokens
            else:
                assert r.finish_reason == "length"
                assert r.output_ids == reference(r.prompt_ids, r.max_new_tokens), r.request_id
        assert engine.kv.usage == 0.0 and engine.stats["kv_pool_usage"] == 0.0
        assert engine.kv.num_free_blocks == engine.num_blocks - 1, "blocks leaked"
        stats = engine.stats
        REACHED["examples"] += 1
        for name in ("preemptions", "evictions", "cow_copies", "forks"):
            REACHED[name] += stats[name] > 0
        REACHED["aborts"] += bool(self.aborted)


EngineMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                                           suppress_health_check=list(HealthCheck))
TestEngineStateMachine = EngineMachine.TestCase


def test_state_machine_reached_every_mechanism(capsys):
    """Runs after the machine (file order): print how often each mechanism was reached (shown in CI)."""
    n = REACHED["examples"]
    assert n > 0, "the state machine did not run"
    with capsys.disabled():
        print("\nstate machine examples reaching each mechanism: "
              + ", ".join(f"{k} {v}/{n} ({v / n:.0%})" for k, v in REACHED.items() if k != "examples"))
    for name in ("preemptions", "evictions", "cow_copies", "forks"):
        assert REACHED[name] > 0, f"no example reached {name}: the workload does not exercise it"
