"""The MoE language model of bench/convergence's ``moe_lm_adamw_bf16`` task: a small
DeepSeek-V3-style transformer (latent attention, routed experts with a shared one).

The routed experts are fused as transformers' and DeepSeek-V3's are: one [E, d, hidden] and one
[E, hidden, d] parameter per layer. Each token goes to its top-k experts by sigmoid score (weights
normalised over the k), with no balancing loss, so an expert that no token of a batch picks gets
a zero gradient that step.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x = x.float()  # in float32 under autocast too
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LatentAttention(nn.Module):
    """Causal attention whose keys and values come up from a small shared latent (MLA's idea)."""

    def __init__(self, d: int, heads: int, latent: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d, d, bias=False)
        self.kv_down = nn.Linear(d, latent, bias=False)
        self.kv_norm = RMSNorm(latent)
        self.kv_up = nn.Linear(latent, 2 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        k, v = self.kv_up(self.kv_norm(self.kv_down(x))).chunk(2, dim=-1)

        def heads(y):
            return y.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)

        q = self.q(x)
        y = F.scaled_dot_product_attention(heads(q), heads(k).to(q.dtype), heads(v).to(q.dtype),
                                           is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class MoEFeedForward(nn.Module):
    """A shared expert every token goes through, plus its top-k of E routed experts."""

    def __init__(self, d: int, hidden: int, experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d, experts, bias=False)
        self.w_up = nn.Parameter(torch.randn(experts, d, hidden) / math.sqrt(d))
        self.w_down = nn.Parameter(torch.randn(experts, hidden, d) / math.sqrt(hidden))
        self.shared = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        scores = torch.sigmoid(self.router(flat).float())
        weight, chosen = scores.topk(self.top_k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        out = self.shared(flat)
        routed = torch.zeros_like(out)
        for e in range(self.w_up.shape[0]):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():  # an unrouted expert takes no part: its gradient is zero
                h = F.gelu(flat[token] @ self.w_up[e]) @ self.w_down[e]
                routed = routed.index_add(0, token, (h * weight[token, slot, None]).to(out.dtype))
        return (out + routed).view_as(x)


class MoELM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, context: int, experts: int,
                 hidden: int, top_k: int, latent: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "attn_norm": RMSNorm(d), "attn": LatentAttention(d, heads, latent),
            "moe_norm": RMSNorm(d), "moe": MoEFeedForward(d, hidden, experts, top_k)})
            for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            h = h + block["attn"](block["attn_norm"](h))
            h = h + block["moe"](block["moe_norm"](h))
        return self.head(self.norm(h))
