"""The logits output is found by structure, whatever else the model returns (caches, hidden states)."""
import torch
import torch.nn as nn

import specgraph
from models import NanoGPT, uncached_greedy


def _hf_default_config_llama():
    """A tiny Llama as ``from_pretrained`` leaves it: ``use_cache=True`` (it returns its K/V cache too)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    assert cfg.use_cache
    return LlamaForCausalLM(cfg).eval()


class HiddenThenLogits(nn.Module):
    """Returns ``{"hidden": ..., "logits": ...}``: the logits are not the first output."""

    def __init__(self):
        super().__init__()
        self.inner = NanoGPT(vocab=97)

    def forward(self, idx):
        m = self.inner
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = m.wte(idx) + m.wpe(pos)
        for block in m.blocks:
            x = block(x)
        x = m.ln_f(x)
        return {"hidden": x, "logits": m.lm_head(x)}


def test_default_config_hf_model_generates_exactly():
    model = _hf_default_config_llama()
    prompt = torch.randint(0, 200, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    engine = specgraph.Engine(model, num_blocks=32, page_size=8)
    assert engine.program.vocab_size == 200
    got = engine.generate(prompt, max_new_tokens=8, ignore_eos=True)[0].token_ids
    assert got == uncached_greedy(model, prompt, 8)


def test_backend_returns_the_full_outputs_and_engine_finds_logits_among_them():
    model = HiddenThenLogits().eval()
    ids = torch.randint(0, 97, (1, 12))
    compiled = torch.compile(model, backend="specgraph", dynamic=True)
    with torch.no_grad():
        out, ref = compiled(ids), model(ids)
    assert set(out) == {"hidden", "logits"}
    torch.testing.assert_close(out["logits"], ref["logits"])
    torch.testing.assert_close(out["hidden"], ref["hidden"])
    torch._dynamo.reset()
    engine = specgraph.Engine(model, num_blocks=32, page_size=8)
    assert engine.program.vocab_size == 97
    prompt = ids[0].tolist()
    want = []
    with torch.no_grad():
        x = ids
        for _ in range(6):
            t = int(model(x)["logits"][0, -1].argmax())
            want.append(t)
            x = torch.cat([x, torch.tensor([[t]])], 1)
    assert engine.generate(prompt, max_new_tokens=6, ignore_eos=True)[0].token_ids == want
