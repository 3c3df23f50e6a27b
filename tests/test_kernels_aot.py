"""AOT: every kernel specialization builds to PTX + cubin for sm_80 and sm_90, without a GPU.

The compile runs in a subprocess started without TRITON_INTERPRET (which this module and
conftest set for the interpreter tests): under it @triton.jit returns interpreter objects.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (conftest does it too)

import json
import subprocess
import sys
import textwrap

import pytest

from specgraph.kernels import aot

ARCHS = (80, 90)
SCRIPT = textwrap.dedent(
    """
    import json, sys
    from specgraph.kernels.aot import compile_all
    results = compile_all(int(sys.argv[2]), dump_dir=sys.argv[1])
    print("SUMMARY " + json.dumps([dict(tag=r.spec.tag, ptx_chars=len(r.ptx), cubin_size=r.cubin_size,
                                        target_line=next(l for l in r.ptx.splitlines() if l.startswith(".target")))
                                   for r in results]))
    """
)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    dump_dir = tmp_path_factory.mktemp("aot_dump")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # one process per architecture, side by side: ptxas is single-threaded, and CI has 2 cores
    procs = {arch: subprocess.Popen([sys.executable, "-c", SCRIPT, str(dump_dir), str(arch)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for arch in ARCHS}
    summary = {}
    try:
        for arch, proc in procs.items():
            out, err = proc.communicate(timeout=900)
            assert proc.returncode == 0, f"AOT compile for sm_{arch} failed:\n{err[-6000:]}"
            line = next(l for l in out.splitlines() if l.startswith("SUMMARY "))
            summary[arch] = json.loads(line.removeprefix("SUMMARY "))
    finally:
        for proc in procs.values():
            proc.kill()  # (a no-op for one that finished)
    return summary, dump_dir


def test_every_specialization_builds(compiled):
    summary, _ = compiled
    expected = sorted(s.tag for name in aot._KERNELS for s in aot.specializations(name))
    assert {"cache_write_fp8", "cache_write_int4", "paged_attention_fp8", "paged_attention_int4"} <= set(aot._KERNELS)
    for arch, rows in summary.items():
        assert sorted(r["tag"] for r in rows) == expected
        for r in rows:
            assert r["ptx_chars"] > 0 and r["cubin_size"] > 0, (arch, r)
            assert r["target_line"].startswith(f".target sm_{arch}"), (arch, r)


def test_dump_dir_has_sources_and_ptx(compiled):
    summary, dump_dir = compiled
    assert "@triton.jit" in (dump_dir / "paged_attention.py").read_text()
    assert "@triton.jit" in (dump_dir / "cache_write.py").read_text()
    assert "def _quantize_int4_row" in (dump_dir / "cache_write_int4.py").read_text()  # helpers travel along
    assert "def e4m3_from_bits" in (dump_dir / "triton_helpers.py").read_text()
    assert "def _quantize_act_block" in (dump_dir / "quant_linear_int4.py").read_text()
    for arch, rows in summary.items():
        for r in rows:
            assert (dump_dir / f"{r['tag']}.sm{arch}.ptx").stat().st_size == r["ptx_chars"]


def test_specializations_cover_the_launch_matrix():
    """Every (dtype, head_dim) and GQA group we support maps to a built paged_attention binary."""
    specs = aot.specializations("paged_attention")
    built = {(s.dtype, s.head_dim, s.block_g) for s in specs}
    for dtype in aot.DTYPES:
        for head_dim in aot.HEAD_DIMS:
            for group in aot.GQA_GROUPS:
                assert (dtype, head_dim, max(16, 1 << (group - 1).bit_length())) in built
    assert {s.page_size for s in specs} == set(aot.PAGE_SIZES)


def test_quantized_specializations_cover_the_launch_matrix():
    """Every (q / k / v dtype, head_dim) and GQA group maps to a built quantized binary; fp8 never
    uses Triton's float8 type (unsupported below sm_89): its caches are uint8 bit patterns."""
    for name in ("cache_write_fp8", "cache_write_int4"):
        assert {(s.dtype, s.head_dim) for s in aot.specializations(name)} == {
            (dt, d) for dt in aot.DTYPES for d in aot.HEAD_DIMS}
    for name in ("paged_attention_fp8", "paged_attention_int4"):
        specs = aot.specializations(name)
        built = {(s.dtype, s.head_dim, s.block_g) for s in specs}
        for dtype in aot.DTYPES:
            for head_dim in aot.HEAD_DIMS:
                for group in aot.GQA_GROUPS:
                    assert (dtype, head_dim, max(16, 1 << (group - 1).bit_length())) in built
        assert {s.page_size for s in specs} == set(aot.PAGE_SIZES)
        signature = aot._KERNELS[name][1](specs[0]).signature
        assert signature["k_cache_ptr"] == signature["v_cache_ptr"] == "*u8"


