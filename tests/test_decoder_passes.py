"""Decoder passes: each keeps its invariant (checked by the manager), and the program decodes
incrementally through a paged cache exactly like the full forward."""
import pytest
import torch

from specgraph.compiler.options import BackendOptions
from specgraph.compiler.program import AttentionMetadata, compile_decoder
from models import FAMILIES, VOCAB, make_family


def _logits(out):
    return getattr(out, "logits", out)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_pass_keeps_outputs(family):
    # check="numeric" runs every pass's graph before and after on sample inputs (a scrambled
    # block table for paging) and raises PassCheckError on any difference.
    program = compile_decoder(make_family(family), BackendOptions(check="numeric", page_size=8))
    names = [r.name for r in program.compiled.context.log]
    assert names == ["normalize", "annotate", "positions", "kv_cache", "paging", "rotate_kv", "kv_quant", "tree_mask", "cleanup",
                     "select_logits", "hidden_states", "fuse_linears", "quantize_weights"]
    targets = [n.target for n in program.gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.specgraph.paged_attention.default) == 2
    assert targets.count(torch.ops.specgraph.cache_write.default) == 2
    assert torch.ops.aten.scaled_dot_product_attention.default not in targets
    assert torch.ops.aten.softmax.int not in targets  # manual attention fully replaced
    assert not any(t in (torch.ops.aten.arange.default, torch.ops.aten.arange.start) for t in targets)


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_stream_prefill_chunks_and_decodes(family):
    """Two sequences in one stream: a prefill chunk of one and a decode of the other, with blocks
    scattered through the pool, give the full-forward logits."""
    torch.manual_seed(0)
    model = make_family(family)
    program = compile_decoder(model, BackendOptions(page_size=8))
    a = torch.randint(0, VOCAB[family], (20,))
    b = torch.randint(0, VOCAB[family], (11,))
    with torch.no_grad():
        ref_a, ref_b = _logits(model(a[None]))[0], _logits(model(b[None]))[0]
    cache = program.new_kv_cache(16)
    ta, tb = [7, 2, 12], [5, 9]
    with torch.no_grad():
        # step 1: a[0:13] (chunk) + b[0:10] (whole prefill but its last token)
        meta = AttentionMetadata.build([(ta, 0, 13), (tb, 0, 10)], 8, [[12], [9]])
        out = program(torch.cat([a[:13], b[:10]]), meta, cache)
        torch.testing.assert_close(out, torch.stack([ref_a[12], ref_b[9]]), atol=2e-5, rtol=1e-5)
        # step 2: a[13:20] (rest of the prefill, all logits) + b[10] (a decode)
        meta = AttentionMetadata.build([(ta, 13, 7), (tb, 10, 1)], 8, [list(range(7)), [0]])
        out = program(torch.cat([a[13:], b[10:]]), meta, cache)
        torch.testing.assert_close(out, torch.cat([ref_a[13:], ref_b[10:]]), atol=2e-5, rtol=1e-5)


def test_decode_step_writes_cache_in_place():
    model = make_family("llama")
    program = compile_decoder(model, BackendOptions(page_size=8))
    cache = program.new_kv_cache(4)
    ptrs = [(k.data_ptr(), v.data_ptr()) for k, v in cache]
    meta = AttentionMetadata.build([([3], 0, 5)], 8, [[4]])
    with torch.no_grad():
        program(torch.arange(5), meta, cache)
    assert [(k.data_ptr(), v.data_ptr()) for k, v in cache] == ptrs
    k0 = cache[0][0]
    assert k0[3, :5].abs().sum() > 0, "block 3 holds the 5 tokens"
    assert k0[[0, 1, 2]].abs().sum() == 0 and k0[3, 5:].abs().sum() == 0, "nothing else written"


def test_static_capture_is_rejected_with_a_fix():
    from specgraph.compiler.backend import run_capture_pipeline
    from specgraph.compiler.pipeline import decoder_passes

    model = make_family("nanogpt")

    def capture_static(gm, example_inputs):
        run_capture_pipeline(gm, example_inputs, BackendOptions(), passes=decoder_passes())
        return gm.forward

    with pytest.raises(Exception, match="dynamic=True"):
        torch.compile(model, backend=capture_static, dynamic=False)(torch.randint(0, 97, (1, 6)))


