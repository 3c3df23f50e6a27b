"""quant_linear: the Triton kernel (interpreter) == the torch reference, for every weight scheme.

* Fuzzed: M 1..20 (both BLOCK_M binaries), N and K small multiples of 32 (ragged against the
  kernel's 64-wide tiles), every scheme, int4 groups 32 and 64, with and without bias, float32
  and bfloat16 x, activation rows whose 32-column blocks span orders of magnitude, zero blocks.
* Weight-only schemes (int8, fp8, bfloat16) at sizes int4 does not allow (K and N not multiples
  of 32); int8 with W = I returns x itself (no activation rounding); x with leading dims and
  strides; the registry routes the op to Triton.
* int4's activation codes bit for bit: W = I, x full of exact rounding ties and of near-ties
  where the contract's single-rounding ``127 / amax`` and ``reciprocal(amax) * 127`` give
  different codes.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (conftest does it too)

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specgraph.kernels import registry, use_triton_kernels
from specgraph.kernels import quant_linear_triton as qlt
from specgraph.kernels.quant_linear import (
    ACT_BLOCK,
    ACT_MAX,
    ACT_QUANT_SCHEMES,
    INT4_GROUPS,
    WEIGHT_SCHEMES,
    dequantize_weight,
    fake_quantize_activations,
    quant_linear_ref,
    quantize_weight,
)
from specgraph.kernels.triton_helpers import is_interpreted

if not is_interpreted(qlt.quant_linear_kernel):
    raise RuntimeError("specgraph.kernels was imported before TRITON_INTERPRET=1 was set: the Triton kernels would not run in the interpreter")


def make_problem(scheme: str, m: int, n: int, k: int, dtype: torch.dtype, *, group: int = 32, bias: bool = True,
                 zero_blocks: float = 0.0, seed: int = 0):
    """``(x [m, k], weight, scales, bias)``: x's 32-column blocks scaled by 10**U(-3, 2) (so
    per-block scales differ by orders of magnitude), a fraction ``zero_blocks`` of them zero."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    blocks = -(-k // ACT_BLOCK)
    block_scale = 10.0 ** (torch.rand(m, blocks, generator=gen) * 5 - 3)
    block_scale[torch.rand(m, blocks, generator=gen) < zero_blocks] = 0.0
    x = (x * block_scale.repeat_interleave(ACT_BLOCK, dim=1)[:, :k]).to(dtype)
    w = torch.randn(n, k, generator=gen) * k**-0.5
    weight, scales = quantize_weight(w, scheme, group)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, weight, scales, b


def check_close(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None,
                bias: torch.Tensor | None, scheme: str) -> None:
    """Triton output ``y`` vs the reference, elementwise.

    Both compute the same real numbers: int4's activation codes come from the same fp32
    operations (correctly rounded ``127 / amax``, product, round-half-even), the kernel's int4
    code dot products are exact (one bf16 dot of integers) and it applies the scales the
    reference multiplies into each operand after the sum.
    They differ by fp32 rounding of the sums (summation order) and of the factored scales, each
    at most ``K * 2**-24`` of ``sum_k |x_k w_k| + |bias|`` (``mag`` below, float64): we allow
    twice that plus a margin for the factored int4 ``scale * D + min * sum(codes)``, which is
    exact in reals but whose terms can exceed ``mag`` a few times. A rare activation-code flip
    at an exact rounding tie (an FMA-contracted product on some backend) would need more; none
    occurs here because the interpreter does the reference's operations, so an error of that
    size is a bug. bfloat16 outputs add one bf16 ulp of the output (<= 2**-7 relative): the
    two fp32 results may round to neighbouring bf16 values.
    """
    ref = quant_linear_ref(x, weight, scales, bias, scheme)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    xf = fake_quantize_activations(x) if scheme in ACT_QUANT_SCHEMES else x.float()
    mag = xf.double().abs() @ dequantize_weight(weight, scales, scheme).double().abs().T
    if bias is not None:
        mag += bias.double().abs()
    k = x.shape[-1]
    tol = (2 * k + 64) * 2.0**-24 * mag + 1e-30
    if y.dtype == torch.bfloat16:
        tol += 2.0**-7 * ref.double().abs()
    err = (y.double() - ref.double()).abs()
    bad = err > tol
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} outputs off: max err {err.max().item():.3g}, "
                           f"first at {bad.nonzero()[0].tolist()}: {y[bad][0].item()} vs {ref[bad][0].item()}")


