"""EAGLE heads: the training-time unrolled drafting equals the paged inference path, a tiny
``distill`` runs end to end (the loss falls, the head loads), drafting with it is lossless (greedy
identical, sampling keeps the target's distribution) and a head for another model is refused."""
import json

import pytest
import torch

import specgraph
from specgraph.compiler.program import AttentionMetadata
from specgraph.runtime.heads.base import load_head, target_vocab_weights
from specgraph.runtime.heads.distill import Recipe, distill, target_head_config
from specgraph.runtime.heads.distill_data import CODE_OPENERS
from specgraph.runtime.heads.eagle import EagleHead
from specgraph.runtime.heads.training import eagle_losses
from specgraph.runtime.proposers.learned import candidate_rows, candidates, default_head_scheme
from specgraph.runtime.token_tree import TreeBuilder, parse_tree
from specgraph.kernels import cpu_kernels
from models import VOCAB as VOCAB_OF, make_family, tiny_llama
from test_speculative import _exact_marginals, _passes, _peaky

VOCAB = 96


def _head(model, vocab, draft_vocab, seed=0):
    torch.manual_seed(seed)
    head = EagleHead(target_head_config(model, vocab, draft_vocab))
    head.draft_ids.copy_(torch.randperm(vocab)[:draft_vocab].sort().values)
    return head.attach(*target_vocab_weights(model, vocab)).eval()


def test_unrolled_training_drafts_equal_the_paged_inference_path():
    """Step j of ``unrolled`` at slot s is what inference computes when it feeds the true slots <= s and
    then its own chain (the pair of each drafted step at the next cache slot)."""
    model = tiny_llama(vocab=VOCAB)
    head = _head(model, VOCAB, 40)
    gen = torch.Generator().manual_seed(3)
    t, steps, page = 14, 3, 4
    ids = torch.randint(0, VOCAB, (1, t), generator=gen)
    feats = torch.randn(1, t, head.cfg.hidden, generator=gen)
    with torch.no_grad():
        outs = head.unrolled(ids, feats, steps)
        table = list(range(1, 8))
        for s in (0, 5, 9):
            k_cache, v_cache = head.new_cache(8, page, "cpu", torch.float32)
            prev = torch.cat([torch.zeros(1, head.cfg.hidden), feats[0, :s]])  # slot t takes f_{t-1}
            meta = AttentionMetadata.build([(table, 0, s + 1)], page, [[s]])
            g = head.forward_paged(ids[0, :s + 1], prev, meta, k_cache, v_cache)[s]
            torch.testing.assert_close(g, outs[0][0, s], atol=1e-5, rtol=1e-5)
            for j in range(1, steps):  # the chain's step j: (x_{s+j}, g_{j-1}) at slot s + j
                meta = AttentionMetadata.build([(table, s + j, 1)], page, [[0]])
                g = head.forward_paged(ids[0, s + j:s + j + 1], g[None], meta, k_cache, v_cache)[0]
                torch.testing.assert_close(g, outs[j][0, s], atol=1e-5, rtol=1e-5)


def _patterned(vocab, seed=0):
    """Prompts and texts made of a few repeated phrases: something a head can learn in seconds."""
    gen = torch.Generator().manual_seed(seed)
    phrases = [torch.randint(0, vocab, (7,), generator=gen).tolist() for _ in range(5)]
    prompts = [phrases[i % 5] + phrases[(i + 1) % 5] for i in range(20)]
    texts = [sum((phrases[(i + j) % 5] for j in range(6)), []) for i in range(10)]
    return prompts, texts


@pytest.fixture(scope="module")
def tiny_head(tmp_path_factory):
    model = tiny_llama(vocab=VOCAB)
    prompts, texts = _patterned(VOCAB)
    out = tmp_path_factory.mktemp("eagle") / "head.safetensors"
    record = distill(model, None, out=out, prompts=prompts, texts=texts, progress=False, log=lambda _: None,
                     recipe=Recipe(steps=150, batch=4, window=32, draft_vocab=48, max_new_tokens=12, lr=3e-3))
    return model, out, record