@pytest.mark.parametrize("kv_dtype", ["fp8", "int4", "bfloat16"])
def test_quantized_cache_program(kv_dtype):
    """kv_quant keeps outputs within quantization error (checked by the manager), swaps in the
    quantized ops, and the cache holds fewer bytes per token."""
    model = make_family("sdpa_gqa")
    window = 0 if kv_dtype in ("fp8", "int4") else None  # every page quantized (test_hot_cold: the hot window)
    program = compile_decoder(model, BackendOptions(kv_dtype=kv_dtype, kv_hot_window=window, check="numeric",
                                                    page_size=8))
    targets = {n.target for n in program.gm.graph.nodes if n.op == "call_function"}
    if kv_dtype in ("fp8", "int4"):
        assert getattr(torch.ops.specgraph, f"paged_attention_{kv_dtype}").default in targets
        assert torch.ops.specgraph.paged_attention.default not in targets
    full = compile_decoder(model, BackendOptions(page_size=8))
    assert program.kv_bytes_per_token() < full.kv_bytes_per_token()
    ids = torch.randint(0, VOCAB["sdpa_gqa"], (24,))
    cache = program.new_kv_cache(8)
    meta = AttentionMetadata.build([([3, 6, 1], 0, 24)], 8, [list(range(24))])
    with torch.no_grad():
        got = program(ids, meta, cache)
        ref = model(ids[None])[0]
    assert (got.softmax(-1) - ref.softmax(-1)).abs().max() < 0.05


def test_program_runs_the_triton_kernels_in_the_interpreter():
    """The same program with the Triton kernels forced on CPU (TRITON_INTERPRET=1) gives the same logits."""
    from specgraph.kernels.config import use_triton_kernels

    model = make_family("sdpa_gqa")
    program = compile_decoder(model, BackendOptions(page_size=8))
    ids = torch.randint(0, VOCAB["sdpa_gqa"], (11,))
    meta = AttentionMetadata.build([([2, 5], 0, 11)], 8, [list(range(11))])
    with torch.no_grad():
        ref = program(ids, meta, program.new_kv_cache(6))
        with use_triton_kernels():
            got = program(ids, meta, program.new_kv_cache(6))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_fuse_linears_stacks_projections_that_share_an_input():
    """q/k/v (one input) and gate/up (another) become one linear each; outputs are checked by the
    manager (check="numeric"), and the stacked weight is the concatenation of the originals."""
    model = make_family("llama")
    program = compile_decoder(model, BackendOptions(check="numeric", page_size=8))
    record = next(r for r in program.compiled.context.log if r.name == "fuse_linears")
    layers = len(model.model.layers)
    assert record.result.matched == 2 * layers
    linears = [n for n in program.gm.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert len(linears) == 4 * layers + 1  # qkv, o, gate_up, down per layer + LM head (was 7 per layer)
    attn = model.model.layers[0].self_attn
    stacked = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert any(torch.equal(b, stacked) for name, b in program.gm.named_buffers() if name.startswith("fused_linear"))


@pytest.mark.parametrize("kind", ["panel", "onednn"])
def test_cpu_lowering_prepacks_linear_weights(kind, monkeypatch):
    """The CPU lowering runs float32 linears over weights packed once: specgraph's batch-invariant panel
    kernel where the C++ kernels are built (the default), oneDNN's layout otherwise; same outputs as
    ``aten.linear``."""
    from specgraph.compiler import lowering
    from specgraph.kernels import cpu_kernels

    if kind == "onednn" and not lowering.onednn_available():
        pytest.fail("this torch build has no oneDNN (mkldnn); the CPU lowering expects it")
    if kind == "panel" and cpu_kernels.load() is None:
        pytest.fail(f"the C++ CPU kernels did not build: {cpu_kernels.build_error()}")
    assert lowering.cpu_linear_kind() == "panel"
    monkeypatch.setattr(lowering, "cpu_linear_kind", lambda: kind)
    model = make_family("llama")
    program = compile_decoder(model, BackendOptions(page_size=8))
    plain = compile_decoder(model, BackendOptions(page_size=8, prepack_weights=False))
    lowered = lowering.lower(program.gm)
    targets = [n.target for n in lowered.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.linear.default not in targets
    packed = (torch.ops.specgraph_cpu.panel_linear.default if kind == "panel"
              else torch.ops.mkldnn._linear_pointwise.default)
    assert targets.count(packed) == 4 * len(model.model.layers) + 1
    ids = torch.randint(0, VOCAB["llama"], (9,))
    meta = AttentionMetadata.build([([2, 5], 0, 9)], 8, [list(range(9))])
    with torch.no_grad():
        got = program(ids, meta, program.new_kv_cache(6))
        ref = plain(ids, meta, plain.new_kv_cache(6))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_dump_dir_holds_the_cpu_kernels_source(tmp_path):
    compile_decoder(make_family("llama"), BackendOptions(page_size=8, dump_dir=str(tmp_path)))
    assert "paged_attention_short" in (tmp_path / "cpu_kernels.cpp").read_text()


@pytest.mark.parametrize("size_op", [torch.ops.aten.size, torch.ops.aten.size.default])
def test_a_whole_size_read_keeps_the_sequence_length_symbolic(size_op):
    """torch 2.11 captures ``x.size()`` as ``aten.size`` + ``getitem``: re-running that on fake
    tensors must not pin the dynamic size (Dynamo then refuses its own guards), and normalize
    turns it into per-dimension ``sym_size`` reads with the same result."""
    import operator

    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from specgraph.compiler.passes import PassContext
    from specgraph.passes.graph_utils import refresh_meta
    from specgraph.passes.normalize import normalize

    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    size = g.call_function(size_op, (x,))
    length = g.call_function(operator.getitem, (size, 1))
    g.output(g.call_function(aten.mul.Tensor, (x, length)))
    gm = fx.GraphModule(torch.nn.Module(), g)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC, DimDynamic.DYNAMIC])
    x.meta["val"] = mode.from_tensor(torch.ones(2, 8), symbolic_context=dynamic)
    gm.meta["fake_mode"] = mode
    refresh_meta(gm)
    assert not mode.shape_env.guards and isinstance(length.meta["val"], torch.SymInt)
    normalize(gm, PassContext(options=BackendOptions()))
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert size_op not in targets and operator.getitem not in targets
    assert aten.sym_size.int in targets
    real = torch.randn(2, 5)
    torch.testing.assert_close(gm(real), real * 5)


