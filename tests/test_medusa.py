"""Medusa heads: a tiny ``distill --head medusa`` runs end to end (the loss falls, the heads load), drafting
with them is lossless (greedy identical on chains and trees; sampling keeps the target's distribution),
and a head of the other kind is refused."""
import pytest
import torch

import specgraph
from specgraph.runtime.heads.distill import Recipe, distill
from models import tiny_llama
from test_eagle import VOCAB, _patterned, check_greedy_lossless
from test_speculative import _exact_marginals, _passes, _peaky


@pytest.fixture(scope="module")
def tiny_medusa(tmp_path_factory):
    model = tiny_llama(vocab=VOCAB)
    prompts, texts = _patterned(VOCAB)
    out = tmp_path_factory.mktemp("medusa") / "heads.safetensors"
    record = distill(model, None, out=out, head="medusa", prompts=prompts, texts=texts, progress=False,
                     log=lambda _: None, recipe=Recipe(steps=150, batch=4, window=32, draft_vocab=48,
                                                        max_new_tokens=12, lr=3e-3, medusa_heads=3))
    return model, out, record


def test_tiny_medusa_distill_runs_and_the_loss_falls(tiny_medusa):
    _, out, record = tiny_medusa
    assert record["steps"] == 150 and record["loss"] < record["first_loss"] * 0.7, record
    assert len(record["heldout_acceptance_by_position"]) == 3  # one per head


@pytest.mark.parametrize("tree", ["static:4,2,2,1", "static:2,2", None])
def test_medusa_drafting_is_lossless_greedy(tiny_medusa, tree):
    model, out, _ = tiny_medusa
    check_greedy_lossless(model, f"medusa:{out}", "static:2,1", "static:4,2,2,1", tree)


@pytest.mark.parametrize("tree", [None, "static:2,2"])
def test_medusa_sampling_keeps_the_target_distribution(tmp_path, tree):
    target = _peaky(0)
    prompt = [1, 5, 2, 7]
    marginals = _exact_marginals(target, prompt, 3)
    gen = torch.Generator().manual_seed(0)
    out = tmp_path / "heads.safetensors"
    distill(target, None, out=out, head="medusa", progress=False, log=lambda _: None,
            prompts=[torch.randint(0, 8, (6,), generator=gen).tolist() for _ in range(8)],
            texts=[torch.randint(0, 8, (24,), generator=gen).tolist() for _ in range(4)],
            recipe=Recipe(steps=20, batch=4, window=16, draft_vocab=6, max_new_tokens=8, medusa_heads=2))
    n = 3000
    engine = specgraph.Engine(target, num_blocks=n + 8, page_size=8, max_num_seqs=n, draft=f"medusa:{out}",
                              draft_tree="static:2,2", adaptive=False, max_tokens_per_step=n * 12, prefix_caching=False)
    engine.draft_tree = tree  # (within the capacity compiled for static:2,2)
    results = engine.generate([prompt] * n, max_new_tokens=3, temperature=1.0, seed=1, ignore_eos=True)
    assert engine.stats["draft_tokens"] > 0
    assert _passes(torch.tensor([r.token_ids for r in results]), marginals)


def test_a_head_of_the_other_kind_is_refused(tiny_medusa):
    model, out, _ = tiny_medusa
    with pytest.raises(ValueError, match="it is a 'medusa' head.*not 'eagle'"):
        specgraph.Engine(model, num_blocks=16, page_size=8, draft=f"eagle:{out}")
