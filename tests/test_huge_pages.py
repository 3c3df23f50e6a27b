"""Weights in huge pages (``kernels/huge_pages.py``): the same values at other addresses, in mappings that
ask the kernel for 2 MiB pages, each tensor moved once, only what a graph reads; and a program whose
weights were moved computes what it computed before."""
from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.fx as fx

from specgraph.kernels import huge_pages


@pytest.fixture
def thp(monkeypatch):
    """Placement on, whatever this machine's THP mode (the kernel may then back the mappings with small
    pages: the placement and the advice are what these tests check)."""
    monkeypatch.delenv("SPECGRAPH_HUGE_PAGES", raising=False)
    monkeypatch.setattr(huge_pages, "thp_allows", lambda *args: True)
    monkeypatch.setattr(huge_pages, "_filling", None)  # a fresh chunk: other tests' tensors fill the shared one


def test_the_thp_mode_decides(tmp_path):
    for mode, allows in (("always [madvise] never", True), ("[always] madvise never", True),
                         ("always madvise [never]", False)):
        (tmp_path / "enabled").write_text(mode + "\n")
        assert huge_pages.thp_allows.__wrapped__(str(tmp_path / "enabled")) is allows, mode
    assert huge_pages.thp_allows.__wrapped__(str(tmp_path / "missing")) is False


def _advised(t: torch.Tensor) -> bool:
    """Whether the mapping holding ``t`` carries the huge-page advice (``hg`` in smaps' VmFlags)."""
    ptr, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(a, 16) for a in head.split("-"))
                inside = start <= ptr < end
            elif inside and head == "VmFlags:":
                return "hg" in line.split()
    return False


def test_moved_keeps_values_and_asks_for_huge_pages(thp):
    t = torch.randn(512, 300)
    out = huge_pages.moved(t)
    assert out is not t and out.data_ptr() != t.data_ptr() and torch.equal(out, t)
    assert out.is_contiguous() and out.dtype == t.dtype and out.data_ptr() % huge_pages.ALIGN == 0
    assert huge_pages.in_huge_pages(out) and not huge_pages.in_huge_pages(t)
    assert _advised(out) is os.path.exists(huge_pages._THP_MODE)  # (advice is refused by a kernel without THP)
    assert huge_pages.moved(out) is out  # moved once
    small = torch.randn(8, 8)
    assert huge_pages.moved(small) is small  # under MIN_BYTES: left where it is
    int8 = torch.randint(-128, 127, (1024, 200), dtype=torch.int8)
    assert torch.equal(huge_pages.moved(int8), int8)


