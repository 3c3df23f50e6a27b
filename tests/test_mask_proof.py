"""Masks and biases proved from their construction (index algebra), for every length, or refused.

Each case captures a one-layer decoder whose attention mask is built one way, runs the analysis, and
checks what it proved: the window (0 = plain causal), the ALiBi slopes, the soft cap; or the refusal
and its message. A window of 8 built at sample length 6 is the case a one-length sample gets wrong.
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from specgraph import UnsupportedAttentionError
from specgraph.compiler.analysis import analyze
from specgraph.compiler.capture import capture

VOCAB, DIM, HEADS = 50, 32, 4


class OneLayer(nn.Module):
    """Embedding, one attention layer whose scores pass through ``mods(scores, T)``, LM head."""

    def __init__(self, mods):
        super().__init__()
        self.mods = mods
        self.emb = nn.Embedding(VOCAB, DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer("tril", torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64))
        band = torch.tril(torch.ones(64, 64)) * torch.triu(torch.ones(64, 64), diagonal=-4)
        self.register_buffer("band5", band.view(1, 1, 64, 64))

    def forward(self, ids):
        T = ids.shape[1]
        q, k, v = self.qkv(self.emb(ids)).view(1, T, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        scores = self.mods(self, q @ k.transpose(-2, -1) / math.sqrt(DIM // HEADS), T)
        y = F.softmax(scores, dim=-1) @ v
        return self.head(y.transpose(1, 2).reshape(1, T, DIM))


def sites(mods, **buffers):
    model = OneLayer(mods).eval()
    for name, value in buffers.items():
        model.register_buffer(name, value)
    out = {}

    def backend(gm, example_inputs):
        out["analysis"] = analyze(capture(gm, example_inputs).gm)
        return gm.forward

    ids = torch.zeros(1, 6, dtype=torch.long)  # length 6: shorter than the windows below
    torch._dynamo.mark_dynamic(ids, 1)
    torch._dynamo.reset()
    with torch.no_grad():
        try:
            torch.compile(model, backend=backend, fullgraph=True)(ids)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            raise e.inner_exception from None
    return out["analysis"].sites


def arange_mask(T, window=0):
    i = torch.arange(T).view(T, 1)
    j = torch.arange(T).view(1, T)
    keep = j <= i
    return keep & (j > i - window) if window else keep


PROVED = {
    "tril buffer, masked_fill": (lambda m, s, T: s.masked_fill(m.tril[:, :, :T, :T] == 0, float("-inf")), 0),
    "band buffer (window 5)": (lambda m, s, T: s.masked_fill(m.band5[:, :, :T, :T] == 0, float("-inf")), 5),
    "torch.tril of ones": (lambda m, s, T: s.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool)),
                                                         float("-inf")), 0),
    "aranges, window 8": (lambda m, s, T: s.masked_fill(~arange_mask(T, 8), float("-inf")), 8),
    "aranges, where(keep, s, -inf)": (lambda m, s, T: torch.where(arange_mask(T, 3), s, float("-inf")), 3),
    "additive float mask": (lambda m, s, T: s + torch.where(arange_mask(T), 0.0, torch.finfo(s.dtype).min), 0),
    "triu of -inf": (lambda m, s, T: s + torch.triu(torch.full((T, T), float("-inf")), diagonal=1), 0),
}


@pytest.mark.parametrize("case", sorted(PROVED))
def test_mask_construction_is_proved(case):
    mods, window = PROVED[case]
    (site,) = sites(mods)
    assert site.causal and site.window == window and site.alibi_slopes is None and site.softcap == 0


def test_alibi_bias_and_softcap_are_read_out():
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(HEADS)])

    def mods(m, s, T):
        s = 30.0 * torch.tanh(s / 30.0)
        bias = m.slopes.view(1, HEADS, 1, 1) * torch.arange(T).view(1, 1, 1, T)  # Bloom's slope * key
        return s + bias + torch.where(arange_mask(T, 8), 0.0, float("-inf"))

    (site,) = sites(mods, slopes=slopes)
    assert site.window == 8 and site.softcap == 30.0
    torch.testing.assert_close(site.alibi_slopes, slopes)


REFUSED = {
    "bidirectional": (lambda m, s, T: s + torch.zeros(T, T), "bidirectional"),
    "attention sinks": (lambda m, s, T: s.masked_fill(~(arange_mask(T, 4) | (torch.arange(T) < 2)) ,
                                                    float("-inf")), "not a function of the query-key distance"),
    "keys strictly before the query": (lambda m, s, T: s.masked_fill(~(torch.arange(T).view(1, T)
                                                                      < torch.arange(T).view(T, 1)), float("-inf")),
                                       "visible query-key distances"),
    "a mask from the length": (lambda m, s, T: s.masked_fill(~(arange_mask(T) & (torch.arange(T) >= T - 4)),
                                                            float("-inf")), "depends on"),
    "a bias quadratic in the key": (lambda m, s, T: s.masked_fill(~arange_mask(T), float("-inf"))
                                    + (torch.arange(T) * torch.arange(T)).float(), "not linear in the key position"),
    "a mask from the activations": (lambda m, s, T: s.masked_fill(s > 3.0, float("-inf")),
                                    "not built from positions"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unprovable_masks_are_refused_with_a_reason(case):
    mods, reason = REFUSED[case]
    with pytest.raises(UnsupportedAttentionError, match=reason):
        sites(mods)
