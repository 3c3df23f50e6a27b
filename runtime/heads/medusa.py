"""Medusa heads: ``K`` residual blocks over the target's last hidden state, each guessing one token further.

``f_t`` (the LM head's input at token ``t``) gives token ``t + 1`` through the target's own LM head;
Medusa head ``k`` (1-based) maps ``f_t`` to ``f_t + SiLU(W_k f_t)``, whose logits over the draft
vocabulary guess token ``t + 1 + k``. Drafting costs ``K`` small matrix products over one feature,
with no cache: after the target has produced token ``n - 1`` from ``f_{n-2}``, the heads draft tokens
``n .. n + K - 1`` at once. The heads do not see each other's guesses, so their top tokens combine
into static trees (Medusa's cartesian candidates).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .base import DraftHead


@dataclass(frozen=True)
class MedusaConfig:
    hidden: int
    num_heads: int
    vocab_size: int  # the target's
    draft_vocab: int  # len(draft_ids)
    target: dict = field(default_factory=dict)
    recipe: dict = field(default_factory=dict)


class MedusaHeads(DraftHead):
    kind = "medusa"
    config_class = MedusaConfig

    def __init__(self, cfg: MedusaConfig):
        super().__init__(cfg)
        self.blocks = nn.ModuleList(nn.Linear(cfg.hidden, cfg.hidden) for _ in range(cfg.num_heads))
        for block in self.blocks:  # each head starts as the identity: "the next token again"
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, feats: torch.Tensor) -> list[torch.Tensor]:
        """``[f + SiLU(W_k f) for each head k]``, each shaped like ``feats`` (``[..., hidden]``)."""
        return [feats + F.silu(block(feats)) for block in self.blocks]
