"""The compile-time self-check refuses what the analysis let through, instead of a silently wrong answer."""
import pytest
import torch

import specgraph
from specgraph.compiler.options import BackendOptions
from specgraph.compiler.program import compile_decoder
from specgraph import UnsupportedModelError
from models import NanoGPT, make_family, uncached_greedy


def windowed_nanogpt(window: int = 8) -> NanoGPT:
    """nanoGPT whose mask buffer is a band: each token sees itself and the window - 1 before it."""
    model = NanoGPT().eval()
    for block in model.blocks:
        n = block.bias.shape[-1]
        band = torch.tril(torch.ones(n, n)) * torch.triu(torch.ones(n, n), diagonal=-(window - 1))
        block.bias.copy_(band.view(1, 1, n, n))
    return model


class CumulativeMixGPT(NanoGPT):
    """A causal decoder that also mixes tokens outside attention (a running mean of the embeddings).

    Exact as a cache-free model, but the incremental program sees only a step's new tokens, so the
    running mean is wrong after the first step. The analysis only looks at attention and cannot
    see it; the self-check does."""

    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        x = x + x.cumsum(1) / torch.arange(1, t + 1, device=idx.device).view(1, t, 1)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@pytest.mark.parametrize("family", ["llama", "nanogpt"])
def test_exact_models_pass_the_check(family):
    program = compile_decoder(make_family(family), BackendOptions(page_size=8))
    assert program.self_check_seconds is not None  # it ran (a mismatch would have raised)


def test_a_band_mask_buffer_is_proved_a_sliding_window_and_is_exact():
    model = windowed_nanogpt(8)
    program = compile_decoder(model, BackendOptions(page_size=8))
    assert [s.window for s in program.compiled.context.analysis.sites] == [8, 8]
    prompt = list(range(3, 30))
    got = specgraph.Engine(model, num_blocks=16, page_size=8).generate(prompt, max_new_tokens=12,
                                                                        ignore_eos=True)[0].token_ids
    assert got == uncached_greedy(model, prompt, 12)


def test_token_mixing_the_analysis_cannot_see_is_refused_by_the_self_check():
    model = CumulativeMixGPT().eval()
    # the analysis proves every attention site causal and lets the model through ...
    program = compile_decoder(model, BackendOptions(page_size=8, self_check=False))
    assert all(site.causal and site.window == 0 for site in program.compiled.context.analysis.sites)
    # ... the incremental run shows the difference, and names the first attention site
    with pytest.raises(UnsupportedModelError, match=r"attention site layer 0 .*mixes tokens outside attention"):
        compile_decoder(model, BackendOptions(page_size=8))
    with pytest.raises(UnsupportedModelError, match="self-check failed"):
        specgraph.Engine(model, num_blocks=16, page_size=8)


def test_mixing_int4_noise_would_hide_is_caught_through_the_float_twin():
    with pytest.raises(UnsupportedModelError, match="attention site layer 0"):
        compile_decoder(CumulativeMixGPT().eval(), BackendOptions(page_size=8, kv_dtype="int4", kv_hot_window=0))
