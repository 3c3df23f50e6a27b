"""The torch.compile backend: entry point, options, one graph per family, logits kept."""
import pytest
import torch

import specgraph
from models import FAMILIES, VOCAB, make_family


def _logits(out):
    return getattr(out, "logits", out)


def test_entry_point_registered_without_import():
    import subprocess
    import sys

    code = "import torch; print('specgraph' in torch._dynamo.list_backends())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


@pytest.mark.parametrize("family", FAMILIES)
def test_one_graph_keeps_logits(family):
    model = make_family(family)
    be = specgraph.backend()
    compiled = torch.compile(model, backend=be, dynamic=True, fullgraph=True)
    for T in (3, 8, 21):
        ids = torch.randint(0, VOCAB[family], (1, T))
        with torch.no_grad():
            ref, got = _logits(model(ids)), _logits(compiled(ids))
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert len(be.compiled) == 1, "one graph must serve every sequence length"
    analysis = be.compiled[0].context.analysis
    assert len(analysis.sites) == 2
    expected = {"llama": (4, 2, 16), "gpt2": (4, 4, 16), "nanogpt": (4, 4, 16), "sdpa_gqa": (4, 2, 16)}[family]
    for site in analysis.sites:
        assert (site.heads, site.kv_heads, site.head_dim) == expected
        assert site.causal
        assert site.scale == pytest.approx(16 ** -0.5)
    assert analysis.vocab_size == VOCAB[family]
    assert analysis.position_sources, "positions come from an arange over the sequence"


def test_registered_name_works():
    model = make_family("llama")
    compiled = torch.compile(model, backend="specgraph", dynamic=True)
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(_logits(compiled(ids)), _logits(model(ids)))


def test_unknown_option_names_valid_ones():
    with pytest.raises(ValueError, match="valid options: kv_dtype, page_size"):
        specgraph.backend(kv_dtyp="fp8")
    with pytest.raises(ValueError, match="valid: auto, float32"):
        specgraph.backend(kv_dtype="fp7")
    with pytest.raises(ValueError, match="page_size"):
        specgraph.backend(page_size=12)


def test_bidirectional_attention_is_rejected():
    import torch.nn as nn
    import torch.nn.functional as F

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 32)
            self.qkv = nn.Linear(32, 96)
            self.out = nn.Linear(32, 50)

        def forward(self, ids):
            x = self.emb(ids)
            B, T, _ = x.shape
            q, k, v = self.qkv(x).view(B, T, 3, 2, 16).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v)  # no mask: every token sees every token
            return self.out(y.transpose(1, 2).reshape(B, T, 32))

    compiled = torch.compile(Encoder(), backend="specgraph", dynamic=True)
    with pytest.raises(Exception, match="bidirectional|not causal"):
        compiled(torch.randint(0, 50, (1, 5)))
