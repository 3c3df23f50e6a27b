"""Quantized weights: the formats, the C++ kernel against the reference, the pass's invariant, the Engine.

* ``quantize_weight`` round trips stay within each format's stated error;
* the C++ kernel (``cpu_kernels.quant_linear_cpp`` and the native op compiled graphs call) is fuzzed
  against ``quant_linear_ref`` (shapes, row counts, biases, zero blocks, int4 groups), and its int4 scalar
  path (a build without AVX2) against the AVX2 tiles bit for bit;
* the ``quantize_weights`` pass keeps its invariant: a captured model's output equals the model run
  with every linear computing ``quant_linear_ref`` over its quantized weight (the LM head in its
  own scheme);
* every weight dtype works with every KV dtype and proposer: greedy speculative == greedy plain.
"""
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from models import make_family, random_prompts

import specgraph
from specgraph.kernels import prefetch
from specgraph.kernels.quant_linear import (
    ACT_BLOCK,
    ACT_QUANT_SCHEMES,
    WEIGHT_SCHEMES,
    dequantize_weight,
    quant_linear_ref,
    quantize_weight,
)
from specgraph.kernels.registry import select
from specgraph.passes.quantize_weights import HEAD_SCHEME


def _cpp():
    from specgraph.kernels import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.fail(f"the C++ CPU kernels did not build: {cpu_kernels.build_error()}")
    return cpu_kernels


@pytest.mark.parametrize("scheme", WEIGHT_SCHEMES)
def test_round_trip_error_is_within_the_format(scheme):
    torch.manual_seed(0)
    w = torch.randn(48, 128) * torch.rand(48, 1) * 3
    w[3] = 0.0  # an all-zero row stays exact
    data, scales = quantize_weight(w, scheme)
    back = dequantize_weight(data, scales, scheme)
    err = (back - w).abs()
    assert back[3].eq(0).all()
    if scheme == "int8":  # half a step of the row's scale
        assert (err <= scales[:, None] / 2 * (1 + 1e-5)).all()
    elif scheme == "int4":  # half a step of the group's scale (plus float rounding)
        step = scales[..., 0].float().repeat_interleave(32, dim=1)
        assert (err <= step / 2 + 1e-6).all()
    elif scheme == "fp8":  # 3 mantissa bits: 1/16 relative, for values in e4m3's normal range
        normal = w.abs() >= scales[:, None] * 2.0 ** -6
        assert (err[normal] <= w.abs()[normal] / 16 * (1 + 1e-6)).all()
    else:
        assert (err <= w.abs() * 2.0 ** -8).all()


def _rounding_slack(x: torch.Tensor, w: torch.Tensor, scheme: str) -> float:
    """int4 rounds x to an int8 grid; a value that sits on a grid midpoint up to float rounding may
    round either way in two implementations: one grid step times the largest weight, per flip."""
    if scheme not in ACT_QUANT_SCHEMES:
        return 0.0
    return float(x.abs().amax() / 127 * w.abs().amax())


@settings(max_examples=60, deadline=None)
@given(scheme=st.sampled_from(WEIGHT_SCHEMES), group=st.sampled_from([32, 64]), rows=st.integers(1, 12),
       n=st.integers(1, 70), blocks=st.integers(1, 6), bias=st.booleans(), zero_block=st.booleans(),
       seed=st.integers(0, 2**16), tail=st.booleans(), bf16_dot=st.booleans())
