"""The EAGLE draft head: one decoder layer that drafts in the target's feature space.

Slots and features
------------------
``f_t`` is the target's last hidden state (the LM head's input) at token ``t``: its logits give token
``t + 1``. The head's slot ``t`` holds the pair ``(x_t, f_{t-1})``: ``fc([embed(x_t); f_{t-1}])``
goes through one decoder layer (attention over the slots before it, then an MLP), and the layer's
output ``g_t`` predicts ``f_t``, so ``lm_head(g_t)`` drafts token ``t + 1``. Drafting further feeds
``(drafted token, g)`` pairs. A slot's content depends only on tokens ``0..t``, so the head's cache
can live in the target's pages: blocks shared by a prefix hold valid head K/V for every sequence
that shares them. (Slot 0 has no feature; it gets zeros.)

Shared, not copied: the token embedding and the LM head are the target's own tensors; the head
drafts over a reduced vocabulary (``base.py``), so a draft step's LM head is ``len(draft_ids) /
vocab`` of the target's.

Two forwards share the layer's math: :meth:`forward_paged` (inference, through the paged
attention kernel with token-tree masks) and :meth:`unrolled` (training and held-out evaluation:
``steps`` drafting steps from every slot at once, as EAGLE-3's training-time test).
"""
from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .base import DraftHead, QuantizedLinear


