"""Token-tree speculation (runtime/token_tree.py): tree shapes, tree building, lossless verification (greedy;
sampled: a chi-square test, and every token equal to plain sampling's from the same uniforms), the cache kept
for the accepted path, and the engine: greedy tree speculation equals plain greedy decoding for every
proposer, static and dynamic trees."""
import pytest
import torch

from specgraph.runtime.engine import Engine
from specgraph.runtime.proposers.base import DraftRequest
from specgraph.runtime.proposers.ngram import NgramProposer
from specgraph.runtime.sampling import draw_token
from specgraph.runtime.token_tree import (TreeBuilder, TreeShape, chain_in_tree, keep_path, parse_tree,
                                          verify_tree_greedy, verify_tree_sampling)
from models import FAMILIES, make_family, random_prompts, uncached_greedy
from test_rejection import ALPHA, chi2_pvalue


def test_tree_specs():
    assert parse_tree("static:4,2,1", 64) == TreeShape(widths=(4, 2, 1))
    assert parse_tree("static:4,2,1", 64).max_nodes == 4 + 8 + 8
    assert parse_tree("dynamic:10", 64).max_nodes == 10
    assert parse_tree("dynamic:10", 64).scratch_nodes >= 10
    for bad in ("static", "static:", "static:2,0", "dynamic:0", "dynamic:3,4", "chain:4", "static:a", 4):
        with pytest.raises(ValueError, match="static:W1,W2"):
            parse_tree(bad, 64)
    with pytest.raises(ValueError, match="at most 20"):
        parse_tree("static:8,8", 20)


def test_static_builder_keeps_the_best_distinct_children_per_level():
    b = TreeBuilder(parse_tree("static:2,1", 64))
    b.add_level([[(5, 0.5), (5, 0.4), (7, 0.1), (9, 0.0)]])  # the duplicate 5 is skipped
    assert (b.tokens, b.parents, b.frontier) == ([5, 7], [-1, -1], [0, 1])
    b.add_level([[(1, 0.9), (2, 0.1)], [(3, 1.0)]])
    assert b.done and b.result() == ([5, 7, 1, 3], [-1, -1, 0, 1])
    assert b.path(2) == [5, 1]


def test_dynamic_builder_keeps_the_most_confident_nodes_with_their_ancestors():
    b = TreeBuilder(parse_tree("dynamic:3", 64))  # depth 3, 4 nodes per level
    b.add_level([[(10, 0.6), (11, 0.3), (12, 0.1)]])
    b.add_level([[(20, 0.9)], [(21, 0.5)], [(22, 0.5)]])  # cumulative: .54, .15, .05
    b.add_level([[(30, 0.2)], [(31, 1.0)], [(32, 1.0)], []])
    tokens, parents = b.result()
    assert tokens == [10, 11, 20] and parents == [-1, -1, 0]  # .6, .54, .3 beat .15 (31) and .108 (30)


def test_ngram_tree_holds_the_chain_and_branches_on_other_continuations():
    p = NgramProposer()
    ids = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 7, 9, 1, 2]
    d = p.propose_tree([DraftRequest(0, ids, 4, k=3)], parse_tree("static:3,2,1", 64))[0]
    chain = p.lookup(ids, 3)
    node, path = -1, []
    for t in chain:  # the chain is the first child at each level
        node = next(i for i, (tok, par) in enumerate(zip(d.token_ids, d.parents)) if par == node and tok == t)
        path.append(node)
    assert d.token_ids[:2] == [3, 5] and d.parents[:2] == [-1, -1]  # 1, 2 was followed by 3 and by 5
    assert len(path) == 3


def test_greedy_tree_verification():
    logits = torch.eye(6)[[2, 0, 4, 5]]  # argmax after the root: 2, after node 1: 0, node 2: 4, node 3: 5
    assert verify_tree_greedy([1, 2, 4], [-1, -1, 1], logits) == ([2, 4, 5], [2, 3])
    assert verify_tree_greedy([1, 3, 4], [-1, -1, 1], logits) == ([2], [])
    # a chain gives the chain verifier's answer
    assert verify_tree_greedy([2, 4, 0], [-1, 0, 1], torch.eye(6)[[2, 4, 1, 3]]) == ([2, 4, 1], [1, 2])



