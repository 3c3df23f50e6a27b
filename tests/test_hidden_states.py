"""The hidden_states pass: the program also returns the LM head's input of every token of the step
(a draft head's features), found by structure; the logits stay what they were."""
import pytest
import torch

from specgraph.compiler.options import BackendOptions
from specgraph.compiler.program import AttentionMetadata, compile_decoder
from models import FAMILIES, VOCAB, make_family
from test_model_zoo import build


def lm_head_inputs(model, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """What the model's vocabulary-wide linear reads, ``[T, width]`` (a hook, for the test only)."""
    head = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features == vocab][-1]
    seen = []
    handle = head.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            model(ids[None])
    finally:
        handle.remove()
    return seen[-1].reshape(-1, seen[-1].shape[-1])


def check_hidden(model, vocab: int, lowering_steps: bool = False):
    program = compile_decoder(model, BackendOptions(page_size=8, hidden_states=True, check="numeric"))
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, vocab, (13,), generator=gen), torch.randint(0, vocab, (6,), generator=gen)
    cache = program.new_kv_cache(8)
    if lowering_steps:
        program.compile_steps(cache, table_width=4, buckets=(1, 4))
    with torch.no_grad():  # a prefill of a (logits of every row) with b's first 5 tokens (its last row's)
        meta = AttentionMetadata.build([([1, 2], 0, 12), ([3], 0, 5)], 8, [list(range(12)), [4]])
        logits, hidden = program(torch.cat([a[:12], b[:5]]), meta, cache, return_hidden=True)
        want_a, want_b = lm_head_inputs(model, a, vocab), lm_head_inputs(model, b, vocab)
        torch.testing.assert_close(hidden, torch.cat([want_a[:12], want_b[:5]]), atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(logits, program(torch.cat([a[:12], b[:5]]), meta, cache), atol=0, rtol=0)
        meta = AttentionMetadata.build([([1, 2], 12, 1), ([3], 5, 1)], 8, [[0], [0]])
        _, hidden = program(torch.stack([a[12], b[5]]), meta, cache, return_hidden=True)
        torch.testing.assert_close(hidden, torch.stack([want_a[12], want_b[5]]), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_hidden_states_are_the_lm_head_inputs(family):
    torch.manual_seed(0)
    check_hidden(make_family(family), VOCAB[family])


def test_hidden_states_of_a_hugging_face_model_and_its_generated_code():
    model = build("llama")
    check_hidden(model, model.get_output_embeddings().weight.shape[0], lowering_steps=True)
    ids = torch.arange(10)[None]
    with torch.no_grad():  # HF's last hidden state is the same tensor (after the final norm)
        hf = model(ids, output_hidden_states=True).hidden_states[-1][0]
    torch.testing.assert_close(lm_head_inputs(model, ids[0], 160), hf)


def test_a_program_without_the_option_refuses_return_hidden():
    program = compile_decoder(make_family("llama"), BackendOptions(page_size=8))
    meta = AttentionMetadata.build([([1], 0, 3)], 8, [[2]])
    with pytest.raises(ValueError, match="hidden_states=True"):
        program(torch.arange(3), meta, program.new_kv_cache(2), return_hidden=True)
