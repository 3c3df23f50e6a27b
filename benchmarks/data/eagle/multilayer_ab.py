"""Would EAGLE-3's recipe lift the head's acceptance here? An offline A/B on distill's own data, before any engine
work: heads trained alike (same data, windows, seed, steps) that differ only in what the variant names, measured
on the held-out greedy answers (chain acceptance per draft position, distill's own measure).

    python benchmarks/data/eagle/multilayer_ab.py DATA.pt --steps 600 --variants base,fused,fused-kl,kl

DATA.pt: a training set ``specgraph distill`` cached (``<out>.data.pt``, e.g. made with ``--minutes 0``).

Variants:
* ``base``: the shipped recipe (the target's last hidden state in; smooth-L1 to it + 0.1 x KL, per drafting step).
* ``kl``: same input, KL alone (EAGLE-3 drops the feature regression).
* ``fused``: the input feature of a true slot is ``fuse([low; mid; last])`` (EAGLE-3's multi-layer feature: the
  residual stream after an early and a middle decoder layer, each RMS-normalized, beside the last hidden state),
  a learned linear ``3h -> h``; drafting steps after the first feed the head's own output, as before; same loss
  as base.
* ``fused-kl``: fused input and KL alone: EAGLE-3's recipe at this head's size.

The two extra layers come from the Hugging Face model's ``output_hidden_states`` (an offline experiment: were it
kept, the hidden_states pass would add them to the program by structure).
"""
import argparse
import os
import sys
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
import specgraph  # noqa: E402
from specgraph.runtime.heads import training  # noqa: E402
from specgraph.runtime.heads.base import target_vocab_weights  # noqa: E402
from specgraph.runtime.heads.distill import Recipe, draft_vocabulary, target_head_config  # noqa: E402
from specgraph.runtime.heads.distill_data import Sequence  # noqa: E402
from specgraph.runtime.heads.eagle import EagleHead  # noqa: E402

SHIPPED_LOSSES = training.head_losses  # (replaced per variant below)


class FusedEagle(EagleHead):
    """An EAGLE head whose true slots' features are ``fuse([earlier layers'; last])`` (``feats``: ``[..., parts * h]``,
    the last hidden state last, so the teacher reads ``feats[..., -h:]``)."""

    def __init__(self, cfg, parts: int):
        super().__init__(cfg)
        self.fuse = nn.Linear(parts * cfg.hidden, cfg.hidden, bias=False)

    def unrolled(self, ids, feats, steps):
        return super().unrolled(ids, self.fuse(feats), steps)


VARIANTS = ("base", "kl", "fused", "fused-kl")


def losses(variant: str, hidden: int):
    """``training.head_losses``'s stand-in for ``variant``: per drafting step ``(loss, top-1 agreement)``, as
    ``training.eagle_losses`` (which ``base`` runs itself) but with the teacher read from the last hidden state
    and the regression optional."""
    if variant == "base":
        return SHIPPED_LOSSES

    def head_losses(head, ids, feats, lens, recipe):
        last = feats[..., -hidden:]
        noisy = feats + (torch.rand_like(feats) * 2 - 1) * recipe.noise * feats.std() if recipe.noise else feats
        teacher = training.Teacher(head, last)
        t = ids.shape[1]
        out = []
        for j, g in enumerate(head.unrolled(ids, noisy, recipe.unroll)):
            n = max(t - j, 0)
            valid = torch.arange(n)[None] + j < lens[:, None] - 1
            loss, agree = teacher.terms(head, g, j)
            if not variant.endswith("kl"):
                loss = F.smooth_l1_loss(g[:, :n], last[:, j:], reduction="none").mean(-1) + 0.1 * loss
            out.append((training._mean(loss, valid), float(training._mean(agree, valid))))
        return out

    return head_losses


@torch.no_grad()
def layer_states(model, sequences, layers) -> None:
    """Each sequence's ``feats`` becomes ``[RMS-normalized residual stream after each of layers; last]``."""
    t0 = time.perf_counter()
    for i, s in enumerate(sequences):
        out = model(torch.tensor([s.ids]), output_hidden_states=True)
        extra = [F.rms_norm(out.hidden_states[k + 1][0], (out.hidden_states[k + 1].shape[-1],)) for k in layers]
        s.feats = torch.cat([e.to(torch.float16) for e in extra] + [s.feats], dim=-1)
        if i % 200 == 0:
            print(f"  layer states {i}/{len(sequences)} ({time.perf_counter() - t0:.0f} s)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--variants", default="base,fused-kl")
    p.add_argument("--layers", default="2,14", help="decoder layers whose outputs join the last hidden state")
    a = p.parse_args()
    torch.set_num_threads(2)
    model, _ = specgraph.load_model("smollm2-135m-instruct")
    model.eval()
    vocab = len(model.get_input_embeddings().weight)
    embed, lm_head = target_vocab_weights(model, vocab)
    seqs = [Sequence(**s) for s in torch.load(a.data, weights_only=False)["sequences"]]
    draft_ids = draft_vocabulary(seqs, 8192)
    recipe = replace(Recipe(), steps=a.steps)
    hidden = int(lm_head.shape[1])
    variants = a.variants.split(",")
    if set(variants) - set(VARIANTS):
        p.error(f"unknown variants {sorted(set(variants) - set(VARIANTS))}; choose from {', '.join(VARIANTS)}")
    layers = [int(x) for x in a.layers.split(",")]
    print(f"data: {len(seqs)} sequences, {sum(len(s.ids) for s in seqs)} tokens; steps {a.steps}; layers {layers}",
          flush=True)
    plain = [s.feats for s in seqs]
    if any(v.startswith("fused") for v in variants):
        layer_states(model, seqs, layers)
    fused = [s.feats for s in seqs]
    print("| variant | steps | minutes | held-out chain drafts right, positions 1..5 | chain-5 tokens/forward |\n"
          "|---|---|---|---|---|", flush=True)
    for v in variants:
        for s, f0, f1 in zip(seqs, plain, fused):
            s.feats = f1 if v.startswith("fused") else f0
        torch.manual_seed(recipe.seed)
        cfg = target_head_config(model, vocab, len(draft_ids))
        head = FusedEagle(cfg, len(layers) + 1) if v.startswith("fused") else EagleHead(cfg)
        head.draft_ids.copy_(draft_ids)
        head.attach(embed, lm_head)
        training.head_losses = losses(v, hidden)
        record = training.train(head, seqs, recipe, progress=False)
        acc = training.heldout_acceptance(head, seqs)
        print(f"| {v} | {record['steps']} | {record['seconds'] / 60:.1f} | {' / '.join(f'{x:.3f}' for x in acc)} "
              f"| {1 + sum(acc):.3f} |", flush=True)
        print(f"  curve {record['heldout_curve']}, loss {record['first_loss']} -> {record['loss']}", flush=True)


if __name__ == "__main__":
    main()
