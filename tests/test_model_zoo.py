"""A zoo of tiny random-weight Hugging Face decoders, built from default configs (use_cache left as is).

Each is either exact (Engine greedy == the cache-free argmax loop, 16 tokens after a 32-token
prompt) or refused with a clear error at Engine construction: never silently wrong. The table
says which today; a model moving from refused to exact must update it.
"""
import pytest
import torch

import specgraph
from specgraph import UnsupportedAttentionError, UnsupportedModelError
from models import uncached_greedy

SMALL = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=256)
GQA = dict(SMALL, num_key_value_heads=2)
GPT_STYLE = dict(vocab_size=160, n_embd=64, n_layer=2, n_head=4, n_positions=256)

# name: (config class, model class, config overrides, expected outcome, refusal reason when refused)
ZOO = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", GQA, "exact"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", GQA, "exact"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(GQA, head_dim=16), "exact"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(GQA, head_dim=16), "exact"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(GQA, pad_token_id=0), "exact"),
    "phi": ("PhiConfig", "PhiForCausalLM", SMALL, "exact"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", GPT_STYLE, "exact"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", SMALL, "exact"),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(vocab_size=160, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                                 num_attention_heads=4, max_position_embeddings=256,
                                                 word_embed_proj_dim=64), "exact"),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(vocab_size=160, hidden_size=64, num_hidden_layers=2,
                                                         num_attention_heads=4), "exact"),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(GPT_STYLE, rotary_dim=8), "exact"),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", GQA, "exact"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", GQA, "exact"),
    "cohere": ("CohereConfig", "CohereForCausalLM", GQA, "exact"),
    "granite": ("GraniteConfig", "GraniteForCausalLM", GQA, "exact"),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", GPT_STYLE, "exact"),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", GQA, "exact"),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=160, hidden_size=64, n_layer=2, n_head=4),
              "exact"),
    "qwen2_window8": ("Qwen2Config", "Qwen2ForCausalLM", dict(GQA, use_sliding_window=True, sliding_window=8,
                                                              max_window_layers=1), "exact"),
    "mistral_window8": ("MistralConfig", "MistralForCausalLM", dict(GQA, sliding_window=8), "exact"),
    "gemma2_window8": ("Gemma2Config", "Gemma2ForCausalLM", dict(GQA, head_dim=16, sliding_window=8), "exact"),
}


def build(name: str) -> torch.nn.Module:
    import transformers

    config_cls, model_cls, overrides, _ = ZOO[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**overrides)
    return getattr(transformers, model_cls)(config).eval()


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_model_is_exact_or_refused(name):
    model = build(name)
    vocab = model.get_output_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (32,), generator=torch.Generator().manual_seed(7)).tolist()
    try:
        engine = specgraph.Engine(model, num_blocks=16, page_size=16)
    except (UnsupportedAttentionError, UnsupportedModelError) as e:
        assert ZOO[name][3] == "refused", f"{name} is refused: {e}"
        assert len(str(e)) > 40  # a message that says what and where
        return
    got = engine.generate(prompt, max_new_tokens=16, ignore_eos=True)[0].token_ids
    assert got == uncached_greedy(model, prompt, 16), f"{name}: compiled but silently wrong"
    assert ZOO[name][3] == "exact", f"{name} is exact now: update the zoo table (and the README)"


@pytest.mark.parametrize("name", ["bloom", "gemma2_window8"])
def test_window_softcap_and_alibi_models_are_exact_through_the_generated_code(name):
    """ALiBi (Bloom), soft-capping and alternating sliding-window layers (Gemma 2) through Inductor's
    code and the native C++ kernels, not only the eager reference lowering."""
    model = build(name)
    vocab = model.get_output_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    engine = specgraph.Engine(model, num_blocks=16, page_size=16, lowering="inductor")
    assert engine.program.wait_for_steps(timeout=600) and engine.program.step_error is None
    sites = engine.program.compiled.context.analysis.sites
    if name == "bloom":
        assert all(s.alibi_slopes is not None for s in sites)
    else:
        assert [s.window for s in sites] == [8, 0] and all(s.softcap == 50.0 for s in sites)
    got = engine.generate(prompt, max_new_tokens=16, ignore_eos=True)[0].token_ids
    assert got == uncached_greedy(model, prompt, 16)


@pytest.mark.parametrize("name, windows", [("mistral_window8", [8, 8]), ("qwen2_window8", [0, 8]),
                                           ("gemma2_window8", [8, 0])])
def test_each_layer_window_is_proved_from_its_mask(name, windows):
    """Per-layer windows (HF's ``layer_types``) are read from each layer's mask construction."""
    engine = specgraph.Engine(build(name), num_blocks=16, page_size=16)
    assert [s.window for s in engine.program.compiled.context.analysis.sites] == windows
