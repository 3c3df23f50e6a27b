"""Speculative decoding: greedy output unchanged for every proposer; sampled output unchanged with
deterministic drafts; sampling with a draft model's sampled drafts keeps the target's distribution
(chi-square against exact marginals), and a wrong acceptance rule is caught."""
import functools

import pytest
import torch

import specgraph
import specgraph.runtime.drafting as drafting_module
from specgraph.runtime import rejection
from models import make_family, tiny_llama
from models import random_prompts as _prompts


def _repetitive(family, n=4):
    """Prompts with repeats so prompt lookup finds matches."""
    base = _prompts(family, (6,), seed=11)[0]
    return [(base * 5)[: 20 + i] for i in range(n)]


@pytest.mark.parametrize("family", ["llama", "gpt2", "nanogpt", "sdpa_gqa"])
@pytest.mark.parametrize("draft", ["ngram", "layer_skip:1", "model"])
def test_greedy_speculation_is_lossless(family, draft):
    target = make_family(family)
    drafter = make_family(family, seed=1) if draft == "model" else draft
    plain = specgraph.Engine(target, num_blocks=64, page_size=8)
    spec = specgraph.Engine(target, num_blocks=64, page_size=8, draft=drafter, num_draft_tokens=3,
                            adaptive=False)  # every step drafts: the proposer's own acceptance shows
    for prompts in (_repetitive(family, 1), _repetitive(family, 4)):  # batch 1 and batch 4
        want = [r.token_ids for r in plain.generate(prompts, max_new_tokens=14, ignore_eos=True)]
        got = [r.token_ids for r in spec.generate(prompts, max_new_tokens=14, ignore_eos=True)]
        assert got == want
    stats = spec.stats
    assert stats["draft_tokens"] > 0 and 0.0 <= stats["acceptance_rate"] <= 1.0
    assert stats["mean_accepted_tokens"] >= 1.0
    if draft == "layer_skip:1":
        assert stats["acceptance_rate"] > 0  # the first layer of the target agrees sometimes


@pytest.mark.parametrize("shape", [dict(num_draft_tokens=3, adaptive=False), dict(draft_tree="static:2,1,1", adaptive=False),
                                   dict(num_draft_tokens=4, adaptive=True)])
def test_sampled_speculation_with_deterministic_drafts_is_plain_sampling(shape):
    """The target draws each position's token from that position's own uniform, so verifying n-gram drafts
    (a chain, a tree, or whatever the controller picks) emits the tokens plain sampling with the same seed
    does: only the forwards per token change."""
    target = make_family("llama")
    plain = specgraph.Engine(target, num_blocks=64, page_size=8)
    spec = specgraph.Engine(target, num_blocks=64, page_size=8, draft="ngram", **shape)
    for prompts in (_repetitive("llama", 1), _repetitive("llama", 4)):
        for seed in (0, 1):
            kw = dict(max_new_tokens=16, ignore_eos=True, temperature=0.2, top_p=0.95, seed=seed)
            want = [r.token_ids for r in plain.generate(prompts, **kw)]
            assert [r.token_ids for r in spec.generate(prompts, **kw)] == want
    assert 0 < spec.stats["acceptance_rate"] < 1  # drafts were kept and rejected: verifies emitted 1..k+1 tokens


@pytest.mark.parametrize("temperature", [0.0, 0.2])
def test_logprobs_of_verified_tokens_are_plain_decodings(temperature):
    """A request that returns logprobs reads its rows whole (runtime/step_logits.py): through verifies of
    n-gram drafts its tokens and each one's log p and top alternatives are plain decoding's."""
    target = make_family("llama")
    plain = specgraph.Engine(target, num_blocks=64, page_size=8)
    spec = specgraph.Engine(target, num_blocks=64, page_size=8, draft="ngram", num_draft_tokens=3, adaptive=False)
    outputs = []
    for engine in (plain, spec):
        requests = [r for p in _repetitive("llama", 2) for r in engine.submit(
            p, max_new_tokens=12, ignore_eos=True, temperature=temperature, seed=5, logprobs=2)]
        while not all(r.finished for r in requests):
            engine.step()
        outputs.append([(r.output_ids, r.output_logprobs) for r in requests])
    (want, got) = outputs
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    for (_, lp_got), (ids, lp_want) in zip(got, want):
        assert len(lp_got) == len(ids)
        for (p_got, top_got), (p_want, top_want) in zip(lp_got, lp_want):
            assert p_got == pytest.approx(p_want, abs=1e-5)
            assert [t for t, _ in top_got] == [t for t, _ in top_want]
    assert spec.stats["draft_tokens"] > 0 and spec.stats["acceptance_rate"] > 0