def test_tiny_distill_runs_end_to_end_and_the_loss_falls(tiny_head):
    model, out, record = tiny_head
    assert record["steps"] == 150 and record["data"]["sequences"] == 30
    assert record["loss"] < record["first_loss"] * 0.7, record  # (means of the first and the last 20 steps)
    assert len(record["heldout_acceptance_by_position"]) == 5
    curve = dict(map(tuple, record["heldout_curve"]))  # measured at the end (150 < CHECKPOINT_STEPS)
    assert list(curve) == [150] and record["kept_step"] == 150
    assert curve[150] == pytest.approx(1 + sum(record["heldout_acceptance_by_position"]), abs=1e-3)
    cfg = json.loads((out.parent / (out.name + ".json")).read_text())
    assert cfg["draft_vocab"] == 48 and cfg["vocab_size"] == VOCAB and cfg["recipe"]["steps"] == 150
    head = load_head(out, {"eagle": EagleHead})
    assert head.draft_ids.tolist() == sorted(set(head.draft_ids.tolist()))
    assert out.stat().st_size < 2 << 20  # float16


def test_resume_continues_from_the_checkpoint(tiny_head, tmp_path):
    model, out, _ = tiny_head
    prompts, texts = _patterned(VOCAB)
    copy = tmp_path / "head.safetensors"
    for suffix in (".data.pt", ".ckpt.pt"):
        (tmp_path / ("head.safetensors" + suffix)).write_bytes((out.parent / (out.name + suffix)).read_bytes())
    record = distill(model, None, out=copy, prompts=prompts, texts=texts, progress=False, log=lambda _: None,
                     resume=True, recipe=Recipe(steps=160, batch=4, window=32, draft_vocab=48, max_new_tokens=12))
    assert record["steps"] == 160 and record["first_step"] == 150  # ten more steps, the data reused


def test_a_head_continues_training_on_new_data_from_a_saved_head(tiny_head, tmp_path):
    """``init``: training starts from the saved head's weights and keeps its draft vocabulary (the new data's
    own is not counted), and the record keeps the first run's; a head of another kind or for another model is
    refused by name, before any data is built."""
    model, out, _ = tiny_head
    prompts, texts = _patterned(VOCAB, seed=1)  # other phrases: another draft vocabulary if it were counted
    recipe = Recipe(steps=10, batch=4, window=32, draft_vocab=48, max_new_tokens=12, lr=1e-4, seed=1)
    more = tmp_path / "more.safetensors"
    record = distill(model, None, out=more, prompts=prompts, texts=texts, init=out, recipe=recipe, minutes=0,
                     progress=False, log=lambda _: None)  # (no step fits in no time: the head as it was given)
    assert record["steps"] == 0 and record["init"]["head"] == out.name and record["init"]["recipe"]["steps"] == 150
    saved, continued = load_head(out, {"eagle": EagleHead}), load_head(more, {"eagle": EagleHead})
    assert all(torch.equal(v, continued.state_dict()[k]) for k, v in saved.state_dict().items())
    distill(model, None, out=tmp_path / "fresh.safetensors", data=tmp_path / "more.safetensors.data.pt",
            recipe=recipe, minutes=0, progress=False, log=lambda _: None)
    assert not torch.equal(load_head(tmp_path / "fresh.safetensors", {"eagle": EagleHead}).draft_ids, saved.draft_ids)
    with pytest.raises(ValueError, match="not 'medusa'"):
        distill(model, None, out=tmp_path / "m.safetensors", head="medusa", prompts=prompts, texts=texts, init=out,
                data=tmp_path / "more.safetensors.data.pt", recipe=recipe, progress=False, log=lambda _: None)
    other = tiny_llama(vocab=VOCAB, seed=5)
    with pytest.raises(ValueError, match="distilled from another model"):
        distill(other, None, out=tmp_path / "o.safetensors", prompts=prompts, texts=texts, init=out, recipe=recipe,
                progress=False, log=lambda _: None)


