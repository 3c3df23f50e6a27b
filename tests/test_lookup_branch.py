"""``draft="<kind>+ngram"``: a prompt-lookup branch in a tree-drafting proposer's trees. The branch joins the tree
as one root path without repeating a node; drafting stays lossless (greedy identical, sampling keeps the
target's distribution); specs are parsed and refused clearly."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import specgraph
from specgraph.runtime.proposers import kind_of, split_lookup
from specgraph.runtime.proposers.base import Draft, DraftRequest
from specgraph.runtime.proposers.lookup_branch import BRANCH_NODES, LookupBranch, add_branch
from specgraph.runtime.token_tree import parse_tree, step_children
from models import tiny_llama
from test_eagle import VOCAB, _patterned, tiny_head  # noqa: F401  (a module fixture)
from test_speculative import _exact_marginals, _passes, _peaky


@st.composite
def trees_and_branches(draw):
    n = draw(st.integers(0, 10))
    tokens, parents = [], []
    for i in range(n):
        p = draw(st.integers(-1, i - 1))
        siblings = {t for t, q in zip(tokens, parents) if q == p}
        t = draw(st.integers(0, 5).filter(lambda t: t not in siblings))
        tokens.append(t)
        parents.append(p)
    return tokens, parents, draw(st.lists(st.integers(0, 5), max_size=6))


@settings(max_examples=200, deadline=None)
@given(trees_and_branches())
def test_a_branch_joins_the_tree_as_one_root_path_without_repeating_a_node(case):
    tokens, parents, branch = case
    new_tokens, new_parents = add_branch(tokens, parents, branch)
    n = len(tokens)
    assert new_tokens[:n] == tokens and new_parents[:n] == parents  # the tree's nodes keep their numbers
    assert all(-1 <= p < i for i, p in enumerate(new_parents))
    children = step_children(new_parents)
    for kids in children:  # siblings stay distinct: no path is verified twice
        assert len({new_tokens[c - 1] for c in kids}) == len(kids)
    node = 0
    for t in branch:  # the branch is a root path
        node = next(c for c in children[node] if new_tokens[c - 1] == t)
    # only what the tree lacked was added
    shared, node = 0, 0
    for t in branch:
        nxt = next((c for c in step_children(parents)[node] if tokens[c - 1] == t), None)
        if nxt is None:
            break
        shared, node = shared + 1, nxt
    assert len(new_tokens) == n + len(branch) - shared


class _ScriptedTrees:
    """A tree proposer that drafts the same tree for every request."""

    name = "scripted"

    def __init__(self, tokens, parents):
        self.tree, self.released = Draft(tokens, parents=parents), []

    def propose(self, requests):
        return [Draft([]) for _ in requests]

    def propose_tree(self, requests, shape):
        return [Draft(list(self.tree.token_ids), parents=list(self.tree.parents)) for _ in requests]

    def on_verified(self, request_id, num_committed):
        pass

    def release(self, request_id):
        self.released.append(request_id)


def test_the_branch_is_two_tokens_per_matched_token_and_none_without_a_match():
    primary = _ScriptedTrees([7, 8], [-1, 0])
    p = LookupBranch(primary)
    shape = parse_tree("static:1,1", 16)
    seq = [1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3]  # the suffix [1, 2, 3] occurred: 4, 5, 6, 9, 9, 1 followed
    (tree,) = p.propose_tree([DraftRequest(0, seq, 2, k=8)], shape)
    assert tree.token_ids == [7, 8, 4, 5, 6, 9, 9, 1] and tree.parents == [-1, 0, -1, 2, 3, 4, 5, 6]
    (tree,) = p.propose_tree([DraftRequest(1, [5, 6, 1, 2, 3, 6], 2, k=8)], shape)  # [3, 6] is new, [6] follows 5
    assert tree.token_ids == [7, 8, 1, 2] and tree.parents == [-1, 0, -1, 2]
    (tree,) = p.propose_tree([DraftRequest(2, [1, 2, 3], 2, k=8)], shape)  # no match: the primary's tree
    assert tree.token_ids == [7, 8] and tree.parents == [-1, 0]
    (tree,) = p.propose_tree([DraftRequest(3, seq, 2, k=3)], shape)  # the request's cap bounds the branch
    assert tree.token_ids == [7, 8, 4, 5, 6]
    p.release(0)
    assert primary.released == [0] and p.name == "scripted+ngram:3" and p.extra_tree_nodes == BRANCH_NODES


def test_specs_with_a_lookup_branch():
    assert split_lookup("eagle:/a+b/head.safetensors+ngram:2") == ("eagle:/a+b/head.safetensors", "ngram:2")
    assert split_lookup("eagle:/a+b/head.safetensors") == ("eagle:/a+b/head.safetensors", None)
    kind = kind_of("eagle+ngram")
    assert kind.features and kind.default_tree == kind_of("eagle").default_tree and kind.extra_tree_nodes == BRANCH_NODES
    assert kind_of("eagle+foo") is None
    model = tiny_llama(vocab=VOCAB)
    with pytest.raises(ValueError, match="not supported"):
        specgraph.Engine(model, num_blocks=16, page_size=8, draft="eagle+lookup")
    with pytest.raises(ValueError, match="ngram"):
        specgraph.Engine(model, num_blocks=16, page_size=8, draft="ngram+ngram:0")


def _record_tree_sizes(engine) -> list[int]:
    """The node counts of every tree the engine's proposer drafts from now on."""
    sizes, propose_tree = [], engine.proposer.propose_tree

    def recorded(requests, shape):
        trees = propose_tree(requests, shape)
        sizes.extend(len(t.token_ids) for t in trees)
        return trees

    engine.proposer.propose_tree = recorded
    return sizes