@pytest.mark.parametrize("temperature", [0.0, 0.3])
def test_tokens_picked_as_on_a_device_are_the_engines_own(monkeypatch, temperature):
    """The engine's path for logits on a GPU (runtime/step_logits.py: tokens picked there, rows brought back only
    for logprobs or a sampled draft's rejection), run on the CPU: plain decoding, n-gram chains and trees, a
    draft model's drafts and a logprobs request give the tokens (and log p) of the engine's CPU path."""
    from specgraph.runtime import engine as engine_module, step_logits

    def as_on_a_device(logits, wanted):
        starts = [0]
        for w in wanted:
            starts.append(starts[-1] + w.count)
        return step_logits.rows_from_device(logits, wanted, starts)

    target = make_family("llama")
    configs = {"plain": {}, "chain": dict(draft="ngram", num_draft_tokens=3), "tree": dict(draft="ngram",
               draft_tree="static:2,1,1"), "model": dict(draft=make_family("llama", seed=1), num_draft_tokens=2)}
    prompts = _repetitive("llama", 3)
    kw = dict(max_new_tokens=12, ignore_eos=True, temperature=temperature, seed=4)

    # one engine per configuration runs both paths (no prefix cache: the second run's steps are the first's)
    engines = {name: specgraph.Engine(target, num_blocks=64, page_size=8, adaptive=False, prefix_caching=False,
                                      **config) for name, config in configs.items()}

    def run(name):
        engine = engines[name]
        engine.reset_stats()
        out = [r.token_ids for r in engine.generate(prompts, **kw)]
        (scored,) = engine.submit(prompts[0], logprobs=2, **{k: v for k, v in kw.items() if k != "seed"})
        while not scored.finished:
            engine.step()
        return out, scored.output_ids, [round(p, 5) for p, _ in scored.output_logprobs], engine.stats["draft_tokens"]

    want = {name: run(name) for name in configs}
    monkeypatch.setattr(engine_module, "host_rows", as_on_a_device)
    for name in configs:
        got = run(name)
        assert got[:3] == want[name][:3], name
        assert name == "plain" or got[3] > 0, name  # drafts were verified


def test_draft_vocabulary_mismatch_is_a_clear_error():
    target = tiny_llama(vocab=128)
    with pytest.raises(ValueError, match="vocabulary"):
        specgraph.Engine(target, num_blocks=16, page_size=8, draft=tiny_llama(vocab=100))


def test_unknown_draft_spec_lists_valid_ones():
    with pytest.raises(ValueError, match="layer_skip:K"):
        specgraph.Engine(tiny_llama(), num_blocks=16, page_size=8, draft="medusa-ish")


def test_a_new_draft_kind_is_one_registration():
    """A kind registered with ``register_proposer`` is built from its spec with the narrow context
    (the target's program among it) and runs like the built-in ones; it shows in the valid specs."""
    from specgraph.runtime.proposers import DraftContext, Draft, make_proposer, register_proposer, specs

    seen = {}

    class Repeat:  # drafts the last committed token k times
        name, writes_cache = "repeat", False

        def propose(self, requests):
            return [Draft([r.token_ids[-1]] * r.k) for r in requests]

        def on_verified(self, request_id, num_committed):
            pass

        def release(self, request_id):
            pass

    def factory(arg: str, ctx: DraftContext):
        seen["arg"], seen["vocab"] = arg, ctx.program.vocab_size
        return Repeat()

    register_proposer("repeat", factory, "repeat:N")
    try:
        model = tiny_llama(vocab=128)
        spec = specgraph.Engine(model, num_blocks=32, page_size=8, draft="repeat:2", adaptive=False)
        assert seen == {"arg": "2", "vocab": 128} and spec.proposer.name == "repeat" and "repeat:N" in specs()
        prompts = _prompts("llama", (5, 9), seed=2)
        plain = specgraph.Engine(model, num_blocks=32, page_size=8)
        assert ([r.token_ids for r in spec.generate(prompts, max_new_tokens=8)]
                == [r.token_ids for r in plain.generate(prompts, max_new_tokens=8)])
        assert spec.stats["draft_tokens"] > 0
        with pytest.raises(ValueError, match="draft_weight_dtype='int8' needs a draft model"):
            make_proposer(Repeat(), DraftContext(model, spec.program, spec.kv, spec.kv_cache, 8, 32, 31,
                                                 torch.device("cpu"), weight_dtype="int8"))
    finally:
        from specgraph.runtime import proposers

        proposers._KINDS.pop("repeat", None)