def test_training_keeps_the_weights_that_measured_best_on_held_out_answers(tiny_head, monkeypatch, tmp_path):
    """Measured every CHECKPOINT_STEPS steps and at the end: the head comes back with the weights of the best
    measurement (not the last), the curve is in the record, and a resumed run remembers the best so far."""
    from specgraph.runtime.heads import training
    from specgraph.runtime.heads.distill_data import Sequence

    model, _, _ = tiny_head
    gen = torch.Generator().manual_seed(1)
    seqs = [Sequence(torch.randint(0, VOCAB, (24,), generator=gen).tolist(), "text", i == 0, prompt_len=4,
                     greedy=True, feats=torch.randn(24, model.config.hidden_size, generator=gen)) for i in range(6)]
    scores, seen = iter([1.2, 1.9, 1.4, 1.1]), {}

    def scripted(head, sequences, depth=5):
        assert head.training and sequences is seqs
        seen[len(seen)] = {k: v.clone() for k, v in head.state_dict().items()}
        return next(scores)

    saved_steps, save = [], torch.save

    def counted_save(state, path):
        saved_steps.append(state["step"])
        save(state, path)

    monkeypatch.setattr(training, "CHECKPOINT_STEPS", 5)
    monkeypatch.setattr(training, "heldout_tokens_per_forward", scripted)
    monkeypatch.setattr(training.torch, "save", counted_save)
    head = _head(model, VOCAB, 48)
    recipe = Recipe(steps=15, batch=2, window=16, lr=3e-3)
    ckpt = tmp_path / "head.ckpt.pt"
    record = training.train(head, seqs, recipe, ckpt, progress=False)
    assert record["heldout_curve"] == [[5, 1.2], [10, 1.9], [15, 1.4]] and record["kept_step"] == 10
    assert saved_steps == [5, 10, 15]  # (the last step is a checkpoint's: written once)
    assert all(torch.equal(v, seen[1][k]) for k, v in head.state_dict().items())
    assert not torch.equal(seen[1]["fc.weight"], seen[2]["fc.weight"])  # (the last weights differed)
    record = training.train(head, seqs, Recipe(steps=20, batch=2, window=16), ckpt, resume=True, progress=False)
    assert record["heldout_curve"][-1] == [20, 1.1] and record["kept_step"] == 10  # the best from before the resume


def check_greedy_lossless(model, draft: str, default_tree: str, room: str, tree: str | None):
    """The kind's default tree is ``default_tree``; an engine compiled with room for ``room``, drafting ``tree``
    (None: chains), emits plain greedy's tokens at batch 1 and 4 and gains from the trained head. Returns
    ``(plain, spec)`` engines."""
    prompts, _ = _patterned(VOCAB)
    plain = specgraph.Engine(model, num_blocks=64, page_size=8)
    default = specgraph.Engine(model, num_blocks=64, page_size=8, draft=draft)
    assert default.draft_tree == default_tree and default.adaptive  # the tree: the controller's largest shape
    spec = specgraph.Engine(model, num_blocks=64, page_size=8, draft=draft, draft_tree=room, adaptive=False)
    spec.draft_tree = tree
    for batch in (prompts[:1], prompts[3:7]):
        want = [r.token_ids for r in plain.generate(batch, max_new_tokens=16, ignore_eos=True)]
        got = [r.token_ids for r in spec.generate(batch, max_new_tokens=16, ignore_eos=True)]
        assert got == want
    assert spec.stats["draft_tokens"] > 0 and spec.stats["mean_accepted_tokens"] > 1.2  # it learned the phrases
    return plain, spec


@pytest.mark.parametrize("tree", ["dynamic:6", None])
def test_eagle_drafting_is_lossless_greedy(tiny_head, tree):
    model, out, _ = tiny_head
    plain, spec = check_greedy_lossless(model, f"eagle:{out}", "static:2,1,1", "dynamic:6", tree)
    prompts, _ = _patterned(VOCAB)
    # prefix caching (a shared prompt's blocks: the head's K/V there is reused) and forks stay exact
    shared = prompts[0] * 3
    a = spec.generate([shared, shared + prompts[1]], max_new_tokens=12, ignore_eos=True)
    b = plain.generate([shared, shared + prompts[1]], max_new_tokens=12, ignore_eos=True)
    assert [r.token_ids for r in a] == [r.token_ids for r in b] and spec.stats["cached_prompt_tokens"] > 0
    # the same prompt again: everything but its last token is cached, so the first step feeds one token (it looks
    # like a decode) before the head has any feature of this request: no draft that step, exact output
    again = shared[:8 * 3] + prompts[2][:1]
    for _ in range(2):
        assert spec.generate(again, max_new_tokens=6, ignore_eos=True)[0].token_ids == \
            plain.generate(again, max_new_tokens=6, ignore_eos=True)[0].token_ids


