"""Hypothesis: random small decoder configurations through the backend and the decoder program."""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specgraph
from models import tiny_llama


@st.composite
def configs(draw):
    kv_heads = draw(st.integers(1, 3))
    return dict(layers=draw(st.integers(1, 2)), kv_heads=kv_heads, heads=kv_heads * draw(st.integers(1, 3)),
                head_dim=draw(st.sampled_from([8, 16, 32])), vocab=draw(st.integers(16, 300)),
                seed=draw(st.integers(0, 1000)))


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(cfg=configs(), lengths=st.lists(st.integers(2, 40), min_size=2, max_size=3))
def test_backend_matches_eager(cfg, lengths):
    torch._dynamo.reset()
    model = tiny_llama(**cfg)
    be = specgraph.backend()
    compiled = torch.compile(model, backend=be, dynamic=True, fullgraph=True)
    for T in lengths:
        ids = torch.randint(0, cfg["vocab"], (1, T))
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
    assert len(be.compiled) == 1
    site = be.compiled[0].context.analysis.sites[0]
    assert (site.heads, site.kv_heads, site.head_dim) == (cfg["heads"], cfg["kv_heads"], cfg["head_dim"])
