"""A small GPT (causal transformer, byte-level vocabulary) for examples, tests and benchmarks.

    model = GPT(GPTConfig.preset("tiny"))
    loss = model(idx, targets)        # idx, targets: LongTensor (batch, seq)

Pre-LayerNorm blocks, fused causal attention (scaled_dot_product_attention),
GELU MLP, token embedding tied to the output head.  Logits are upcast to fp32
for the loss so 16-bit weights do not cost accuracy in the cross-entropy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {
    # name: (n_layer, n_head, d_model)
    "tiny": (2, 2, 64),
    "mini": (4, 4, 128),
    "cpu-mini": (4, 4, 256),       # 3.2M: the CPU default of scripts/train_gpt.py
    "small-cpu": (6, 6, 384),      # 10.8M parameters at vocab 256
    "gpt2": (12, 12, 768),         # GPT-2 small dims (124M with its vocab)
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}


@dataclass(kw_only=True)
class GPTConfig:
    """vocab_size: 256 for bytes.  seq_len: longest context.  dropout: 0 keeps runs deterministic."""
    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for f in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            if not (isinstance(getattr(self, f), int) and getattr(self, f) >= 1):
                raise ValueError(f"{f} must be an int >= 1, got {getattr(self, f)!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def preset(cls, name: str, **kw) -> "GPTConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
        L, H, D = PRESETS[name]
        return cls(n_layer=L, n_head=H, d_model=D, **kw)


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.fc = nn.Linear(c.d_model, 4 * c.d_model)
        self.out = nn.Linear(4 * c.d_model, c.d_model)
        self.n_head = c.n_head
        self.dropout = c.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab_size, c.d_model)
        self.pos = nn.Embedding(c.seq_len, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)
        for b in self.blocks:  # GPT-2's scaled init of residual projections
            for lin in (b.proj, b.out):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * c.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if T > self.config.seq_len:
            raise ValueError(f"sequence of {T} tokens exceeds seq_len {self.config.seq_len}")
        pos = torch.arange(T, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def flops_per_token(c: GPTConfig, n_params: int) -> float:
    """Training FLOPs per token (forward + backward): 6N + attention (Kaplan et al.)."""
    return 6.0 * n_params + 12.0 * c.n_layer * c.d_model * c.seq_len