def test_a_quantized_head_drafts_like_the_float_head_and_stays_lossless(tiny_head):
    """``draft_weight_dtype="int8"`` (the default on a CPU with the C++ kernels) stores the head's linears and its
    draft LM head as int8 (a draft step reads a quarter of the bytes): its draft logits stay near the float head's,
    and greedy output equals plain decoding. ``"auto"`` keeps the head in float."""
    model, out, _ = tiny_head
    prompts, _ = _patterned(VOCAB)
    assert default_head_scheme(torch.device("cpu")) == ("int8" if cpu_kernels.load() is not None else "auto")
    assert specgraph.Engine(model, num_blocks=64, page_size=8, draft=f"eagle:{out}",
                            draft_weight_dtype="auto").proposer.head.weight_scheme is None
    plain = specgraph.Engine(model, num_blocks=64, page_size=8)
    spec = specgraph.Engine(model, num_blocks=64, page_size=8, draft=f"eagle:{out}", draft_weight_dtype="int8",
                            adaptive=False, draft_tree=None)
    head = spec.proposer.head
    assert head.weight_scheme == "int8" and not any(isinstance(m, torch.nn.Linear) for m in head.modules())
    float_head = load_head(out, {"eagle": EagleHead}).attach(*target_vocab_weights(model, VOCAB)).eval()
    g = torch.randn(5, head.cfg.hidden)
    with torch.no_grad():
        want, got = float_head.draft_logits(g), head.draft_logits(g)
        assert (got - want).abs().max() <= 0.02 * want.abs().max()
        ids = torch.tensor([3, 5, 7])
        feats = torch.randn(3, head.cfg.hidden)
        x_want, x_got = float_head._inputs(ids, feats), head._inputs(ids, feats)
        assert (x_got - x_want).abs().max() <= 0.02 * x_want.abs().max()
    for batch in (prompts[:1], prompts[3:7]):
        assert ([r.token_ids for r in spec.generate(batch, max_new_tokens=16, ignore_eos=True)]
                == [r.token_ids for r in plain.generate(batch, max_new_tokens=16, ignore_eos=True)])
    assert spec.stats["mean_accepted_tokens"] > 1.2


def test_a_quantized_heads_stacked_products_compute_the_separate_ones(tiny_head):
    """A quantized head runs q/k/v and gate/up as one product each (per-row scales: the stacked codes are the
    separate ones), and a tree level's candidates come from one draft LM head product for all its nodes: the
    numbers are those of the separate calls."""
    model, out, _ = tiny_head
    head = load_head(out, {"eagle": EagleHead}).attach(*target_vocab_weights(model, VOCAB)).quantize("int8").eval()
    assert head.qkv_product is not None and head.gate_up_product is not None
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (6,), generator=gen)
    feats = torch.randn(6, head.cfg.hidden, generator=gen)
    meta = AttentionMetadata.build([([1, 2], 0, 6)], 4, [list(range(6))])

    def paged():
        k_cache, v_cache = head.new_cache(4, 4, "cpu", torch.float32)
        with torch.no_grad():
            return head.forward_paged(ids, feats, meta, k_cache, v_cache)

    stacked = paged()
    head.qkv_product = head.gate_up_product = None
    separate = paged()
    if cpu_kernels.load() is not None:  # the C++ kernel computes an output the same way in any call
        assert torch.equal(stacked, separate)
    torch.testing.assert_close(stacked, separate, atol=1e-5, rtol=1e-5)
    builder = TreeBuilder(parse_tree("static:3,2", 16))
    with torch.no_grad():
        rows = candidate_rows(head, stacked, 3)
        assert rows == [candidates(head, g, builder) for g in stacked]
        for g, row in zip(stacked, rows):  # each row's own product: the 3 most probable draft tokens, best first
            probs = torch.softmax(head.draft_logits(g[None])[0], dim=-1)
            want = torch.topk(probs, 3)
            assert [t for t, _ in row] == head.draft_ids[want.indices].tolist()
            assert [p for _, p in row] == pytest.approx(want.values.tolist())


