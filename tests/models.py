"""Test decoders of the four families the compiler must capture (tiny, random weights).

- ``NanoGPT``: hand-written attention (q @ k^T, scale, masked_fill with a causal buffer, softmax, @ v)
- ``SdpaGQA``: ``F.scaled_dot_product_attention(is_causal=True)`` with GQA by ``repeat_interleave``
  and rotary positions
- Hugging Face ``LlamaForCausalLM`` and ``GPT2LMHeadModel`` from tiny configs
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class _NanoBlock(nn.Module):
    def __init__(self, dim: int, heads: int, max_len: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.register_buffer("bias", torch.tril(torch.ones(max_len, max_len)).view(1, 1, max_len, max_len))

    def attn(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT-style decoder: learned positions, fused qkv, hand-written causal attention."""

    def __init__(self, vocab: int = 97, dim: int = 64, heads: int = 4, layers: int = 2, max_len: int = 128):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(_NanoBlock(dim, heads, max_len) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _SdpaBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.norm1 = nn.RMSNorm(dim, eps=1e-6)
        self.wq = nn.Linear(dim, heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, dim, bias=False)
        self.norm2 = nn.RMSNorm(dim, eps=1e-6)
        self.w1 = nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h = self.norm1(x)
        q = self.wq(h).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.w2(F.silu(self.w1(self.norm2(x))))


class SdpaGQA(nn.Module):
    """A decoder using ``F.scaled_dot_product_attention(is_causal=True)``, GQA by repeat_interleave."""

    def __init__(self, vocab: int = 101, dim: int = 64, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                 layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_SdpaBlock(dim, heads, kv_heads, head_dim) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, vocab, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        pos = torch.arange(T, device=tokens.device).float()
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def tiny_llama(layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, vocab: int = 128,
               hidden: int | None = None, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden or heads * head_dim, intermediate_size=2 * (hidden or heads * head_dim),
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=512, tie_word_embeddings=True,
                      use_cache=False)
    return LlamaForCausalLM(cfg).eval()


def tiny_gpt2(layers: int = 2, heads: int = 4, dim: int = 64, vocab: int = 113, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_embd=dim, n_layer=layers, n_head=heads, vocab_size=vocab, n_positions=512, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def make_family(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if name == "llama":
        return tiny_llama(seed=seed)
    if name == "gpt2":
        return tiny_gpt2(seed=seed)
    if name == "nanogpt":
        return NanoGPT().eval()
    if name == "sdpa_gqa":
        return SdpaGQA().eval()
    raise ValueError(name)


FAMILIES = ("llama", "gpt2", "nanogpt", "sdpa_gqa")
VOCAB = {"llama": 128, "gpt2": 113, "nanogpt": 97, "sdpa_gqa": 101}


def random_prompts(family: str, lengths, seed: int = 0) -> list[list[int]]:
    """Seeded random token prompts of the given lengths in the family's vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB[family], (n,), generator=g).tolist() for n in lengths]


def uncached_greedy(model: nn.Module, prompt: list[int], n: int) -> list[int]:
    """The reference: n greedy tokens, each from a full forward over everything so far (no cache)."""
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(ids)
            t = int(getattr(logits, "logits", logits)[0, -1].argmax())
            out.append(t)
            ids = torch.cat([ids, torch.tensor([[t]])], 1)
    return out