def test_small_tensors_share_a_mapping_and_it_is_unmapped_when_they_die(thp):
    gc.collect()  # (mappings of tensors already dead go now, not during the counts below)
    before = len(huge_pages._regions)
    big = huge_pages.moved(torch.randn(huge_pages.CHUNK // 4 + 1))  # over half a chunk: a mapping of its own
    assert len(huge_pages._regions) == before + 1 and big.data_ptr() % huge_pages.HUGE_PAGE == 0
    ts = [huge_pages.moved(torch.full((20000,), float(i))) for i in range(3)]
    assert len(huge_pages._regions) == before + 2  # the three share one new chunk
    assert all(torch.equal(t, torch.full((20000,), float(i))) for i, t in enumerate(ts))
    assert [b.data_ptr() - a.data_ptr() for a, b in zip(ts, ts[1:])] == [80000, 80000]  # packed, 64-byte aligned
    ptr = big.data_ptr()
    del big
    gc.collect()
    assert not any(start <= ptr < end for start, end in huge_pages._regions.items())  # its mapping is gone
    assert all(huge_pages.in_huge_pages(t) for t in ts)


def test_tensors_placed_from_several_threads_never_overlap(thp):
    from concurrent.futures import ThreadPoolExecutor

    def place(i):
        return [huge_pages.moved(torch.full((16384 + 97 * i,), float(i))) for _ in range(40)]

    with ThreadPoolExecutor(4) as pool:
        placed = [t for ts in pool.map(place, range(4)) for t in ts]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in placed)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert all(torch.equal(t, torch.full_like(t, t[0].item())) for t in placed)


def test_nothing_moves_when_turned_off(monkeypatch):
    monkeypatch.setenv("SPECGRAPH_HUGE_PAGES", "0")
    t = torch.randn(512, 300)
    assert not huge_pages.available() and huge_pages.moved(t) is t


def test_move_buffers_moves_what_the_graph_reads_and_keeps_its_outputs(thp):
    """The invariant: the graph computes the same bits; buffers it doesn't read and parameters stay."""
    root = torch.nn.Module()
    root.add_module("sub", torch.nn.Module())
    root.sub.register_buffer("w", torch.randn(300, 256))
    root.register_buffer("bias", torch.randn(300))
    root.register_parameter("p", torch.nn.Parameter(torch.randn(256, 256), requires_grad=False))
    graph = fx.Graph()
    x = graph.placeholder("x")
    h = graph.call_function(torch.ops.aten.linear.default, (x, graph.get_attr("p")))
    graph.output(graph.call_function(torch.ops.aten.linear.default,
                                     (h, graph.get_attr("sub.w"), graph.get_attr("bias"))))
    gm = fx.GraphModule(root, graph)
    gm.register_buffer("unused", torch.randn(300, 256))  # (a pass's leftover, say)
    x = torch.randn(5, 256)
    expected = gm(x)
    unused, param = gm.unused, gm.p
    assert huge_pages.move_buffers(gm) == 300 * 256 * 4
    assert huge_pages.in_huge_pages(gm.sub.w) and gm.unused is unused and gm.p is param
    assert not huge_pages.in_huge_pages(gm.bias)  # under MIN_BYTES
    assert "sub.w" in gm.state_dict()  # still a persistent buffer
    assert torch.equal(gm(x), expected)
    assert huge_pages.move_buffers(gm) == 0  # nothing left to move


def test_panel_packing_lands_in_huge_pages(thp):
    from specgraph.kernels import cpu_kernels
    from specgraph.kernels.panel_linear import packed

    if cpu_kernels.load() is None:
        pytest.fail(f"the C++ CPU kernels did not build: {cpu_kernels.build_error()}")
    w = torch.randn(256, 256)
    assert huge_pages.in_huge_pages(packed(w))


def test_zeros_are_made_in_huge_pages_only_where_moved_would_put_them(thp):
    big = huge_pages.zeros((300, 512), torch.float16)
    assert huge_pages.in_huge_pages(big) and big.dtype == torch.float16 and not big.any()
    small = huge_pages.zeros((16, 16), torch.float32)
    assert not huge_pages.in_huge_pages(small) and not small.any()
    assert huge_pages.zeros((300, 512), torch.float32, "meta").device.type == "meta"


@pytest.mark.parametrize("kind", ["float", "fp8", "int4", "hot_cold"])
def test_kv_pools_are_allocated_in_huge_pages_as_they_would_be_elsewhere(thp, kind, monkeypatch):
    from types import SimpleNamespace

    from specgraph.compiler.program import DecoderProgram, LayerCacheSpec
    from specgraph.kernels.quant import get_scheme

    scheme = None if kind == "float" else get_scheme("int4" if kind == "int4" else "fp8")
    spec = LayerCacheSpec(kv_heads=2, head_dim=64, dtype=torch.float32, scheme=scheme, hot_cold=kind == "hot_cold")
    program = SimpleNamespace(layers=[spec], page_size=16)  # (what new_kv_cache reads)
    with monkeypatch.context() as m:
        m.setattr(huge_pages, "moved", lambda t: pytest.fail("the pool was copied into huge pages, not made there"))
        [layer] = DecoderProgram.new_kv_cache(program, 256, "cpu", num_cold=256)
    big = [t for t in layer if t.numel() * t.element_size() >= huge_pages.MIN_BYTES]
    assert big and all(huge_pages.in_huge_pages(t) for t in big)
    monkeypatch.setenv("SPECGRAPH_HUGE_PAGES", "0")
    [plain] = DecoderProgram.new_kv_cache(program, 256, "cpu", num_cold=256)
    assert not any(huge_pages.in_huge_pages(t) for t in plain)
    for a, b in zip(layer, plain, strict=True):  # same shapes, dtypes and starting values (zeros, unit scales)
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous()
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