def test_cpp_kernel_matches_reference(scheme, group, rows, n, blocks, bias, zero_block, seed, tail, bf16_dot):
    """``tail``: an input size of 8 mod 16 for the widened formats (the 8-wide loop where the
    kernel otherwise takes 16 at a time). ``bf16_dot``: bfloat16 weights on the CPU's native bf16
    dot products, where it has them (x split into two bf16 parts: within 2^-17 of |x| @ |w|)."""
    cpp = _cpp()
    gen = torch.Generator().manual_seed(seed)
    k = blocks * 64 if scheme == "int4" and group == 64 else blocks * ACT_BLOCK
    k += 8 if tail and scheme not in ACT_QUANT_SCHEMES else 0
    w = torch.randn(n, k, generator=gen) * 0.2
    x = torch.randn(rows, k, generator=gen) * (1 + 10 * torch.rand(1, k, generator=gen))  # outlier columns
    if zero_block:
        x[0, :ACT_BLOCK] = 0.0
    b = torch.randn(n, generator=gen) if bias else None
    data, scales = quantize_weight(w, scheme, group)
    want = quant_linear_ref(x, data, scales, b, scheme)
    w_back = dequantize_weight(data, scales, scheme)
    tol = 1e-5 * float(want.abs().max()) + 1e-5 + _rounding_slack(x, w_back, scheme)
    with cpp.bf16_products(bf16_dot) as native:
        if native and bf16_dot and scheme == "bfloat16":
            tol += 2.0 ** -17 * float((x.abs() @ w_back.abs().T).max())
        for got in (cpp.quant_linear_cpp(x, data, scales, b, scheme),
                    torch.ops.specgraph_cpu.quant_linear(x.view(1, rows, k), data, scales, b, scheme).view(rows, n)):
            assert got.shape == want.shape
            assert (got - want).abs().max() <= tol


@settings(max_examples=40, deadline=None)
@given(scheme=st.sampled_from(WEIGHT_SCHEMES), rows=st.integers(2, 12), n=st.integers(1, 70),
       blocks=st.integers(1, 6), bias=st.booleans(), seed=st.integers(0, 2**16), bf16_dot=st.booleans(),
       ahead=st.sampled_from([0, 64, 2048, 16384]), group=st.sampled_from([32, 64]))
def test_cpp_kernel_gives_a_row_the_same_bits_in_a_call_of_any_row_count(scheme, rows, n, blocks, bias, seed,
                                                                        bf16_dot, ahead, group):
    """Batch invariance: each row of x computed alone equals, bit for bit, that row in a call of ``rows``
    rows (other tile shapes: int4 tiles of 1 to 4 rows of x, with a short last tile of weight rows where
    ``n`` is not a multiple of 4; the multi-row L2 chunking), so a verify step's token gets a decode's
    logits; and the weights' prefetch distance (``ahead`` bytes, for the single rows) changes no bit."""
    cpp = _cpp()
    gen = torch.Generator().manual_seed(seed)
    k = blocks * 64
    data, scales = quantize_weight(torch.randn(n, k, generator=gen) * 0.2, scheme, group)
    x = torch.randn(rows, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    with cpp.bf16_products(bf16_dot):
        together = cpp.quant_linear_cpp(x, data, scales, b, scheme)
        with prefetch.distances(quant=ahead):
            for i in range(rows):
                assert torch.equal(cpp.quant_linear_cpp(x[i:i + 1], data, scales, b, scheme)[0], together[i]), i


@pytest.fixture(scope="module")
def scalar_build():
    """The quantized linear built without AVX2 (``-mno-avx2``, as on a CPU without it): its scalar paths."""
    import sys
    from pathlib import Path

    with open("/proc/cpuinfo") as f:
        if " avx2" not in f.read():
            pytest.skip("this CPU has no AVX2: specgraph's own build already runs the scalar paths")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from ab_kernel import KERNELS, build

    return build("sg_quant_linear_scalar", KERNELS / "cpu_quant_linear.cpp", quantized=True, cflags=("-mno-avx2",))


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 12), n=st.integers(1, 70), blocks=st.integers(1, 6), bias=st.booleans(),
       group=st.sampled_from([32, 64]), seed=st.integers(0, 2**16))
