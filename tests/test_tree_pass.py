"""The tree_mask pass: with all-ones rows the program is unchanged (checked by the pass manager), and one
forward over a token tree gives each node the logits of the full forward over its own root path, on the
test families and on models with a sliding window (Gemma 2, Mistral), ALiBi (Bloom) and soft-capping."""
import pytest
import torch

from specgraph.compiler.options import BackendOptions
from specgraph.compiler.program import AttentionMetadata, compile_decoder
from specgraph.kernels.tree_mask import random_tree
from models import FAMILIES, VOCAB, make_family
from test_model_zoo import build


def _logits(out):
    return getattr(out, "logits", out)


def _root_path(parents: list[int], m: int) -> list[int]:
    path = []
    while m >= 0:
        path.append(m)
        m = parents[m]
    return path[::-1]


def check_tree_forward(model, vocab: int, prompt_len: int, tree_size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    program = compile_decoder(model, BackendOptions(page_size=8, tree_nodes=tree_size, check="numeric"))
    assert "tree_mask" in [r.name for r in program.compiled.context.log if r.added or r.removed]
    prompt = torch.randint(0, vocab, (prompt_len,), generator=gen)
    parents = random_tree(tree_size, gen)
    nodes = torch.randint(0, vocab, (tree_size,), generator=gen)
    table = torch.randperm(15, generator=gen)[:-(-(prompt_len + tree_size) // 8)].add(1).tolist()
    cache = program.new_kv_cache(16)
    with torch.no_grad():
        program(prompt, AttentionMetadata.build([(table, 0, prompt_len)], 8, [[]], tree_words=program.tree_words),
                cache)
        meta = AttentionMetadata.build([(table, prompt_len, tree_size)], 8, [list(range(tree_size))], {0: parents},
                                       tree_words=program.tree_words)
        got = program(nodes, meta, cache)
        for m in range(tree_size):
            ids = torch.cat([prompt, nodes[_root_path(parents, m)]])
            want = _logits(model(ids[None]))[0, -1]
            torch.testing.assert_close(got[m], want, atol=5e-5, rtol=1e-5, msg=lambda s: f"node {m}: {s}")


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_forward_is_each_paths_forward(family):
    torch.manual_seed(0)
    check_tree_forward(make_family(family), VOCAB[family], prompt_len=11, tree_size=9, seed=1)


@pytest.mark.parametrize("name", ["gemma2_window8", "mistral_window8", "bloom"])
def test_tree_forward_with_window_softcap_alibi(name):
    model = build(name)
    vocab = model.get_output_embeddings().weight.shape[0]
    # a context longer than the window, and a tree deeper than 1 whose nodes' windows differ
    check_tree_forward(model, vocab, prompt_len=13, tree_size=12, seed=2)


def test_program_without_trees_has_no_mask_input():
    program = compile_decoder(make_family("llama"), BackendOptions(page_size=8))
    assert program.tree_words == 0
    assert "tree_mask" not in [n.name for n in program.gm.graph.nodes if n.op == "placeholder"]
    with pytest.raises(ValueError, match="tree_nodes > 0"):
        AttentionMetadata.build([([1], 0, 2)], 8, [[1]], {0: [-1, 0]})


def test_tree_nodes_option_is_checked():
    with pytest.raises(ValueError, match="tree_nodes"):
        BackendOptions(tree_nodes=1000)