@pytest.mark.parametrize("tree", ["dynamic:6", "static:2,1"])
def test_eagle_with_a_lookup_branch_is_lossless_greedy(tiny_head, tree):  # noqa: F811
    """Greedy tokens equal plain decoding's at batch 1 and 4; the program has room for the largest tree plus a
    branch; the kind's default tree is EAGLE's."""
    model, out, _ = tiny_head
    prompts, _ = _patterned(VOCAB)
    plain = specgraph.Engine(model, num_blocks=64, page_size=8)
    adaptive = specgraph.Engine(model, num_blocks=64, page_size=8, draft=f"eagle:{out}+ngram")
    assert adaptive.draft_tree == "static:2,1,1" and adaptive.adaptive  # the controller's largest shape
    spec = specgraph.Engine(model, num_blocks=64, page_size=8, draft=f"eagle:{out}+ngram", draft_tree="dynamic:6",
                            adaptive=False)
    assert isinstance(spec.proposer, LookupBranch)
    assert spec.program.max_tree_nodes == 1 + parse_tree("dynamic:6", 64).scratch_nodes + BRANCH_NODES
    spec.draft_tree = tree
    for batch in (prompts[:1], prompts[3:7]):
        want = [r.token_ids for r in plain.generate(batch, max_new_tokens=16, ignore_eos=True)]
        assert [r.token_ids for r in spec.generate(batch, max_new_tokens=16, ignore_eos=True)] == want
        assert [r.token_ids for r in adaptive.generate(batch, max_new_tokens=16, ignore_eos=True)] == want
    assert spec.stats["mean_accepted_tokens"] > 1.2


def test_the_engine_verifies_the_branch_nodes_past_the_shape():
    """A primary whose trees are always wrong: whatever is accepted came from the branch, verified beside the
    primary's nodes, at batch 1 and 4; greedy output stays plain decoding's."""
    model = tiny_llama(vocab=VOCAB)
    prompts, _ = _patterned(VOCAB)
    plain = specgraph.Engine(model, num_blocks=64, page_size=8)
    proposer = LookupBranch(_ScriptedTrees([VOCAB - 1, VOCAB - 2, VOCAB - 1], [-1, -1, 0]))
    spec = specgraph.Engine(model, num_blocks=64, page_size=8, draft=proposer, draft_tree="static:2,1", adaptive=False)
    assert spec.program.max_tree_nodes == 1 + 4 + BRANCH_NODES
    sizes, depths, propose_tree = _record_tree_sizes(spec), [], spec.proposer.propose_tree

    def recorded(requests, shape):
        depths.extend(r.k for r in requests)
        return propose_tree(requests, shape)

    spec.proposer.propose_tree = recorded
    for batch in (prompts[:1], prompts[3:7]):
        want = [r.token_ids for r in plain.generate(batch, max_new_tokens=24, ignore_eos=True)]
        assert [r.token_ids for r in spec.generate(batch, max_new_tokens=24, ignore_eos=True)] == want
    assert max(sizes) > 3 and spec.stats["accepted_tokens"] > 0
    assert max(depths) == BRANCH_NODES  # a branch may run deeper than the shape's 2 levels


def test_a_lookup_branch_keeps_the_sampling_distribution():
    """test_speculative's chi-square check on its small-vocabulary target, every tree holding a lookup branch
    beside a scripted primary's two nodes."""
    target = _peaky(0)
    prompt = [1, 5, 2, 7, 1, 5]
    marginals = _exact_marginals(target, prompt, 3)
    n = 3000
    proposer = LookupBranch(_ScriptedTrees([6, 6], [-1, 0]))
    engine = specgraph.Engine(target, num_blocks=2 * n + 8, page_size=8, max_num_seqs=n, draft=proposer,
                              adaptive=False, draft_tree="static:1,1", max_tokens_per_step=n * 16,
                              prefix_caching=False)
    sizes = _record_tree_sizes(engine)
    results = engine.generate([prompt] * n, max_new_tokens=3, temperature=1.0, seed=1, ignore_eos=True)
    assert sum(size > 2 for size in sizes) > n // 2  # most trees hold a branch (each token seen before matches)
    assert _passes(torch.tensor([r.token_ids for r in results]), marginals)


@pytest.mark.parametrize("shape, k, learned", [("static:1,1", 4, 2), ("static:1,1,1", 2, 2)])
def test_a_branch_that_extends_the_first_chain_teaches_the_chain_estimate_only_what_a_chain_holds(shape, k, learned):
    """The lookup branch follows the tree's first-child chain to its end and hangs the rest below it, so that
    chain runs deeper than the shape and than the controller's chain positions (``num_draft_tokens``): the
    controller learns the levels a chain could hold, the shape's depth within its positions (it raised an
    IndexError when a verify accepted such a tree under the controller)."""
    model = tiny_llama(vocab=VOCAB)
    engine = specgraph.Engine(model, num_blocks=64, page_size=8, draft=LookupBranch(_ScriptedTrees([5, 6], [-1, 0])),
                              draft_tree=shape, num_draft_tokens=k)
    speculation = engine.speculation
    controller = speculation.ready_controller()
    assert controller is not None and controller.max_drafts == k
    (request,) = engine.submit([1, 2, 3], max_new_tokens=16)
    tree = Draft([5, 6, 7, 8, 9, 10], parents=[-1, 0, 1, 2, 3, 4])  # the branch [5, 6, 7, ...] extended the chain
    speculation.tree_ids.add(request.request_id)
    speculation.observe_decode(request, tree, [1, 2, 3, 4, 5, 6])
    tries = controller.acceptance(request.request_id).tries
    assert len(tries) == k and all(t > 0 for t in tries[:learned]) and not any(tries[learned:])
    assert controller.acceptance(request.request_id).rates()[learned - 1] > 0.5