def test_int4_scalar_path_gives_the_avx2_tiles_bits(scalar_build, rows, n, blocks, bias, group, seed):
    """A build without AVX2 computes int4 outputs one at a time with the AVX2 tile's float operations, so a
    model gives the same int4 outputs on any x86 CPU (the widened formats' scalar sums come in another order:
    within the reference's tolerance, not bit for bit)."""
    gen = torch.Generator().manual_seed(seed)
    k = blocks * 64
    data, scales = quantize_weight(torch.randn(n, k, generator=gen) * 0.2, "int4", group)
    x = torch.randn(rows, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    assert torch.equal(scalar_build.quant_linear_cpu(x, data, scales, b, "int4"),
                       _cpp().quant_linear_cpp(x, data, scales, b, "int4"))


def test_native_bf16_dots_are_built_where_the_cpu_has_them_and_chosen_by_measurement():
    cpp = _cpp()
    flags = set()
    if os.path.exists("/proc/cpuinfo"):
        flags = {f for line in open("/proc/cpuinfo") if line.startswith("flags") for f in line.split(":")[1].split()}
    if {"avx512_bf16", "avx512f"} <= flags:  # the extension is built with -march=native
        assert cpp.load().bf16_dot_available()
    weights = [torch.randn(64, 96).bfloat16() for _ in range(3)]
    with cpp.bf16_products(False):
        native, line = cpp.choose_bf16_products(weights, repeats=1)
        chosen = cpp.load().set_bf16_dots(False)
        assert chosen == native
    if cpp.load().bf16_dot_available():
        assert "widened/native bf16 dots: 1 rows" in line
        assert ("native bf16 dots at every row count" in line) == chosen
    else:
        assert "no native bf16 dot products" in line and not chosen


def test_registry_runs_the_cpp_kernel_on_cpu_float32_and_the_reference_otherwise():
    _cpp()
    data, scales = quantize_weight(torch.randn(64, 64), "int8")
    assert select("quant_linear", torch.randn(2, 64), data, scales, None, "int8").name == "cpp"
    x16 = torch.randn(2, 64, dtype=torch.bfloat16)
    assert select("quant_linear", x16, data, scales, None, "int8").name == "reference"
    got = torch.ops.specgraph.quant_linear(x16, data, scales, None, "int8")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), quant_linear_ref(x16.float(), data, scales, None, "int8"),
                               atol=0.05, rtol=0.02)


def test_malformed_arguments_are_clear_errors():
    data, scales = quantize_weight(torch.randn(8, 64), "int4")
    with pytest.raises(ValueError, match="int4 scales are float16"):
        torch.ops.specgraph.quant_linear(torch.randn(1, 64), data, scales.float(), None, "int4")
    with pytest.raises(ValueError, match=r"x must be float \[\.\.\., 64\]"):
        torch.ops.specgraph.quant_linear(torch.randn(1, 32), data, scales, None, "int4")
    with pytest.raises(ValueError, match="unknown scheme"):
        torch.ops.specgraph.quant_linear(torch.randn(1, 64), data, scales, None, "int3")
    with pytest.raises(ValueError, match="one device"):  # (a weight left behind when the model moved)
        quant_linear_ref(torch.randn(1, 64, device="meta"), data, scales, None, "int4")
    with pytest.raises(ValueError, match="weight_dtype='int3' is not supported; valid: auto, float32"):
        specgraph.BackendOptions(weight_dtype="int3")


def _quantized_twin_forward(model: torch.nn.Module, scheme: str, lm_head: torch.nn.Linear):
    """Patch every nn.Linear of ``model`` to compute ``quant_linear_ref`` over its quantized weight."""
    def patched(mod, scheme_of_mod):
        data, scales = quantize_weight(mod.weight, scheme_of_mod)

        def forward(x):
            return quant_linear_ref(x, data, scales, mod.bias, scheme_of_mod)
        return forward

    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.forward = patched(mod, HEAD_SCHEME.get(scheme, scheme) if mod is lm_head else scheme)


@pytest.mark.parametrize("scheme", WEIGHT_SCHEMES)
def test_pass_invariant_each_linear_is_the_reference_over_its_quantized_weight(scheme):
    model = make_family("llama")
    ids = torch.tensor([random_prompts("llama", [11])[0]])
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=specgraph.backend(weight_dtype=scheme, lowering="eager"))
    with torch.no_grad():
        got = compiled(ids).logits
        plain = model(ids).logits
    twin = make_family("llama")
    _quantized_twin_forward(twin, scheme, twin.lm_head)
    with torch.no_grad():
        want = twin(ids).logits
    scale = float(want.abs().max())
    assert (got - want).abs().max() <= 1e-4 * scale + (0.02 * scale if scheme in ACT_QUANT_SCHEMES else 0)
    assert not torch.equal(got, plain)  # the weights really are quantized
    assert F.cosine_similarity(got.flatten(), plain.flatten(), dim=0) > 0.98