def test_the_chain_in_a_tree_keeps_what_verifying_it_alone_would():
    """A tree's first-child chain (the draft's best guess per level), scored against the accepted root path,
    equals greedy verification of that chain alone: the controller's chain estimate learns from trees."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        tokens = torch.randint(0, 4, (6,), generator=g).tolist()
        parents = [-1, -1, 0, 0, 1, 2]  # root -> {1 -> {3 -> {6}, 4}, 2 -> {5}} in step nodes
        logits = torch.randn(7, 4, generator=g)
        _, path = verify_tree_greedy(tokens, parents, logits)
        chain = [0, 2, 5]  # draft nodes of the first-child chain: 1 -> 3 -> 6 in step nodes
        chain_logits = logits[[0] + [c + 1 for c in chain]]
        kept = len(verify_tree_greedy([tokens[c] for c in chain], [-1, 0, 1], chain_logits)[0]) - 1
        assert chain_in_tree(parents, path) == (3, kept)


V = 8
TOKENS = [0, 1, 2, 3, 4, 5]  # root -> {0 -> {3, 4}, 1 -> {5}, 2}
PARENTS = [-1, -1, -1, 0, 0, 1]


def tree_outputs(trials: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(len(TOKENS) + 1, V, generator=g) + 0.05
    p = w / w.sum(-1, keepdim=True)
    u = torch.rand(trials, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1)).tolist()
    return p, [verify_tree_sampling(TOKENS, PARENTS, p, draws)[0] for draws in u]


def test_tree_sampling_keeps_the_target_distribution():
    """First token ~ p(root); the second, after accepting node 1 (token 0) or node 2 (token 1), ~ that node's row."""
    p, outs = tree_outputs(trials=12_000, seed=5)
    assert chi2_pvalue([o[0] for o in outs], p[0]) > ALPHA
    for first, row in ((0, 1), (1, 2)):
        assert chi2_pvalue([o[1] for o in outs if o[0] == first], p[row]) > ALPHA
    assert any(len(o) == 3 for o in outs)  # paths of two accepted nodes happen


def test_tree_sampling_emits_plain_sampling_tokens():
    """Each emitted token is the target's draw at its position from the row of the path so far: plain
    decoding's token, whichever candidates the tree held."""
    p, _ = tree_outputs(trials=0, seed=6)
    u = torch.rand(500, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(7)).tolist()
    row_after = {(): 0, (0,): 1, (1,): 2, (2,): 3, (0, 3): 4, (0, 4): 5, (1, 5): 6}
    for draws in u:
        out, path = verify_tree_sampling(TOKENS, PARENTS, p, draws)
        prefix: tuple[int, ...] = ()
        for depth, token in enumerate(out):
            assert token == draw_token(p[row_after[prefix]], draws[depth])
            prefix += (token,)
        assert len(path) == len(out) - 1 and all(TOKENS[n - 1] == t for n, t in zip(path, out))


def test_keep_path_moves_the_accepted_nodes_rows_only():
    cache = [(torch.arange(4 * 4 * 2, dtype=torch.float32).view(4, 4, 1, 2),
              torch.zeros(4, 4, 1, dtype=torch.float32))]  # K and a per-token scale
    before = [t.clone() for t in cache[0]]
    slots = [5, 6, 7, 8, 9]  # step nodes 0..4; nodes 2 and 4 accepted
    moved = keep_path(cache, slots, [2, 4])
    k = cache[0][0].view(-1, 1, 2)
    assert torch.equal(k[6], before[0].view(-1, 1, 2)[7]) and torch.equal(k[7], before[0].view(-1, 1, 2)[9])
    assert torch.equal(k[5], before[0].view(-1, 1, 2)[5]) and torch.equal(k[:5], before[0].view(-1, 1, 2)[:5])
    assert moved == 2 * (2 * 4 + 4)  # two rows of K (2 floats) and of the scale (1 float)


