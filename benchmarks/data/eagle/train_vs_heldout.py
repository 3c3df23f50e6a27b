"""Chain acceptance per draft position of EAGLE heads on distill's own data: the held-out greedy answers, and as
many training greedy answers of each kind (code, chat), to tell over-fitting from a hard held-out set.

    python benchmarks/data/eagle/train_vs_heldout.py DATA.pt [HEAD.safetensors ...]

DATA.pt: a training set ``specgraph distill`` cached (``<out>.data.pt``); heads: the shipped one, then each given.
"""
import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
import specgraph  # noqa: E402
from specgraph.runtime.heads.base import load_head, target_fingerprint, target_vocab_weights  # noqa: E402
from specgraph.runtime.heads.distill_data import Sequence  # noqa: E402
from specgraph.runtime.heads.eagle import EagleHead  # noqa: E402
from specgraph.runtime.heads.training import heldout_acceptance  # noqa: E402
from specgraph.runtime.proposers.learned import shipped_head  # noqa: E402


def groups(seqs: list[Sequence]) -> dict[str, list[Sequence]]:
    out = {}
    for kind in ("code", "chat"):
        held = [s for s in seqs if s.heldout and s.greedy and s.kind == kind]
        train = [s for s in seqs if not s.heldout and s.greedy and s.kind == kind]
        random.Random(0).shuffle(train)
        out[f"held-out {kind}"] = held
        # marked held out so that heldout_acceptance reads them
        out[f"training {kind}"] = [Sequence(s.ids, s.kind, True, s.prompt_len, s.greedy, s.feats)
                                   for s in train[:len(held)]]
    return out


def main() -> None:
    torch.set_num_threads(2)
    model, _ = specgraph.load_model("smollm2-135m-instruct")
    seqs = [Sequence(**s) for s in torch.load(sys.argv[1], weights_only=False)["sequences"]]
    vocab = len(model.get_input_embeddings().weight)
    embed, lm_head = target_vocab_weights(model, vocab)
    print("| head | answers | n | chain drafts right, positions 1.. | chain tokens/forward |\n|---|---|---|---|---|")
    for path in [shipped_head(target_fingerprint(model, vocab), "eagle")] + sys.argv[2:]:
        head = load_head(path, {"eagle": EagleHead}).attach(embed, lm_head).eval()
        for name, group in groups(seqs).items():
            acc = heldout_acceptance(head, group)
            print(f"| {os.path.basename(str(path))} | {name} | {len(group)} | {' / '.join(f'{a:.3f}' for a in acc)} "
                  f"| {1 + sum(acc):.2f} |", flush=True)


if __name__ == "__main__":
    main()
