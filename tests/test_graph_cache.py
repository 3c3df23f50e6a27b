"""The persistent graph cache: a second Engine (a second process) skips capture and passes, and is
exact; any change to the weights or the options is a miss; programs with user passes are not cached."""
import subprocess
import sys

import pytest
import torch

import specgraph
from specgraph.compiler import graph_cache
from specgraph.compiler.options import BackendOptions
from models import make_family, uncached_greedy

PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGRAPH_GRAPH_CACHE", str(tmp_path / "graphs"))
    return tmp_path / "graphs"


@pytest.mark.parametrize("family, kv_dtype", [("llama", "auto"), ("nanogpt", "fp8")])
def test_second_engine_loads_the_graph_and_is_exact(cache, family, kv_dtype):
    model = make_family(family)
    first = specgraph.Engine(model, num_blocks=32, page_size=8, kv_dtype=kv_dtype)
    second = specgraph.Engine(model, num_blocks=32, page_size=8, kv_dtype=kv_dtype)
    assert not first.program.from_cache and second.program.from_cache
    # the first runs the graph as the second loads it, so compile caches keyed on the code serve both
    assert str(first.program.gm) == str(second.program.gm)  # its modules' layout and its code
    assert len(list(cache.iterdir())) == 1
    want = first.generate(PROMPT, max_new_tokens=8, ignore_eos=True)[0].token_ids
    assert second.generate(PROMPT, max_new_tokens=8, ignore_eos=True)[0].token_ids == want
    if kv_dtype == "auto":
        assert want == uncached_greedy(model, PROMPT, 8)


def test_a_cached_graph_compiles_with_inductor(cache):
    model = make_family("llama")
    specgraph.Engine(model, num_blocks=32, page_size=8, lowering="eager")
    engine = specgraph.Engine(model, num_blocks=32, page_size=8, lowering="inductor")
    assert engine.program.from_cache
    assert engine.program.wait_for_steps(timeout=600) and engine.program.step_error is None
    assert engine.generate(PROMPT, max_new_tokens=8, ignore_eos=True)[0].token_ids == uncached_greedy(model, PROMPT, 8)


def test_weights_options_and_user_passes_change_the_key(cache):
    model = make_family("llama")
    key = graph_cache.cache_key(model, BackendOptions(), 8)
    assert key == graph_cache.cache_key(model, BackendOptions(), 8)
    assert key != graph_cache.cache_key(model, BackendOptions(kv_dtype="int4"), 8)
    assert key != graph_cache.cache_key(model, BackendOptions(page_size=32), 8)
    assert graph_cache.cache_key(model, BackendOptions(passes=[lambda gm, ctx: None]), 8) is None
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1e-3  # one weight, a little
    assert key != graph_cache.cache_key(model, BackendOptions(), 8)


def test_cache_off(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECGRAPH_GRAPH_CACHE", "0")
    assert graph_cache.cache_dir() is None
    model = make_family("llama")
    specgraph.Engine(model, num_blocks=32, page_size=8)
    assert not specgraph.Engine(model, num_blocks=32, page_size=8).program.from_cache


def test_a_new_process_hits_the_cache(cache):
    script = ("import sys; sys.path.insert(0, 'tests'); import specgraph; from models import make_family; "
              "e = specgraph.Engine(make_family('gpt2'), num_blocks=32, page_size=8); "
              "print(e.program.from_cache, e.generate([1, 2, 3], max_new_tokens=4, ignore_eos=True)[0].token_ids)")
    env = {**__import__("os").environ, "SPECGRAPH_GRAPH_CACHE": str(cache)}
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
            for _ in range(2)]
    outs = [r.stdout.strip().splitlines()[-1] for r in runs]
    assert outs[0].startswith("False") and outs[1].startswith("True"), [r.stderr[-2000:] for r in runs]
    assert outs[0].split(" ", 1)[1] == outs[1].split(" ", 1)[1]


def test_the_sources_digest_covers_the_code_not_the_tests_or_benchmarks(monkeypatch, tmp_path):
    """A change to a pass, the runtime or a C++ kernel is a miss; a new benchmark or test is not (it would
    cost every machine a fresh capture and code generation for nothing)."""
    for folder in (*graph_cache.CODE_DIRS, "tests", "benchmarks"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "a.py").write_text("x = 1\n")
    (tmp_path / "kernels" / "k.cpp").write_text("int x;\n")
    monkeypatch.setattr(graph_cache, "_PACKAGE", tmp_path)
    before = graph_cache._sources_digest()
    (tmp_path / "benchmarks" / "a.py").write_text("x = 2\n")
    (tmp_path / "tests" / "b.py").write_text("y = 1\n")
    assert graph_cache._sources_digest() == before
    for changed in ("kernels/k.cpp", "passes/a.py", "runtime/a.py"):
        (tmp_path / changed).write_text("changed\n")
        assert graph_cache._sources_digest() != before
        before = graph_cache._sources_digest()