FAMILIES = ("llama", "gpt2", "nanogpt", "sdpa_gqa")
KV_DTYPES = ("auto", "fp8", "int4")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("weight_dtype", WEIGHT_SCHEMES)
def test_greedy_speculation_with_quantized_weights_is_lossless(family, weight_dtype):
    """Each weight dtype meets every KV dtype across the families; layer_skip shares the target's
    quantized weights and cache; on llama also prompt lookup and a draft model."""
    model = make_family(family)
    prompts = random_prompts(family, [9, 6])
    kv = KV_DTYPES[(FAMILIES.index(family) + WEIGHT_SCHEMES.index(weight_dtype)) % len(KV_DTYPES)]
    plain = specgraph.Engine(model, weight_dtype=weight_dtype, kv_dtype=kv, lowering="eager", num_blocks=64)
    assert any(n.target == torch.ops.specgraph.quant_linear.default for n in plain.program.gm.graph.nodes)
    want = [r.token_ids for r in plain.generate(prompts, max_new_tokens=10)]
    drafts = ["layer_skip:1"] + (["ngram:2", make_family("llama", seed=1)] if family == "llama" else [])
    for draft in drafts:
        spec = specgraph.Engine(model, weight_dtype=weight_dtype, kv_dtype=kv, lowering="eager", num_blocks=64,
                                draft=draft, num_draft_tokens=3)
        got = [r.token_ids for r in spec.generate(prompts, max_new_tokens=10)]
        assert got == want, f"draft {draft!r} changed the greedy output of a {weight_dtype} target ({kv} KV)"


@pytest.mark.parametrize("target_dtype, draft_dtype", [("auto", "int4"), ("int8", "auto"), ("fp8", "int8")])
def test_a_draft_model_may_use_its_own_weight_dtype(target_dtype, draft_dtype):
    """A draft model quantized differently from the target leaves the target's greedy output as it is;
    its own linears really are in the draft's format."""
    model, draft = make_family("llama"), make_family("llama", seed=1)
    prompts = random_prompts("llama", [9, 6])
    plain = specgraph.Engine(model, weight_dtype=target_dtype, lowering="eager", num_blocks=64)
    want = [r.token_ids for r in plain.generate(prompts, max_new_tokens=10)]
    spec = specgraph.Engine(model, weight_dtype=target_dtype, lowering="eager", num_blocks=64, draft=draft,
                            draft_weight_dtype=draft_dtype, num_draft_tokens=3)
    assert [r.token_ids for r in spec.generate(prompts, max_new_tokens=10)] == want
    assert spec.stats["draft_tokens"] > 0

    def schemes(gm):
        return {n.args[4] for n in gm.graph.nodes if n.target == torch.ops.specgraph.quant_linear.default}

    assert schemes(spec.program.gm) == ({target_dtype, HEAD_SCHEME.get(target_dtype, target_dtype)}
                                        if target_dtype != "auto" else set())
    assert schemes(spec.proposer.program.gm) == ({draft_dtype, HEAD_SCHEME.get(draft_dtype, draft_dtype)}
                                                 if draft_dtype != "auto" else set())


def test_a_quantized_draft_under_a_float_target_is_calibrated():
    """The target's float weights need no calibration; the draft's int8 weights get their own."""
    model, draft = make_family("llama"), make_family("llama", seed=1)
    ids = torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    spec = specgraph.Engine(model, weight_calibration=ids, lowering="eager", num_blocks=64, draft=draft,
                            draft_weight_dtype="int8", num_draft_tokens=3)
    assert spec.program.compiled.context.options.weight_calibration == ()
    record = next(r for r in spec.proposer.program.compiled.context.log if r.name == "quantize_weights")
    assert record.result.info["calibration_tokens"] == 200


