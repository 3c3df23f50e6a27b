"""runtime/shape_choice.py: with adaptive=False and no draft_tree, an engine with a learned draft times its
kind's tree and the chains within its depth and drafts in the fastest; the figures are kept per machine and
head, and the output stays the target's."""
import pytest

import specgraph
from specgraph.runtime import shape_choice
from specgraph.runtime.heads.base import save_head
from specgraph.runtime.shape_choice import calibration_prompts, candidate_shapes, choose_shape, measure_shapes
from specgraph.runtime.token_tree import parse_tree
from models import make_family, random_prompts, tiny_llama
from test_eagle import VOCAB, _head


class _ChatTokenizer:
    """Just enough of a tokenizer for the calibration prompts: a chat template and ids in the tiny vocabulary."""
    chat_template = "{{ messages }}"
    eos_token_id = None

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "user: " + messages[0]["content"] + "\nassistant: "

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % VOCAB for c in text[:20]]}

    def decode(self, ids, skip_special_tokens=True):
        return ""


def test_the_candidates_are_the_tree_and_the_chains_within_its_depth():
    assert candidate_shapes(parse_tree("static:2,1,1", 16), 4) == {
        "static:2,1,1": ("static:2,1,1", 4), "chain 1": (None, 1), "chain 2": (None, 2), "chain 3": (None, 3)}
    assert list(candidate_shapes(parse_tree("static:2,1,1", 16), 2)) == ["static:2,1,1", "chain 1", "chain 2"]
    # a proposer that adds a lookup branch to its trees: each chain also as a one-path tree
    assert list(candidate_shapes(parse_tree("static:2,1,1", 16), 2, branch=True)) == [
        "static:2,1,1", "chain 1", "static:1", "chain 2", "static:1,1"]
    assert candidate_shapes(parse_tree("static:1,1", 16), 4, branch=True)["static:1,1"] == ("static:1,1", 4)


def test_calibration_prompts_need_a_chat_template():
    assert calibration_prompts(None) is None
    plain = _ChatTokenizer()
    plain.chat_template = None
    assert calibration_prompts(plain) is None
    prompts = calibration_prompts(_ChatTokenizer())
    assert len(prompts) == len(shape_choice.CALIBRATION_PROMPTS) and all(prompts)


@pytest.mark.parametrize("fastest", ["static:2,1,1", "chain 2"])
def test_the_fastest_shape_is_kept_and_its_figures_are_read_back(fastest, tmp_path, monkeypatch):
    model = make_family("llama")
    engine = specgraph.Engine(model, lowering="eager", num_blocks=64, page_size=8, draft="ngram",
                              draft_tree="static:2,1,1", adaptive=False)
    shapes = candidate_shapes(parse_tree("static:2,1,1", 16), 4)
    calls = []

    def measure(engine, shapes, prompts):
        calls.append(prompts)
        return {label: (9.0 if label == fastest else 5.0) for label in shapes}

    monkeypatch.setattr(shape_choice, "measurement_path", lambda key, name: tmp_path / f"{name}.json")
    prompts = random_prompts("llama", [6])
    assert choose_shape(engine, shapes, prompts, "head-x", measure)[fastest] == 9.0
    assert (engine.draft_tree, engine.num_draft_tokens) == shapes[fastest]
    engine.draft_tree = None
    choose_shape(engine, shapes, prompts, "head-x", measure)  # read back: measured once per head and machine
    assert len(calls) == 1 and (engine.draft_tree, engine.num_draft_tokens) == shapes[fastest]
    choose_shape(engine, shapes, prompts, "head-y", measure)  # another head is measured again
    assert len(calls) == 2


def test_measuring_times_every_shape_and_leaves_the_output_exact():
    model = make_family("llama")
    prompts = random_prompts("llama", [6, 9], seed=5)
    plain = specgraph.Engine(model, lowering="eager", num_blocks=64, page_size=8)
    want = [r.token_ids for r in plain.generate(prompts, max_new_tokens=12, ignore_eos=True)]
    engine = specgraph.Engine(model, lowering="eager", num_blocks=64, page_size=8, draft="ngram",
                              draft_tree="static:2,1,1", adaptive=False)
    rates = measure_shapes(engine, candidate_shapes(parse_tree("static:2,1,1", 16), 4), prompts, new_tokens=6)
    assert set(rates) == {"static:2,1,1", "chain 1", "chain 2", "chain 3"} and min(rates.values()) > 0
    assert [r.token_ids for r in engine.generate(prompts, max_new_tokens=12, ignore_eos=True)] == want


def test_an_eagle_engine_without_a_shape_measures_its_default_only_when_speculation_is_fixed(tmp_path):
    model = tiny_llama(vocab=VOCAB)
    path = save_head(_head(model, VOCAB, 40), tmp_path / "head.safetensors")
    common = dict(tokenizer=_ChatTokenizer(), lowering="eager", num_blocks=64, page_size=8, draft=f"eagle:{path}")
    fixed = specgraph.Engine(model, adaptive=False, **common)
    assert set(fixed.draft_shape_rates) == {"static:2,1,1", "chain 1", "chain 2", "chain 3"}
    best = max(fixed.draft_shape_rates, key=fixed.draft_shape_rates.get)
    assert (fixed.draft_tree or f"chain {fixed.num_draft_tokens}") == best
    assert fixed.stats["generated_tokens"] == 0  # (the timing runs are not counted)
    head = fixed.proposer.head  # what names the kept figures: kind, the file's digest, the weight storage
    assert head.identity().startswith("eagle-") and head.identity().endswith("-int8")
    other = save_head(_head(model, VOCAB, 40, seed=1), tmp_path / "other.safetensors")
    mine, head.source = head.identity(), other
    assert head.identity() != mine
    assert specgraph.Engine(model, **common).draft_shape_rates is None  # adaptive: the controller chooses
    given = specgraph.Engine(model, adaptive=False, draft_tree="static:2,1,1", **common)
    assert given.draft_shape_rates is None and given.draft_tree == "static:2,1,1"  # a given shape is kept
