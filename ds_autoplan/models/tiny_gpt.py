"""The one small GPT of ds_autoplan (plain torch modules, torch.fx traceable).

Layer list for pipelines: ``[Embedding, Block x num_layers, Head]`` (:meth:`TinyGPT.layers`);
the profiler, the DeepSpeed / Megatron examples and the accuracy bench all use this model.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 512
    hidden: int = 64
    num_layers: int = 8
    num_heads: int = 4
    seq_len: int = 64
    mlp_ratio: int = 4

    def to_dict(self) -> dict:
        return asdict(self)


class Embedding(nn.Module):
    """Token + learned position embedding.  ``seq_shard`` (index of this rank's piece of the
    sequence, set by sequence parallelism) offsets the positions: shard r of length t holds
    positions r·t ... r·t + t - 1."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.seq_shard = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        pos = torch.arange(self.seq_shard * t, (self.seq_shard + 1) * t, device=idx.device)
        return self.tok(idx) + self.pos(pos)


class CausalCore(nn.Module):
    """The attention core on [batch, seq, heads, head_dim] q, k, v (SDPA, causal): the part
    DeepSpeed-Ulysses wraps (``deepspeed.sequence.layer.DistributedAttention`` calls it with
    the whole sequence and a slice of the heads)."""

    def forward(self, q, k, v, batch_dim_idx: int = 0):
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        return y.transpose(1, 2)


class Attention(nn.Module):
    """Causal multi-head self-attention (fused QKV projection, SDPA kernel)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.hidden % cfg.num_heads == 0, "hidden must be divisible by num_heads"
        self.h, self.nh = cfg.hidden, cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.core = CausalCore()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.size(0), x.size(1)
        qkv = self.qkv(x).view(b, t, 3, self.nh, self.h // self.nh)
        y = self.core(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], 0)   # batch dim 0
        return self.proj(y.reshape(b, t, self.h))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden)
        self.act = nn.GELU()
        self.out = nn.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm + LM head (logits)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.hidden)
        self.lm = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig | None = None, **overrides):
        super().__init__()
        cfg = cfg or GPTConfig(**overrides)
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.head = Head(cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)

    def layers(self) -> list[nn.Module]:
        """The pipeline layer list: embedding, blocks, head."""
        return [self.embed, *self.blocks, self.head]

    def example_inputs(self, batch_size: int = 1, seed: int = 0) -> tuple[torch.Tensor]:
        return (example_batch(self.cfg, batch_size, seed)[0],)


def example_batch(cfg: GPTConfig, batch_size: int, seed: int = 0):
    """Random token ids and next-token targets, shape [batch_size, seq_len]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def ulysses_layers(layers, group) -> list:
    """The pipeline layers with DeepSpeed-Ulysses attention over ``group`` (each rank holds
    1/sp of every sequence; see ``ds_autoplan.runtime.deepspeed.ulysses``)."""
    from ..runtime.deepspeed.ulysses import ulysses
    return ulysses(layers, group, (CausalCore,))


def gpt_tiny(**overrides) -> TinyGPT:
    """``gpt-tiny`` (as configs/models/gpt-tiny.yaml): 8 layers, hidden 64, 4 heads, vocab 512,
    seq 64."""
    torch.manual_seed(overrides.pop("seed", 0))
    return TinyGPT(GPTConfig(**overrides))