@pytest.mark.parametrize("draft", ["layer_skip:1", "ngram:2"])
def test_a_draft_without_weights_of_its_own_refuses_another_weight_dtype(draft):
    model = make_family("llama")
    with pytest.raises(ValueError, match=r"draft_weight_dtype='int4' needs a draft model"):
        specgraph.Engine(model, weight_dtype="int8", lowering="eager", num_blocks=64, draft=draft,
                         draft_weight_dtype="int4")
    with pytest.raises(ValueError, match="draft_weight_dtype='int4' is given without a draft"):
        specgraph.Engine(model, lowering="eager", num_blocks=64, draft_weight_dtype="int4")


def test_generated_code_calls_the_native_quantized_linear(tmp_path):
    """The inductor lowering keeps quantized linears as calls of the C++ kernel (one graph per step
    shape) and generates the same tokens as the eager lowering."""
    _cpp()
    model = make_family("llama")
    prompts = random_prompts("llama", [9, 6])
    eager = specgraph.Engine(model, weight_dtype="int4", lowering="eager", num_blocks=64)
    want = [r.token_ids for r in eager.generate(prompts, max_new_tokens=6)]
    compiled = specgraph.Engine(model, weight_dtype="int4", lowering="inductor", num_blocks=64,
                                dump_dir=str(tmp_path))
    assert [r.token_ids for r in compiled.generate(prompts, max_new_tokens=6)] == want
    bucket = (tmp_path / "inductor_bucket1.py").read_text()
    assert "specgraph_cpu::quant_linear" in bucket


