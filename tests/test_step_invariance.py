"""Batch invariance of a compiled program on CPU: a token's logits are bitwise the same whichever step
computes them (a decode, a verify of several tokens per sequence, a step with another sequence's
prefill chunk), so speculation emits exactly the tokens plain decoding does, greedy or sampled."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import specgraph
from models import make_family, random_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from step_invariance import compare, lengthen  # noqa: E402


@pytest.mark.parametrize("lowering", ["inductor", "eager"])
def test_verify_and_mixed_steps_give_a_decodes_logits_bit_for_bit(lowering):
    model = make_family("llama")
    engine = specgraph.Engine(model, lowering=lowering, page_size=8, num_blocks=120, self_check=False,
                              prefix_caching=False)
    seqs = [lengthen(p, 150) for p in random_prompts("llama", [9, 5, 12, 7], seed=3)]
    chunk = random_prompts("llama", [21], seed=4)[0]
    for batch in (1, 4):
        rows = compare(engine.program, engine.kv_cache, seqs[:batch], 4, 8, chunk)
        assert [kind for kind, *_ in rows] == ["verify"] * 3 + ["verify + prefill chunk"] * 3
        assert all(unequal == 0 for *_, unequal in rows), (engine.program.step_plan, rows)


@pytest.mark.parametrize("weight_dtype", ["int8", "int4", "fp8", "bfloat16"])
def test_quantized_weights_keep_a_decodes_logits_bit_for_bit(weight_dtype):
    """The quantized-weight kernel gives a row the same numbers in any step too: each output is one
    accumulation whatever the tile, threads split outputs only, and bfloat16's native bf16 dot
    products (forced on here where the CPU has them) are chosen for every row count or none."""
    from specgraph.kernels import cpu_kernels

    model = make_family("llama")
    engine = specgraph.Engine(model, lowering="eager", weight_dtype=weight_dtype, weight_calibration=None,
                              page_size=8, num_blocks=120, self_check=False, prefix_caching=False)
    seqs = [lengthen(p, 150) for p in random_prompts("llama", [9, 5, 12, 7], seed=3)]
    chunk = random_prompts("llama", [21], seed=4)[0]
    with cpu_kernels.bf16_products(True):
        for batch in (1, 4):
            rows = compare(engine.program, engine.kv_cache, seqs[:batch], 4, 8, chunk)
            assert all(unequal == 0 for *_, unequal in rows), (weight_dtype, rows)
