"""The compile-time self-check refuses what the analysis let through, instead of a silently wrong answer."""
import pytest
import torch

import specgraph
from specgraph.compiler.options import BackendOptions
from specgraph.compiler.program import compile_decoder
from specgraph import UnsupportedModelError
from models import NanoGPT, make_family


def windowed_nanogpt(window: int = 8) -> NanoGPT:
    """nanoGPT whose mask buffer is a band: each token sees itself and the window - 1 before it."""
    model = NanoGPT().eval()
    for block in model.blocks:
        n = block.bias.shape[-1]
        band = torch.tril(torch.ones(n, n)) * torch.triu(torch.ones(n, n), diagonal=-(window - 1))
        block.bias.copy_(band.view(1, 1, n, n))
    return model


@pytest.mark.parametrize("family", ["llama", "nanogpt"])
def test_exact_models_pass_the_check(family):
    program = compile_decoder(make_family(family), BackendOptions(page_size=8))
    assert program.self_check_seconds is not None  # it ran (a mismatch would have raised)


def test_sliding_window_the_analysis_misses_is_refused_by_the_self_check():
    model = windowed_nanogpt(8)
    # the analysis proves causality at one short length, where a window of 8 looks causal ...
    program = compile_decoder(model, BackendOptions(page_size=8, self_check=False))
    assert all(site.causal for site in program.compiled.context.analysis.sites)
    # ... the incremental run shows the difference, and names the first attention site
    with pytest.raises(UnsupportedModelError, match=r"attention site layer 0 .*sliding window"):
        compile_decoder(model, BackendOptions(page_size=8))
    with pytest.raises(UnsupportedModelError, match="self-check failed"):
        specgraph.Engine(model, num_blocks=16, page_size=8)


def test_mistral_with_a_small_window_is_not_silently_wrong():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                        max_position_embeddings=256)
    with pytest.raises((UnsupportedModelError, specgraph.UnsupportedAttentionError)):
        specgraph.Engine(MistralForCausalLM(cfg).eval(), num_blocks=16, page_size=8)


def test_opt_positions_from_a_mask_cumsum_are_not_silently_wrong():
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=256, word_embed_proj_dim=64)
    with pytest.raises((UnsupportedModelError, specgraph.UnsupportedAttentionError)):
        specgraph.Engine(OPTForCausalLM(cfg).eval(), num_blocks=16, page_size=8)


def test_a_window_int4_noise_would_hide_is_caught_through_the_float_twin():
    with pytest.raises(UnsupportedModelError, match="attention site layer 0"):
        compile_decoder(windowed_nanogpt(8), BackendOptions(page_size=8, kv_dtype="int4"))