# ------------------------------------------------------------------ calibrated (GPTQ) codes
def _correlated_inputs(rows: int, k: int, seed: int, draw: int = 0) -> torch.Tensor:
    """Inputs with correlated columns and a few outlier columns, as a transformer's are: the
    distribution is fixed by ``seed``, the sample by ``draw``."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=gen) / k ** 0.5 + torch.eye(k)
    outliers = torch.randperm(k, generator=gen)[:3]
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(10_000 + draw)) @ mix
    x[:, outliers] *= 8.0
    return x


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@settings(max_examples=6, deadline=None)
@given(n=st.integers(16, 48), k=st.sampled_from([16, 48, 160]), seed=st.integers(0, 1000))
def test_gptq_codes_keep_the_format_and_cut_the_output_error(scheme, n, k, seed):
    """Same per-channel scales as nearest rounding, codes on the format's grid, and a smaller output
    error on the calibration inputs and on held-out inputs of the same distribution (summed over
    rows: GPTQ is greedy, so one row alone may come out slightly worse)."""
    from specgraph.compiler.calibration import gptq_quantize

    gen = torch.Generator().manual_seed(seed + 1)
    w = torch.randn(n, k, generator=gen)
    x = _correlated_inputs(4 * k, k, seed)
    data, scales = gptq_quantize(w, x.T @ x / x.shape[0], scheme)
    near_data, near_scales = quantize_weight(w, scheme)
    assert data.dtype == near_data.dtype and data.shape == near_data.shape
    assert torch.equal(scales, near_scales)
    if scheme == "int8":
        assert int(data.abs().max()) <= 127

    def error(inputs, d):
        return float(((inputs @ (w - dequantize_weight(d, scales, scheme)).T) ** 2).sum())

    for inputs in (x, _correlated_inputs(4 * k, k, seed, draw=1)):  # calibration, then held out
        assert error(inputs, data) < error(inputs, near_data)


def test_gptq_solves_rows_independently():
    """A stacked (fused) weight gets the rows its parts get alone: the fused program and the unfused
    reference the self-check runs hold the very same codes."""
    from specgraph.compiler.calibration import gptq_quantize

    w, x = torch.randn(40, 64), _correlated_inputs(256, 64, 0)
    h = x.T @ x / 256
    whole = gptq_quantize(w, h, "fp8")
    parts = [gptq_quantize(w[a:b], h, "fp8") for a, b in ((0, 24), (24, 32), (32, 40))]
    assert torch.equal(whole[0].view(torch.uint8), torch.cat([p[0] for p in parts]).view(torch.uint8))
    assert torch.equal(whole[1], torch.cat([p[1] for p in parts]))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_calibrated_weights_are_checked_and_lossless_under_speculation(family):
    """An fp8 program calibrated on token ids passes the compile-time self-check (its reference
    holds the same codes), differs from nearest rounding, and greedy speculation stays exact."""
    model = make_family(family)
    ids = torch.randint(0, 64, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    prompts = random_prompts(family, [9, 6])
    calibrated = specgraph.Engine(model, weight_dtype="fp8", weight_calibration=ids, lowering="eager", num_blocks=64)
    nearest = specgraph.Engine(model, weight_dtype="fp8", weight_calibration=None, lowering="eager", num_blocks=64)
    record = next(r for r in calibrated.program.compiled.context.log if r.name == "quantize_weights")
    assert record.result.info["calibration_tokens"] == 300
    codes = {n: b for n, b in calibrated.program.gm.named_buffers() if b.dtype == torch.float8_e4m3fn}
    other = dict(nearest.program.gm.named_buffers())
    assert codes and all(not torch.equal(b.view(torch.uint8), other[n].view(torch.uint8)) for n, b in codes.items())
    want = [r.token_ids for r in calibrated.generate(prompts, max_new_tokens=8)]
    spec = specgraph.Engine(model, weight_dtype="fp8", weight_calibration=ids, lowering="eager", num_blocks=64,
                            draft="layer_skip:1", num_draft_tokens=3)
    assert [r.token_ids for r in spec.generate(prompts, max_new_tokens=8)] == want


def test_bad_calibration_is_a_clear_error():
    model = make_family("llama")
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        specgraph.Engine(model, weight_dtype="int8", weight_calibration=[1, 2, 10 ** 6], lowering="eager",
                         num_blocks=64)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        specgraph.Engine(model, weight_dtype="int8", weight_calibration="some text", lowering="eager", num_blocks=64)
    with pytest.raises(ValueError, match="token ids"):
        specgraph.BackendOptions(weight_calibration=("a",))


def test_the_bf16_products_choice_is_measured_once_per_machine_and_set_in_every_build(tmp_path, monkeypatch):
    """A program with bfloat16 weights sets the process-wide switch on each build: from a measurement the
    first time (kept beside the step plan), from the kept choice after; none without bfloat16 weights."""
    import torch.fx as fx

    from specgraph.compiler.step_plan import set_bf16_products

    cpp = _cpp()
    monkeypatch.setenv("SPECGRAPH_GRAPH_CACHE", str(tmp_path))
    root = torch.nn.Module()
    root.w = torch.nn.Parameter(torch.randn(64, 96).bfloat16(), requires_grad=False)
    graph = fx.Graph()
    x = graph.placeholder("x")
    w = graph.get_attr("w")
    graph.output(graph.call_function(torch.ops.specgraph.quant_linear.default, (x, w, None, None, "bfloat16")))
    gm = fx.GraphModule(root, graph)
    with cpp.bf16_products(False):
        first = set_bf16_products(gm, "key")
        native = cpp.load().set_bf16_dots(False)
        assert "widened/native bf16 dots" in first or "no native bf16 dot products" in first
        assert list(tmp_path.glob("measurements/key-*-bf16-dots.json"))
        second = set_bf16_products(gm, "key")
        assert second == "as measured by an earlier build on this machine: " + first
        assert cpp.load().set_bf16_dots(False) == native
        kept = next(tmp_path.glob("measurements/key-*-bf16-dots.json"))
        kept.write_text('{"native": true, "line": "native"}')  # a kept choice is what sets the switch
        assert set_bf16_products(gm, "key").endswith(": native")
        assert cpp.load().set_bf16_dots(False) == cpp.load().bf16_dot_available()
        empty = fx.GraphModule(torch.nn.Module(), fx.Graph())
        assert set_bf16_products(empty, "key") == ""
