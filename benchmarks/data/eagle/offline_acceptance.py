"""Chain acceptance per draft position of learned heads (EAGLE, Medusa) on the target's greedy answers to prompts no head was
trained on (the math of distill's held-out report, ``training.heldout_acceptance``, float heads).

    python benchmarks/data/eagle/offline_acceptance.py [HEAD.safetensors ...] [--new-tokens 128]

Heads: the shipped EAGLE one (``--kind medusa``: the shipped Medusa one), then each given. Prompt sets: the benchmarks' held-out and tuning prompts, code and chat.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import specgraph  # noqa: E402
from prompts import CHAT_PROMPTS, CODE_PROMPTS, HELDOUT_CHAT_PROMPTS, HELDOUT_CODE_PROMPTS  # noqa: E402
from specgraph.compiler.options import BackendOptions  # noqa: E402
from specgraph.compiler.program import compile_decoder  # noqa: E402
from specgraph.runtime.heads.base import load_head, target_fingerprint, target_vocab_weights  # noqa: E402
from specgraph.runtime.heads.distill_data import Sequence, chat_ids, teacher_features  # noqa: E402
from specgraph.runtime.heads.eagle import EagleHead  # noqa: E402
from specgraph.runtime.heads.medusa import MedusaHeads  # noqa: E402
from specgraph.runtime.heads.training import heldout_acceptance  # noqa: E402
from specgraph.runtime.proposers.learned import shipped_head  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("heads", nargs="*")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--kind", choices=("eagle", "medusa"), default="eagle", help="the shipped head listed first")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = specgraph.load_model("smollm2-135m-instruct")
    plain = specgraph.Engine(model, tokenizer=tok)
    program = compile_decoder(model, BackendOptions(page_size=16, hidden_states=True, lowering="eager",
                                                    self_check=False))
    vocab = program.vocab_size
    embed, lm_head = target_vocab_weights(model, vocab)
    paths = [shipped_head(target_fingerprint(model, vocab), args.kind)] + args.heads
    kinds = {"eagle": EagleHead, "medusa": MedusaHeads}
    heads = [load_head(p, kinds).attach(embed, lm_head).eval() for p in paths]
    sets = {"held-out code": HELDOUT_CODE_PROMPTS, "held-out chat": HELDOUT_CHAT_PROMPTS,
            "tuning code": CODE_PROMPTS, "tuning chat": CHAT_PROMPTS}
    print("| prompts | head | chain drafts right, positions 1.. | chain tokens/forward |")
    print("|---|---|---|---|")
    for name, prompts in sets.items():
        seqs = []
        for p in prompts:
            ids = chat_ids(tok, p)
            out = plain.generate([ids], max_new_tokens=args.new_tokens)[0].token_ids
            seqs.append(Sequence(ids + out, name, True, prompt_len=len(ids), greedy=True))
        teacher_features(program, 16, seqs)
        for path, head in zip(paths, heads):
            acc = heldout_acceptance(head, seqs)  # (depth 5; Medusa's 4 heads: 4)
            print(f"| {name} | {os.path.basename(str(path))} | {' / '.join(f'{a:.2f}' for a in acc)} "
                  f"| {1 + sum(acc):.2f} |", flush=True)


if __name__ == "__main__":
    main()