@pytest.mark.parametrize("tree", [None, "static:2,1"])
def test_eagle_sampling_keeps_the_target_distribution(tmp_path, tree):
    """The chi-square test of test_speculative with a tiny head on its small-vocabulary target: chains
    (rejection sampling with the head's q, zero outside its draft vocabulary) and trees."""
    target = _peaky(0)
    prompt = [1, 5, 2, 7]
    marginals = _exact_marginals(target, prompt, 3)
    gen = torch.Generator().manual_seed(0)
    out = tmp_path / "head.safetensors"
    distill(target, None, out=out, prompts=[torch.randint(0, 8, (6,), generator=gen).tolist() for _ in range(8)],
            texts=[torch.randint(0, 8, (24,), generator=gen).tolist() for _ in range(4)], progress=False,
            log=lambda _: None, recipe=Recipe(steps=20, batch=4, window=16, draft_vocab=6, max_new_tokens=8))
    n = 3000
    engine = specgraph.Engine(target, num_blocks=n + 8, page_size=8, max_num_seqs=n, draft=f"eagle:{out}",
                              adaptive=False, max_tokens_per_step=n * 12, prefix_caching=False)
    engine.draft_tree = tree
    results = engine.generate([prompt] * n, max_new_tokens=3, temperature=1.0, seed=1, ignore_eos=True)
    assert engine.stats["draft_tokens"] > 0
    assert _passes(torch.tensor([r.token_ids for r in results]), marginals)


def test_a_head_for_another_model_is_refused(tiny_head, tmp_path):
    _, out, _ = tiny_head
    other = tiny_llama(vocab=VOCAB + 32)
    with pytest.raises(ValueError, match=f"vocabulary {VOCAB}.*made for another model"):
        specgraph.Engine(other, num_blocks=16, page_size=8, draft=f"eagle:{out}")
    with pytest.raises(ValueError, match="hidden size"):
        specgraph.Engine(tiny_llama(vocab=VOCAB, hidden=48), num_blocks=16, page_size=8, draft=f"eagle:{out}")


def test_malformed_or_missing_heads_are_clear_errors(tiny_head, tmp_path):
    model, out, _ = tiny_head
    with pytest.raises(ValueError, match="made by `specgraph distill`"):
        specgraph.Engine(model, num_blocks=16, page_size=8, draft=f"eagle:{tmp_path / 'none.safetensors'}")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(out.read_bytes()[:200])
    (tmp_path / "bad.safetensors.json").write_text((out.parent / (out.name + ".json")).read_text())
    with pytest.raises(ValueError, match="bad.safetensors is malformed"):
        specgraph.Engine(model, num_blocks=16, page_size=8, draft=f"eagle:{bad}")
    with pytest.raises(ValueError, match="no eagle head is shipped for this model.*specgraph distill"):
        specgraph.Engine(model, num_blocks=16, page_size=8, draft="eagle")


def test_step_losses_mask_the_padding():
    """Rows past a sequence's length (and steps whose next token is past it) do not count."""
    model = tiny_llama(vocab=VOCAB)
    head = _head(model, VOCAB, 32)
    ids, feats = torch.randint(0, VOCAB, (2, 9)), torch.randn(2, 9, head.cfg.hidden)
    short = eagle_losses(head, ids[1:, :6], feats[1:, :6], torch.tensor([6]), unroll=2)
    padded = feats.clone()
    padded[1, 6:] = 1e4  # garbage where the second sequence has ended
    both = eagle_losses(head, ids, padded, torch.tensor([9, 6]), unroll=2)
    alone = eagle_losses(head, ids[:1], feats[:1], torch.tensor([9]), unroll=2)
    for j in range(2):
        valid = [9 - 1 - j, 6 - 1 - j]
        mixed = (alone[j][0] * valid[0] + short[j][0] * valid[1]) / sum(valid)
        torch.testing.assert_close(both[j][0], mixed, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "nanogpt", "sdpa_gqa"])