@st.composite
def problems(draw):
    scheme = draw(st.sampled_from(WEIGHT_SCHEMES))
    group = draw(st.sampled_from(INT4_GROUPS)) if scheme == "int4" else 32
    m = draw(st.integers(1, 20))
    n = draw(st.sampled_from([32, 64, 96, 160]))
    k = draw(st.sampled_from([k for k in (32, 64, 96, 128, 192, 256) if k % group == 0]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    bias = draw(st.booleans())
    zero_blocks = draw(st.sampled_from([0.0, 0.3, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    return scheme, make_problem(scheme, m, n, k, dtype, group=group, bias=bias, zero_blocks=zero_blocks, seed=seed)


@settings(max_examples=150, deadline=None)
@given(problems())
def test_triton_matches_ref(problem):
    scheme, (x, weight, scales, bias) = problem
    check_close(qlt.quant_linear_triton(x, weight, scales, bias, scheme), x, weight, scales, bias, scheme)


def identity_weight(k: int, scheme: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W = I quantized (int8: 127 * fl(1 / 127); int4: 15 * fp16(1 / 15)): ``(weight, scales, diagonal)``."""
    weight, scales = quantize_weight(torch.eye(k), scheme, 32)
    return weight, scales, dequantize_weight(weight, scales, scheme).diagonal().double()


def check_codes(x: torch.Tensor, scheme: str) -> None:
    """With W = I, y is the fake-quantized x, so one activation code off by one shows as an error
    of a whole step (``amax / 127``, > 2**-7 amax), far above the 2**-18 amax allowed for the
    kernel's few fp32 roundings of ``step * D * scale``. bfloat16 outputs add their rounding
    (<= 2**-8 of y, at most half a step for codes <= 127): there a flip shows for codes up to
    ~120 (every near-tie below holds codes <= 65), float32 outputs show every flip."""
    m, k = x.shape
    weight, scales, w_diag = identity_weight(k, scheme)
    y = qlt.quant_linear_triton(x, weight, scales, None, scheme).double()
    expected = fake_quantize_activations(x).double() * w_diag
    amax = x.float().abs().reshape(m, k // ACT_BLOCK, ACT_BLOCK).amax(-1).repeat_interleave(ACT_BLOCK, 1).double()
    slack = 2.0**-18 * amax + (2.0**-8 * expected.abs() if x.dtype == torch.bfloat16 else 0.0)
    bad = (y - expected).abs() > slack
    assert not bad.any(), f"codes differ at {bad.nonzero().tolist()[:5]}"


@pytest.mark.parametrize("scheme", ACT_QUANT_SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_codes_are_the_references(scheme, dtype):
    """Exact ties: half-integers in blocks whose amax is ``127 * 2**p`` (so ``127 / amax = 2**-p``
    exactly and ``x * inv`` lands on ``c + 0.5``: round half to even); and
    bf16-rounded normals, small codes mixed with large ones (a block's columns scaled 1 or 1/20)."""
    k = 128
    gen = torch.Generator().manual_seed(5)
    powers = 2.0 ** torch.randint(-4, 5, (20, 1), generator=gen)
    half_ints = torch.randint(-253, 254, (20, k), generator=gen) / 2  # |v| <= 126.5: exact in bf16
    at = torch.randint(0, ACT_BLOCK, (20, k // ACT_BLOCK), generator=gen) + torch.arange(0, k, ACT_BLOCK)
    signs = torch.randint(0, 2, at.shape, generator=gen) * 2.0 - 1
    half_ints.scatter_(1, at, 127 * signs)  # each block's amax: 127
    half_ints *= powers
    assert ((half_ints / powers).frac().abs() == 0.5).float().mean() > 0.4
    normals = torch.randn(20, k, generator=gen).bfloat16().float() * 10
    normals *= torch.randint(0, 2, (20, k), generator=gen) * 0.95 + 0.05  # codes ~3 beside ~127
    check_codes(torch.cat([half_ints, normals]).to(dtype), scheme)


# (amax, x, code) with round(x * fl(127 / amax)) == code != round(x * fl(fl(1 / amax) * 127))
# (found by search). The last four are bfloat16 values: an exhaustive search over bf16 pairs finds
# only x = amax / 2 (code 63 or 64, a tie that one of the two inverses breaks the other way).
NEAR_TIES = [
    (1.1465721130371094, 0.004514063708484173, 0),
    (0.4277883470058441, 0.011789442040026188, 4),
    (0.06874268501996994, 0.005683450493961573, 10),
    (5.137625217437744, 1.6788302659988403, 42),
    (0.6471105813980103, 0.3235552906990051, 64),
    (0.10933379828929901, 0.05552779883146286, 65),
    (0.21402917802333832, 0.16936954855918884, 100),
    (1.618025541305542, 1.6116554737091064, 126),
    (1.0546875, 0.52734375, 64),
    (1.1875, 0.59375, 63),
    (7.5, 3.75, 63),  # 1.875 * 4: only the mantissas matter
    (0.2333984375, 0.11669921875, 64),  # 1.8671875 / 8
]


@pytest.mark.parametrize("scheme", ACT_QUANT_SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_near_ties_follow_the_single_rounding_division(scheme, dtype):
    """Each block holds ``amax`` and a near-tie ``x`` (both signs, at varying positions): the
    reference gives the listed code, ``reciprocal * 127`` (checked here) another, the kernel must
    give the reference's. bfloat16 x takes the pairs bfloat16 holds exactly."""
    blocks = []
    for sign in (1.0, -1.0):
        for amax, v, code in NEAR_TIES:
            a, xv = torch.tensor([amax, v])
            if dtype == torch.bfloat16 and (a.bfloat16().float() != a or xv.bfloat16().float() != xv):
                continue
            assert torch.round(xv * (a.reciprocal() * ACT_MAX)) != code
            at = len(blocks) % ACT_BLOCK
            block = torch.zeros(ACT_BLOCK)
            block[[(at + 1) % ACT_BLOCK, at]] = torch.tensor([-sign * amax, sign * v])
            assert fake_quantize_activations(block)[at] == sign * code * (a / ACT_MAX)
            blocks.append(block)
    assert len(blocks) == 2 * (4 if dtype == torch.bfloat16 else len(NEAR_TIES))
    check_codes(torch.stack(blocks).reshape(-1, 2 * ACT_BLOCK).to(dtype), scheme)  # two blocks per row


@pytest.mark.parametrize("scheme", ["int8", "fp8", "bfloat16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_ragged_sizes(scheme, dtype):
    """The weight-only schemes take any K and N: tiles masked in both (K 40 and 100: partial K steps)."""
    for m, n, k in ((3, 40, 40), (17, 70, 100)):
        x, weight, scales, bias = make_problem(scheme, m, n, k, dtype, seed=k)
        check_close(qlt.quant_linear_triton(x, weight, scales, bias, scheme), x, weight, scales, bias, scheme)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_keeps_activations_float(dtype):
    """int8 is weight-only: with W = I (diagonal 127 * fl(1 / 127)) y is x itself up to fp32
    rounding (an int8 / int16 activation grid would move most values by far more than 2**-20)."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 96, generator=gen) * 10.0 ** torch.randint(-3, 3, (5, 96), generator=gen)).to(dtype)
    weight, scales, w_diag = identity_weight(96, "int8")
    y = qlt.quant_linear_triton(x, weight, scales, None, "int8").double()
    expected = x.double() * w_diag
    slack = 2.0**-20 * expected.abs() + (2.0**-8 * expected.abs() if dtype == torch.bfloat16 else 0.0)
    assert ((y - expected).abs() <= slack).all()
    if dtype == torch.float32:
        assert ((fake_quantize_activations(x).double() * w_diag - expected).abs() > slack).float().mean() > 0.5


def test_leading_dims_and_strided_x():
    """x [..., K] with leading dims, and x not contiguous in K (a transposed view): y [..., N]."""
    x, weight, scales, bias = make_problem("int4", 6, 64, 128, torch.float32, seed=1)
    x3 = x.reshape(2, 3, 128)
    y = qlt.quant_linear_triton(x3, weight, scales, bias, "int4")
    assert y.shape == (2, 3, 64)
    check_close(y, x3, weight, scales, bias, "int4")
    xt = x.T.contiguous().T  # same values, stride (1, 6)
    check_close(qlt.quant_linear_triton(xt, weight, scales, None, "int4"), xt, weight, scales, None, "int4")
    empty = qlt.quant_linear_triton(x[:0], weight, scales, bias, "int4")
    assert empty.shape == (0, 64)


def test_bad_arguments_raise_value_error():
    x, weight, scales, bias = make_problem("int8", 2, 32, 64, torch.float32)
    with pytest.raises(ValueError, match="scheme"):
        qlt.quant_linear_triton(x, weight, scales, bias, "int2")
    with pytest.raises(ValueError, match="x must be"):
        qlt.quant_linear_triton(x[:, :32], weight, scales, bias, "int8")


def test_op_reaches_triton_under_use_triton_kernels():
    x, weight, scales, bias = make_problem("int4", 4, 64, 128, torch.bfloat16, group=64, seed=2)
    args = (x, weight, scales, bias, "int4")
    assert registry.select("quant_linear", *args).name != "triton"  # CPU tensors: not Triton unless forced
    with use_triton_kernels():
        assert registry.select("quant_linear", *args).name == "triton"
        assert registry.select("quant_linear", *args).fn is qlt.quant_linear_triton
        y = torch.ops.specgraph.quant_linear(*args)
    check_close(y, *args)