# --------------------------------------------------------------------------- distribution test
V = 8


def _peaky(seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False,
                      use_cache=False)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(25.0)  # distributions far from uniform, so a biased sampler shows
    return m


def _exact_marginals(model, prompt, positions):
    """Exact distribution of generated tokens 1..positions by enumeration (V ** (positions-1) prefixes)."""
    with torch.no_grad():
        probs = {(): 1.0}
        marginals = []
        for _ in range(positions):
            prefixes = list(probs)
            ids = torch.tensor([prompt + list(p) for p in prefixes])
            nxt = torch.softmax(model(ids).logits[:, -1].float(), -1)
            marginal = torch.zeros(V)
            new = {}
            for i, p in enumerate(prefixes):
                marginal += probs[p] * nxt[i]
                for t in range(V):
                    new[p + (t,)] = probs[p] * float(nxt[i, t])
            marginals.append(marginal)
            probs = new
    return marginals


def _chi2_stat(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum()
    keep = probs * n >= 5  # pool rare cells so the chi-square approximation holds
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)]) if (~keep).any() else counts[keep]
    exp = torch.cat([probs[keep] * n, (probs[~keep].sum() * n).view(1)]) if (~keep).any() else probs[keep] * n
    stat = float(((obs - exp) ** 2 / exp.clamp_min(1e-9)).sum())
    return stat, len(obs) - 1


# chi-square critical values at p = 1e-4 for dof 1..7: a correct sampler fails 1 run in 10^4
CRITICAL = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}


def _sample_tokens(target, drafter, prompt, n, seed):
    engine = specgraph.Engine(target, num_blocks=n + 8, page_size=8, max_num_seqs=n,
                              max_tokens_per_step=n * (len(prompt) + 4), draft=drafter, num_draft_tokens=2,
                              adaptive=False, prefix_caching=False)  # every step verifies: the rule is tested
    results = engine.generate([prompt] * n, max_new_tokens=3, temperature=1.0, seed=seed, ignore_eos=True)
    assert engine.stats["draft_tokens"] > 0
    return torch.tensor([r.token_ids for r in results])


def _passes(tokens, marginals):
    for pos in (1, 2):  # tokens produced by speculative verification steps
        counts = torch.bincount(tokens[:, pos], minlength=V).float()
        stat, dof = _chi2_stat(counts, marginals[pos])
        if stat > CRITICAL[dof]:
            return False
    return True


@pytest.fixture(scope="module")
def peaky_pair():
    target, drafter = _peaky(0), _peaky(1)
    prompt = [1, 5, 2, 7]
    return target, drafter, prompt, _exact_marginals(target, prompt, 3)


def test_speculative_sampling_keeps_target_distribution(peaky_pair):
    target, drafter, prompt, marginals = peaky_pair
    tokens = _sample_tokens(target, drafter, prompt, 3000, seed=1)
    assert _passes(tokens, marginals)


def test_wrong_acceptance_rule_is_detected(peaky_pair, monkeypatch):
    target, drafter, prompt, marginals = peaky_pair
    always_accept = functools.partial(rejection.verify_sampling, accept_rule=lambda p, q: 1.0)
    monkeypatch.setattr(drafting_module, "verify_sampling", always_accept)
    tokens = _sample_tokens(target, drafter, prompt, 3000, seed=1)
    assert not _passes(tokens, marginals)
