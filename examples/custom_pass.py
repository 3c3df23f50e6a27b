"""Writing your own graph pass: count and rewrite ops, placed relative to the built-in passes.

    .venv/bin/python examples/custom_pass.py
"""
import torch

import specgraph
from specgraph import PassResult, graph_pass

aten = torch.ops.aten


@graph_pass(after="annotate")
def report_attention(gm, ctx):
    """A read-only pass: the analysis is available after "annotate"."""
    for site in ctx.analysis.sites:
        print("  ", site.describe())
    return PassResult(modified=False, info={"sites": len(ctx.analysis.sites)})


def silu_as_sigmoid(gm, ctx):
    """A plain function is a pass too (unplaced: it runs after the built-ins)."""
    def pattern(x):
        return torch.nn.functional.silu(x)

    def replacement(x):
        return x * torch.sigmoid(x)

    return PassResult(matched=specgraph.rewrite(gm, pattern, replacement, [torch.randn(2, 8)]))


def main():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    model = LlamaForCausalLM(cfg).eval()
    backend = specgraph.backend(passes=[report_attention, silu_as_sigmoid], dump_dir="dump_custom_pass",
                                check="numeric")
    compiled = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        diff = (compiled(ids).logits - model(ids).logits).abs().max().item()
    print("pass log:")
    for record in backend.compiled[0].context.log:
        print("  ", record.line())
    print(f"max |compiled - eager| = {diff:.2e}; graphs and pass_log.txt are in dump_custom_pass/")


if __name__ == "__main__":
    main()