@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_heads_for_any_decoder_the_compiler_accepts(tmp_path, family, kind):
    """A head is distilled and drafts for each test family (features found by structure, whatever the model's
    norm, positions or attention); greedy output stays exact."""
    model = make_family(family)
    vocab = VOCAB_OF[family]
    prompts, texts = _patterned(vocab, seed=1)
    out = tmp_path / "head.safetensors"
    distill(model, None, out=out, head=kind, prompts=prompts[:8], texts=texts[:4], progress=False, log=lambda _: None,
            recipe=Recipe(steps=10, batch=2, window=32, draft_vocab=40, max_new_tokens=8))
    plain = specgraph.Engine(model, num_blocks=32, page_size=8)
    spec = specgraph.Engine(model, num_blocks=32, page_size=8, draft=f"{kind}:{out}", adaptive=False)  # every step
    want = [r.token_ids for r in plain.generate(prompts[:3], max_new_tokens=10, ignore_eos=True)]
    assert [r.token_ids for r in spec.generate(prompts[:3], max_new_tokens=10, ignore_eos=True)] == want
    assert spec.stats["tree_nodes_verified"] > 0


class _ScriptedEngine:
    """Answers each asked prompt with the next scripted ``(text, finish_reason)``, recording the prompts."""

    def __init__(self, tok, script):
        self.tok, self.script, self.asked = tok, list(script), []

    def generate(self, prompts, max_new_tokens, temperature, top_p, seed):
        from specgraph.runtime.prompts import GenerationResult

        self.asked += prompts
        out = []
        for _ in prompts:
            text, reason = self.script.pop(0) if self.script else ("", "length")
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            out.append(GenerationResult(ids, text, reason, 0, 0))
        return out


def test_self_asked_prompts_are_the_targets_finished_user_turns_in_its_chat_template():
    from specgraph.runtime.heads.distill_data import chat_ids, self_asked_prompts, user_turn_prefix

    tok = specgraph.load_model("smollm2-135m-instruct")[1]
    prefix = user_turn_prefix(tok)
    assert prefix.endswith("<|im_start|>user\n"), prefix
    turns = [(" a function that adds two numbers.", "stop"), (" is the sky blue?", "stop"),
             (" and on and on", "length"),  # ran past the token limit: dropped
             ("?", "stop"),  # too short: dropped
             (" a class for a stack.", "stop")]
    engine = _ScriptedEngine(tok, turns)
    got = self_asked_prompts(engine, tok, count=3, max_tokens=16, seed=0, heldout_fraction=0.0, batch=2)
    assert len(got) == 3 and all(not held for _, _, held in got)
    assert all(tok.decode(a).startswith(prefix) for a in engine.asked)  # asked in the user's place
    for (kind, ids, _), asked in zip(got, engine.asked[:2] + engine.asked[4:5]):
        opener = tok.decode(asked)[len(prefix):]
        assert kind == ("code" if opener in CODE_OPENERS else "chat")
    texts = [tok.decode(ids) for _, ids, _ in got]
    assert texts[0] == tok.decode(chat_ids(tok, tok.decode(engine.asked[0])[len(prefix):]
                                           + " a function that adds two numbers."))
    assert all(t.endswith("<|im_start|>assistant\n") for t in texts)  # ready for the target's answer
    assert "is the sky blue?" in texts[1] and "a class for a stack." in texts[2]  # the dropped turns skipped
    assert not any("on and on" in t for t in texts)
    assert len(engine.asked) == 6  # asked again for the dropped ones
    once = _ScriptedEngine(tok, turns)
    assert len(self_asked_prompts(once, tok, count=1, max_tokens=16, seed=0, heldout_fraction=0.0, batch=1)) == 1
    assert len(once.asked) == 1  # no more asked once enough were kept
    assert [k for k, _, _ in got] == ["code", "chat", "code"]


def test_self_asked_prompts_need_a_chat_template():
    from specgraph.runtime.heads.distill_data import self_asked_prompts

    class Plain:
        chat_template = None

    with pytest.raises(ValueError, match="chat template"):
        self_asked_prompts(None, Plain(), 4, 16, 0, 0.0)


def _shifted(x, j):
    return torch.cat([x[:, j:], x.new_zeros(x.shape[0], j, *x.shape[2:])], dim=1) if j else x