@dataclass(frozen=True)
class EagleConfig:
    """Shapes of a head, and what it was made for and from (stored beside the weights as JSON)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int  # the target's
    draft_vocab: int  # len(draft_ids)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    target: dict = field(default_factory=dict)  # target_fingerprint(...) of the target it was distilled from
    recipe: dict = field(default_factory=dict)  # data recipe, steps, measured acceptance (distill's record)


class EagleHead(DraftHead):
    kind = "eagle"
    config_class = EagleConfig
    uses_embedding = True

    def __init__(self, cfg: EagleConfig):
        super().__init__(cfg)
        h, d = cfg.hidden, cfg.head_dim
        self.fc = nn.Linear(2 * h, h)
        self.q_proj = nn.Linear(h, cfg.heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.heads * d, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=cfg.rms_eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, h, bias=False)
        # quantized heads: the products that share an input, one kernel call each (see quantize)
        self.qkv_product: QuantizedLinear | None = None
        self.gate_up_product: QuantizedLinear | None = None
        self._attention_ops = None  # (cache_write, paged_attention) for the cache's device (see forward_paged)

    def quantize(self, scheme: str) -> "EagleHead":
        """:meth:`DraftHead.quantize`, and q/k/v and gate/up each as one product over their stacked weights:
        every scheme scales per output row, so the stacked codes are the separate ones and each output is
        computed as before, in two kernel calls instead of five per draft step."""
        stacked = {"qkv_product": (self.q_proj, self.k_proj, self.v_proj),
                   "gate_up_product": (self.gate_proj, self.up_proj)}
        weights = {name: torch.cat([m.weight for m in mods]) for name, mods in stacked.items()}
        super().quantize(scheme)
        for name, w in weights.items():
            setattr(self, name, QuantizedLinear(w, None, scheme))
        return self

    # ------------------------------------------------------------- the layer
    def _inputs(self, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        e = F.embedding(ids, self.embed).to(feats.dtype)
        return self.fc(torch.cat([e, feats], dim=-1))

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor):
        cfg = self.cfg
        shape = x.shape[:-1]
        if self.qkv_product is not None:
            q, k, v = self.qkv_product(x).split([cfg.heads * cfg.head_dim] + [cfg.kv_heads * cfg.head_dim] * 2, -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(*shape, cfg.heads, cfg.head_dim)
        k = k.reshape(*shape, cfg.kv_heads, cfg.head_dim)
        v = v.reshape(*shape, cfg.kv_heads, cfg.head_dim)
        cos, sin = rotary(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def _finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = x + self.o_proj(attn.reshape(*x.shape[:-1], -1))
        m = self.mlp_norm(h)
        if self.gate_up_product is not None:
            gate, up = self.gate_up_product(m).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(m), self.up_proj(m)
        return h + self.down_proj(F.silu(gate) * up)

    # ------------------------------------------------------------- inference
    def forward_paged(self, ids: torch.Tensor, feats: torch.Tensor, meta, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> torch.Tensor:
        """Predicted features ``[N, hidden]`` of a stream of pairs ``(ids[i], feats[i])`` at ``meta``'s slots
        and positions (a ``compiler.program.AttentionMetadata``; its ``tree_mask`` makes a token tree);
        the pairs' K/V are written to the head's cache first."""
        if self._attention_ops is None:
            self._attention_ops = attention_ops(k_cache.device)
        cache_write, paged_attention = self._attention_ops
        x = self._inputs(ids, feats)
        q, k, v = self._qkv(x, meta.positions)
        cache_write(k.contiguous(), v.contiguous(), k_cache, v_cache, meta.slot_mapping)
        attn = paged_attention(
            q.contiguous(), k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.positions,
            1.0 / math.sqrt(self.cfg.head_dim), 0, 0.0, None, meta.tree_mask)
        return self._finish(x, attn)

    def new_cache(self, num_blocks: int, page_size: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (num_blocks, page_size, self.cfg.kv_heads, self.cfg.head_dim)
        return torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype)

    # -------------------------------------------------------------- training
    def unrolled(self, ids: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """``steps`` drafting steps from every slot of ``B`` sequences at once: ``[g_1, ..., g_steps]``, each
        ``[B, T, hidden]``; ``g_j[:, s]`` predicts ``f_{s+j-1}`` (so drafts token ``s + j``).

        Step 1 is the teacher-forced layer over the true pairs ``(x_s, f_{s-1})``. Step ``j > 1`` of the
        chain started at slot ``s`` feeds ``(x_{s+j-1}, g_{j-1}[s])`` at position ``s + j - 1``, attending
        to the true slots ``<= s`` and to its own chain's earlier steps, exactly what inference does
        while every draft so far was accepted. ``ids``/``feats``: ``[B, T]`` / ``[B, T, hidden]``.
        """
        cfg = self.cfg
        b, t = ids.shape
        rep = cfg.heads // cfg.kv_heads
        scale = 1.0 / math.sqrt(cfg.head_dim)
        prev = torch.cat([feats.new_zeros(b, 1, cfg.hidden), feats[:, :-1]], dim=1)  # f_{s-1}
        pos = torch.arange(t, device=ids.device)
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
        chain_k, chain_v, out = [], [], []
        for j in range(steps):
            tok = ids if j == 0 else torch.cat([ids[:, j:], ids.new_zeros(b, j)], dim=1)  # x_{s+j}
            x = self._inputs(tok, prev)
            q, k, v = self._qkv(x, pos + j)
            q = q.transpose(1, 2)  # [B, H, T, D]
            k, v = (u.transpose(1, 2).repeat_interleave(rep, 1) for u in (k, v))
            if j == 0:
                k0, v0 = k, v  # the true slots
            else:
                chain_k.append(k)
                chain_v.append(v)
            scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
            scores += [(q * kk).sum(-1, keepdim=True) * scale for kk in chain_k]  # the chain's steps 2..j
            p = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
            attn = p[..., :t] @ v0
            for i, vv in enumerate(chain_v):
                attn = attn + p[..., t + i:t + i + 1] * vv
            g = self._finish(x, attn.transpose(1, 2))
            out.append(g)
            prev = g
        return out


def attention_ops(device: torch.device):
    """``(cache_write, paged_attention)``: on CPU the C++ kernels' native twins when built (they run the kernel
    straight from the dispatcher where it applies and the specgraph op otherwise, as compiled steps do),
    else the specgraph ops; the ops' Python layers cost about as much as a draft layer's attention."""
    from ...kernels import cpu_kernels

    importlib.import_module("specgraph.kernels")  # registers specgraph::cache_write / paged_attention
    if device.type == "cpu":
        write, attend = cpu_kernels.native_op("cache_write"), cpu_kernels.native_op("paged_attention")
        if write is not None and attend is not None:
            return write, attend
    return torch.ops.specgraph.cache_write, torch.ops.specgraph.paged_attention


def rotary(positions: torch.Tensor, dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` ``[..., 1, dim]`` for rotate-half rotary embeddings at ``positions``."""
    angles = positions.to(torch.float32)[..., None] * _inverse_frequencies(dim, theta, positions.device)
    angles = torch.cat([angles, angles], dim=-1)[..., None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


@functools.lru_cache(maxsize=8)
def _inverse_frequencies(dim: int, theta: float, device: torch.device) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
