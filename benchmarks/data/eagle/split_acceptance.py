"""Chain acceptance of EAGLE heads on the held-out split of a distill data file, by kind (code / chat / text).

    python benchmarks/data/eagle/split_acceptance.py OUT.data.pt HEAD.safetensors [HEAD ...]
"""
import sys
import torch
import specgraph
from specgraph.runtime.heads.base import load_head, target_vocab_weights
from specgraph.runtime.heads.distill_data import Sequence
from specgraph.runtime.heads.eagle import EagleHead
from specgraph.runtime.heads.training import heldout_acceptance

torch.set_num_threads(2)
model, tok = specgraph.load_model("smollm2-135m-instruct")
data = torch.load(sys.argv[1], weights_only=False)
seqs = [Sequence(**s) for s in data["sequences"]]
print(len(seqs), "sequences", sum(s.heldout for s in seqs), "held out")
embed, lm = target_vocab_weights(model, 49152)
for p in sys.argv[2:]:
    h = load_head(p, {"eagle": EagleHead}).attach(embed, lm).eval()
    for kind in ("code", "chat", "text"):
        sub = [s for s in seqs if s.kind == kind]
        if any(s.heldout for s in sub):
            acc = heldout_acceptance(h, sub)
            print(p.split("/")[-1], kind, [round(a, 3) for a in acc], round(1 + sum(acc), 3), flush=True)
    acc = heldout_acceptance(h, seqs)
    print(p.split("/")[-1], "all", [round(a, 3) for a in acc], round(1 + sum(acc), 3), flush=True)