def _reference_losses(head, ids, feats, lens, unroll):
    """Each step's loss as first written: every slot's KL ``sum(T * (log T - log P))`` against a copy of the
    teacher shifted by the step (zeros past the end), masked; EAGLE's plus the smooth-L1 feature loss."""
    import torch.nn.functional as F

    t = ids.shape[1]
    teachers = torch.softmax(head.draft_logits(feats), dim=-1).detach()
    eagle = head.kind == "eagle"
    outs = enumerate(head.unrolled(ids, feats, unroll)) if eagle else enumerate(head(feats), start=1)
    losses = []
    for j, g in outs:
        valid = torch.arange(t)[None] + j < lens[:, None] - (1 if eagle else 0)
        teacher = _shifted(teachers, j)
        logp = torch.log_softmax(head.draft_logits(g), dim=-1)
        loss = (teacher * (torch.log(teacher.clamp_min(1e-30)) - logp)).sum(-1)
        if eagle:
            loss = 0.1 * loss + F.smooth_l1_loss(g, _shifted(feats, j), reduction="none").mean(-1)
        losses.append((loss * valid).sum() / valid.sum().clamp(min=1))
    return losses


@pytest.mark.parametrize("kind, length, lens", [("eagle", 9, [9, 6]), ("eagle", 2, [2, 1]), ("medusa", 9, [9, 6])])
def test_step_losses_and_their_gradients_are_the_shifted_teachers(kind, length, lens):
    """The teacher is read from slot ``j`` on rather than copied shifted, and its entropy taken once per batch:
    each step's loss and the gradients are the direct formula's (also for windows shorter than the unroll)."""
    from specgraph.runtime.heads.distill import new_head
    from specgraph.runtime.heads.training import medusa_losses

    model = tiny_llama(vocab=VOCAB)
    torch.manual_seed(0)
    head = new_head(kind, model, VOCAB, torch.randperm(VOCAB)[:32].sort().values, Recipe(medusa_heads=3)).train()
    ids, feats = torch.randint(0, VOCAB, (2, length)), torch.randn(2, length, head.cfg.hidden)
    lens = torch.tensor(lens)
    ours = (lambda: eagle_losses(head, ids, feats, lens, unroll=3)) if kind == "eagle" else \
        (lambda: medusa_losses(head, ids, feats, lens))
    grads = []
    for losses in (lambda: [l for l, _ in ours()], lambda: _reference_losses(head, ids, feats, lens, unroll=3)):
        head.zero_grad()
        step_losses = losses()
        sum(0.8 ** j * l for j, l in enumerate(step_losses)).backward()
        grads.append((torch.stack(step_losses).detach(), [p.grad.clone() for p in head.parameters()]))
    (new, new_grads), (ref, ref_grads) = grads
    torch.testing.assert_close(new, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(new_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_steps_that_fit_a_time_limit():
    from specgraph.runtime.heads.training import PLAN_AFTER_STEPS, steps_that_fit

    assert steps_that_fit(1400, 20, 20, 120.0, 3000.0) == 500  # 6 s a step: 480 more steps fit
    assert steps_that_fit(1400, 20, 20, 1.0, 3000.0) == 1400  # never past the recipe's steps
    assert steps_that_fit(1400, 20, 20, 3100.0, 3000.0) == 20  # over the limit: the schedule ends now
    assert steps_that_fit(1400, 5, PLAN_AFTER_STEPS - 1, 600.0, 60.0) == 1400  # too few steps timed yet


def test_a_time_limit_ends_the_learning_rate_schedule_at_the_steps_that_fit(tiny_head, monkeypatch):
    """With ``minutes`` the run trains fewer steps of a whole schedule (its warm-up and cosine decay to the floor,
    0.1 of the peak) instead of stopping part-way down the recipe's. A fake clock: every reading 1 s later (about
    2 s a step, 200 s)."""
    from types import SimpleNamespace

    from specgraph.runtime.heads import training
    from specgraph.runtime.heads.distill_data import Sequence

    model, _, _ = tiny_head
    gen = torch.Generator().manual_seed(1)
    seqs = [Sequence(torch.randint(0, VOCAB, (24,), generator=gen).tolist(), "text", i == 0, prompt_len=4,
                     greedy=True, feats=torch.randn(24, model.config.hidden_size, generator=gen)) for i in range(6)]
    clock = iter(range(10**6))
    monkeypatch.setattr(training, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    recipe = Recipe(steps=300, batch=2, window=16, lr=3e-3)  # (a warm-up of 31 steps)
    record = training.train(_head(model, VOCAB, 48), seqs, recipe, None, minutes=200 / 60, progress=False)
    assert 80 <= record["steps"] <= 120, record
    assert record["last_lr"] == pytest.approx(0.1 * recipe.lr, rel=0.02), record
