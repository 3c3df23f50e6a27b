"""User passes: plain functions placed before/after built-ins, in the log and the dumps."""
import pytest
import torch

import specgraph
from specgraph.compiler.passes import PassResult
from models import make_family

aten = torch.ops.aten


def _compile(model, **options):
    be = specgraph.backend(**options)
    compiled = torch.compile(model, backend=be, dynamic=True, fullgraph=True)
    with torch.no_grad():
        compiled(torch.randint(0, 97, (1, 7)))
    return be.compiled[0]


def test_plain_function_pass_runs_where_placed(tmp_path):
    seen = []

    def count_linears(gm, ctx):  # a plain function is a valid pass; unplaced: runs last
        seen.append(("plain", ctx.analysis is not None))
        return PassResult(modified=False, info={"linears": sum(n.target == aten.linear.default for n in gm.graph.nodes)})

    @specgraph.graph_pass(before="annotate")
    def before_annotate(gm, ctx):
        seen.append(("before_annotate", ctx.analysis is not None))

    result = _compile(make_family("nanogpt"), passes=[count_linears, before_annotate], dump_dir=str(tmp_path))
    names = [r.name for r in result.context.log]
    assert names == ["normalize", "before_annotate", "annotate", "quantize_weights", "count_linears"]
    assert seen == [("before_annotate", False), ("plain", True)]
    assert result.context.log[-1].result.info["linears"] == 2 * 4 + 1
    log = (tmp_path / "pass_log.txt").read_text()
    assert "before_annotate" in log and "count_linears" in log
    dumps = sorted(p.name for p in tmp_path.glob("*.py"))
    assert any("after_before_annotate" in d for d in dumps) and any("after_count_linears" in d for d in dumps)
    assert "torch.ops.aten" in (tmp_path / dumps[0]).read_text()


def test_placement_on_unknown_pass_is_an_error():
    @specgraph.graph_pass(after="nope")
    def p(gm, ctx):
        return None

    with pytest.raises(Exception, match="not a built-in pass"):
        _compile(make_family("nanogpt"), passes=[p])


def test_numeric_check_catches_a_wrong_pass():
    def break_softmax(gm, ctx):  # exp instead of softmax changes the outputs
        for n in gm.graph.nodes:
            if n.target == aten.softmax.int:
                n.target = aten.exp.default
                n.args = (n.args[0],)

    with pytest.raises(Exception, match="changed the graph's output"):
        _compile(make_family("nanogpt"), passes=[break_softmax], check="numeric")


def test_rewrite_helper_replaces_pattern():
    def rewrite_gelu(gm, ctx):
        def pattern(x):
            return torch.nn.functional.gelu(x)

        def replacement(x):
            return x * torch.sigmoid(1.702 * x)

        n = specgraph.rewrite(gm, pattern, replacement, [torch.randn(2, 8)])
        return PassResult(matched=n)

    result = _compile(make_family("nanogpt"), passes=[specgraph.graph_pass(rewrite_gelu, after="normalize")])
    record = next(r for r in result.context.log if r.name == "rewrite_gelu")
    assert record.result.matched == 2  # one GELU per block
    assert not any(n.target == aten.gelu.default for n in result.gm.graph.nodes)


def test_symbolic_shapes_in_meta():
    result = _compile(make_family("nanogpt"))
    shapes = [n.meta.get("sym_shape") for n in result.gm.graph.nodes if n.meta.get("sym_shape")]
    import sympy

    assert any(any(isinstance(d, sympy.Expr) and d.free_symbols for d in s) for s in shapes)


def _adds_input(declare: bool):
    """A user pass after paging that adds a runtime input (the mystery scale a decoder would need)."""
    from specgraph.compiler.signature import Role
    from specgraph.passes.graph_utils import add_input

    @specgraph.graph_pass(before="cleanup")
    def add_runtime_input(gm, ctx):
        fake = ctx.signature.input(gm, Role.POSITIONS).meta["val"].clone()
        if declare:
            ctx.signature.add(gm, "extra_positions", fake, Role.POSITIONS)
        else:
            add_input(gm, "extra_positions", fake)
        return PassResult(matched=1)

    return add_runtime_input


def test_an_undeclared_runtime_input_is_refused_not_frozen():
    from specgraph.compiler.options import BackendOptions
    from specgraph.compiler.program import compile_decoder
    from specgraph.compiler.signature import SignatureError

    with pytest.raises(SignatureError, match=r"\['extra_positions'\] have no declared role"):
        compile_decoder(make_family("llama"), BackendOptions(page_size=8, passes=[_adds_input(False)],
                                                             self_check=False))
    # declared with a role, it is fed like the input of that role
    program = compile_decoder(make_family("llama"), BackendOptions(page_size=8, passes=[_adds_input(True)],
                                                                   self_check=False))
    assert [s.role.value for s in program._inputs].count("positions") == 2