def test_attention_layouts_and_variants_are_specializations_of_one_kernel():
    """The float, fp8 and int4 attention builds are one kernel with LAYOUT set; each layout also
    builds every combination of the variant's constexpr flags (the window is a runtime argument)."""
    def constexpr(source, name):
        return source.constants[(source.fn.arg_names.index(name),)]

    names = ("paged_attention", "paged_attention_fp8", "paged_attention_int4")
    assert len({aot._KERNELS[name][0] for name in names}) == 1
    for name, layout in zip(names, ("float", "fp8", "int4")):
        specs = aot.specializations(name)
        plain = aot._KERNELS[name][1](specs[0])
        assert constexpr(plain, "LAYOUT") == layout
        assert plain.signature["window"] == "i32" and plain.signature["softcap"] == "fp32"
        assert constexpr(plain, "alibi_slopes_ptr") is None  # no ALiBi: the launcher passes None
        assert {(s.softcap, s.alibi) for s in specs} == {(False, False), *aot.VARIANT_FLAGS}
        flagged = aot._KERNELS[name][1](next(s for s in specs if s.softcap and s.alibi))
        assert constexpr(flagged, "HAS_SOFTCAP") and constexpr(flagged, "HAS_ALIBI")
        assert flagged.signature["alibi_slopes_ptr"] == "*fp32"
        tree = aot._KERNELS[name][1](next(s for s in specs if s.tree))  # token trees: one more mask
        assert constexpr(tree, "HAS_TREE") and tree.signature["tree_mask_ptr"] == "*i32"
        assert not constexpr(plain, "HAS_TREE") and constexpr(plain, "tree_mask_ptr") is None


def test_quant_linear_specializations_cover_the_launch_matrix():
    """The four quant_linear schemes are one kernel with SCHEME set; each builds x's dtype x the
    launcher's BLOCK_M values x with / without bias; fp8 weights are uint8 bit patterns."""
    from specgraph.kernels import quant_linear_triton as qlt
    from specgraph.kernels.quant_linear import WEIGHT_SCHEMES

    def constexpr(source, name):
        return source.constants[(source.fn.arg_names.index(name),)]

    names = [f"quant_linear_{scheme}" for scheme in WEIGHT_SCHEMES]
    assert {aot._KERNELS[name][0] for name in names} == {qlt.quant_linear_kernel}
    assert {qlt.block_m(m) for m in (1, 16, 17, 4096)} == set(qlt.BLOCK_MS)
    for scheme, name in zip(WEIGHT_SCHEMES, names):
        specs = aot.specializations(name)
        assert {(s.dtype, s.block_m, s.bias) for s in specs} == {
            (dt, bm, bias) for dt in aot.QUANT_LINEAR_DTYPES for bm in qlt.BLOCK_MS for bias in (False, True)}
        plain = aot._KERNELS[name][1](next(s for s in specs if not s.bias))
        assert constexpr(plain, "SCHEME") == scheme and constexpr(plain, "bias_ptr") is None
        assert constexpr(plain, "BLOCK_K") % 32 == 0
        assert plain.signature["K"] == "i32" and plain.signature["group"] == "i32"  # one binary per scheme and dtype
        biased = aot._KERNELS[name][1](next(s for s in specs if s.bias))
        assert constexpr(biased, "HAS_BIAS") and biased.signature["bias_ptr"] == "*fp32"
    assert aot._KERNELS["quant_linear_fp8"][1](aot.specializations("quant_linear_fp8")[0]).signature["w_ptr"] == "*u8"


def test_refuses_to_run_under_the_interpreter():
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        aot.compile_all(90)


def test_unknown_names_raise_value_error():
    with pytest.raises(ValueError, match="valid"):
        aot.compile_for_target("flash_attention", 90)
    with pytest.raises(ValueError, match="sm_80"):
        aot.compile_all("sm_75")