def _prompts(family):
    return [p + p[:12] + p for p in random_prompts(family, [17, 30, 9, 24], seed=3)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("draft,tree", [("ngram", "static:3,2,1"), ("ngram", "dynamic:8"),
                                        ("layer_skip:1", "static:2,2"), ("model", "dynamic:6")])
def test_greedy_tree_speculation_is_plain_greedy(family, draft, tree):
    model = make_family(family)
    prompts = _prompts(family)
    engine = Engine(model, draft=make_family(family, seed=1) if draft == "model" else draft, draft_tree=tree, adaptive=False,
                    num_blocks=64, page_size=8)
    for batch in (prompts[:1], prompts):
        got = [r.token_ids for r in engine.generate(batch, max_new_tokens=20, ignore_eos=True)]
        assert got == [uncached_greedy(model, p, 20) for p in batch]
    s = engine.stats
    assert s["tree_nodes_verified"] > 0 and s["draft_tree"] == str(parse_tree(tree, 64))
    engine.kv.check_invariants()


def test_a_tree_accepts_at_least_its_chain_at_equal_depth():
    """static:3,2,1 holds the depth-3 chain (each level's first child is the chain's token): it gains at least
    the chain's tokens per forward, and more where the draft's first guess is often wrong (n-gram lookup on
    text that repeats with variations)."""
    model = make_family("llama")
    prompts = _prompts("llama")
    for draft, better in (("ngram", 1.0), (make_family("llama", seed=1), 0.0)):
        engine = Engine(model, draft=draft, draft_tree="static:3,2,1", adaptive=False, num_blocks=64, page_size=8)
        engine.num_draft_tokens = 3
        gained = {}
        for shape in (None, "static:3,2,1"):
            engine.draft_tree = shape
            engine.reset_stats()
            engine.generate(prompts, max_new_tokens=32, ignore_eos=True)
            gained[shape] = engine.stats["mean_accepted_tokens"]
        assert gained["static:3,2,1"] >= gained[None] + better, gained


def test_sampled_tree_speculation_replays_with_its_seed_and_honours_request_caps():
    model = make_family("llama")
    prompts = _prompts("llama")[:2]
    engine = Engine(model, draft="ngram", draft_tree="dynamic:6", adaptive=False, num_blocks=64, page_size=8)
    runs = [[r.token_ids for r in engine.generate(prompts, max_new_tokens=16, temperature=0.8, seed=s,
                                                    ignore_eos=True)] for s in (3, 3, 4)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert engine.stats["tree_nodes_verified"] > 0
    engine.reset_stats()  # a request that turns speculation off drafts no tree
    [request] = engine.submit(prompts[0], max_new_tokens=8, ignore_eos=True, num_draft_tokens=0)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats["tree_nodes_verified"] == 0 and len(request.output_ids) == 8


def test_tree_of_a_quantized_cache_moves_scales():
    """fp8 cache: tree speculation equals plain decoding on the same cache format."""
    model = make_family("llama")
    prompts = _prompts("llama")[:2]
    plain = Engine(model, kv_dtype="fp8", num_blocks=64, page_size=8)
    tree = Engine(model, kv_dtype="fp8", draft="ngram", draft_tree="static:2,2,1", adaptive=False, num_blocks=64,
                  page_size=8)
    want = [r.token_ids for r in plain.generate(prompts, max_new_tokens=20, ignore_eos=True)]
    assert [r.token_ids for r in tree.generate(prompts, max_new_tokens=20, ignore_eos=True)] == want
    assert tree.stats["accepted_tokens"] > 0


def test_tree_cache_is_the_prefix_plus_the_tree(monkeypatch):
    """A tree's nodes take scratch slots beside the sequence's blocks: the step holds ceil((L + B) / page) blocks,
    not L x B (the prefix is never copied); after verification only the committed tokens' blocks stay."""
    model = make_family("llama")
    prompt = _prompts("llama")[1] * 3  # a long context, repeated: n-gram trees are full
    engine = Engine(model, draft="ngram", draft_tree="static:4,2,1", adaptive=False, num_blocks=128, page_size=8)
    steps = []
    run = type(engine.program).__call__

    def spy(program, ids, meta, cache):
        if meta.tree_mask is not None and bool((meta.tree_mask != -1).any()):  # a step verifying a tree
            steps.append((int(meta.seq_lens[0]), len(ids), 127 - engine.kv.num_free_blocks))
        return run(program, ids, meta, cache)

    monkeypatch.setattr(type(engine.program), "__call__", spy)
    [request] = engine.submit(prompt, max_new_tokens=12, ignore_eos=True)
    while engine.has_unfinished():
        engine.step()
        if not request.finished:  # between steps: the computed tokens' blocks only
            assert 127 - engine.kv.num_free_blocks == -(-request.num_computed // 8)
    assert steps and max(n for _, n, _ in steps) > 4
    for seq_len, nodes, held in steps:
        assert held == -(-seq_len // 8) and nodes <= 1 + 4 + 8 + 8
    engine.kv.check_invariants()


def test_draft_tree_errors():
    model = make_family("llama")
    with pytest.raises(ValueError, match="without a draft"):
        Engine(model, draft_tree="static:2")
    with pytest.raises(ValueError, match="accepted forms"):
        Engine(model, draft="ngram", draft_tree="wide:3")