def test_fake_propagation_takes_the_python_decompositions_dynamo_traced():
    """Composite ops (RoPE's ``aten.matmul``) must re-propagate through their symbolic Python
    decompositions, as Dynamo's trace did: their C++ kernels read concrete sizes on some devices
    (torch 2.11 on CUDA pinned the sequence length, and Dynamo refused the build). An op with a
    C++-path kernel and a Python-dispatcher kernel tells which one ran."""
    import torch.fx as fx
    from torch._C import DispatchKey
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from specgraph.passes.graph_utils import refresh_meta

    lib = torch.library.Library("specgraph_test_decomp", "DEF")
    lib.define("scale(Tensor x) -> Tensor")
    ran = []

    def cpp_path(x):
        ran.append("dispatcher kernel")
        return x * 2

    lib.impl("scale", cpp_path, "CompositeImplicitAutograd")
    op = torch.ops.specgraph_test_decomp.scale.default

    @op.py_impl(DispatchKey.CompositeImplicitAutograd)
    def python_decomposition(x):
        ran.append("python decomposition")
        return x * 2

    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(op, (x,)))
    gm = fx.GraphModule(torch.nn.Module(), g)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    x.meta["val"] = mode.from_tensor(torch.ones(2, 8), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.STATIC, DimDynamic.DYNAMIC]))
    gm.meta["fake_mode"] = mode
    refresh_meta(gm)
    assert ran == ["python decomposition"]


def test_a_refresh_reruns_only_the_nodes_whose_inputs_or_ops_changed():
    """refresh_meta skips a node whose op and argument values are the ones it last ran with, keeps a value
    that comes out the same (so its readers are skipped too), and propagates a change to every reader."""
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from specgraph.passes.graph_utils import refresh_meta

    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    double = g.call_function(aten.mul.Tensor, (x, 2))
    flat = g.call_function(aten.view.default, (double, [-1]))
    total = g.call_function(aten.sum.default, (flat,))
    g.output(total)
    gm = fx.GraphModule(torch.nn.Module(), g)
    mode = gm.meta["fake_mode"] = FakeTensorMode()
    x.meta["val"] = mode.from_tensor(torch.ones(2, 8))
    refresh_meta(gm)
    vals = {n: n.meta["val"] for n in (double, flat, total)}
    refresh_meta(gm)  # nothing changed: the very same values
    assert all(n.meta["val"] is v for n, v in vals.items())
    double.args = (x, 3)  # a constant changed, the value's shape did not: its readers keep their values
    refresh_meta(gm)
    assert double.meta["val"] is vals[double] and total.meta["val"] is vals[total]
    double.target = aten.add.Tensor  # another op of the same shape: the same
    refresh_meta(gm)
    assert double.meta["val"] is vals[double]
    x.meta["val"] = mode.from_tensor(torch.ones(3, 4, dtype=torch.float64))  # a new input: every reader changes
    refresh_meta(gm)
    assert double.meta["val"].shape == (3, 4) and flat.meta["val"].shape == (12,)
    assert total.meta["val"].dtype == torch.float64
    with gm.graph.inserting_after(double):  # a new node between two old ones
        half = gm.graph.call_function(aten.narrow.default, (double, 0, 0, 2))
    flat.args = (half, [-1])
    refresh_meta(gm)
    assert half.meta["val"].shape == (2, 4) and flat.meta["val"].shape == (8,)
