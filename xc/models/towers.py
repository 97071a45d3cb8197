"""Towers of the dual-encoder (label-feature) mode: f encodes queries, g encodes label texts.

A label's score is <f(x), g(text_l)> (+ <f(x), w_l> with free per-label vectors, held outside the
module in a ClassifierShard like the classifier mode's rows). g is f itself (`share_towers`) or a
second tower of the same kind. Two kinds:

- tokenbag: mean of a token-embedding table over a text's token ids (the MiniLM tokenizer's ids, from
  xc.data.tokens.TokenCache) followed by an optional MLP. CPU-sized: debian-deps trains in minutes.
- transformer: the MiniLM encoder (xc.models.text_encoder), GPU-sized.

Both are wrapped in QueryEncoder (bottleneck projection, L2 normalisation). No torch.distributed here.
"""

from __future__ import annotations

import json
import os

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn
from torch.nn import functional as F

from xc.config import ModelConfig
from xc.models.encoders import QueryEncoder, mlp_layers
from xc.models.text_encoder import TransformerEncoder, default_minilm_path


class _MeanBagCPU(torch.autograd.Function):
    """F.embedding_bag(mode="mean") whose weight gradient is one sparse product, for CPU training.

    torch's CPU backward of embedding_bag adds each token's row through a per-index dispatch: on the dual
    step (about 14,000 label texts of up to 32 tokens) it was three quarters of the backward pass and a
    quarter of the step. Here grad_weight = A^T (grad_out / lengths), A the (bags, vocab) 0/1
    token-count CSR the offsets already describe, computed by scipy's CSC product, which scatters without
    sorting. Same sums as torch's, in another order (float32 round-off only)."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(flat, offsets)
        ctx.vocab = weight.shape[0]
        return F.embedding_bag(flat, weight, offsets, mode="mean")

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        flat, offsets = ctx.saved_tensors
        bounds = torch.cat([offsets, offsets.new_tensor([flat.numel()])]).numpy()
        lengths = np.maximum(np.diff(bounds), 1).astype(np.float32)  # an empty bag's row gets no gradient
        counts = sp.csr_matrix((np.ones(flat.numel(), np.float32), flat.numpy(), bounds),
                               shape=(offsets.numel(), ctx.vocab))
        scaled = grad_out.detach().float().numpy() / lengths[:, None]
        grad_weight = torch.from_numpy(np.ascontiguousarray(counts.T @ scaled, dtype=np.float32))
        return None, None, grad_weight.to(grad_out.dtype)


class TokenBagTower(nn.Module):
    """Mean EmbeddingBag over token ids, then ReLU-MLP layers (hidden_dims).

    batch: "input_ids" (B, T) int64, "attention_mask" (B, T) int64 (1 = real token) -> (B, out_dim).
    A text of only padding (T = 0 or an all-zero mask) embeds to the zero vector before the MLP.
    """

    def __init__(self, vocab_size: int, embed_dim: int, hidden_dims: list[int], dropout: float):
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab_size, embed_dim, mode="mean")
        nn.init.normal_(self.bag.weight, std=embed_dim ** -0.5)
        self.mlp, self.out_dim = mlp_layers(embed_dim, hidden_dims, dropout)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids, mask = batch["input_ids"], batch["attention_mask"].bool()
        flat = ids[mask]  # (nnz,) the real tokens, row-major
        lengths = mask.sum(1)
        offsets = torch.cumsum(lengths, 0) - lengths  # (B,) start of each row in `flat`
        weight = self.bag.weight
        if weight.device.type == "cpu" and weight.requires_grad and torch.is_grad_enabled():
            return self.mlp(_MeanBagCPU.apply(flat, offsets, weight))
        return self.mlp(self.bag(flat, offsets))


def tokenizer_vocab_size(path: str | None) -> int:
    """vocab_size from a Hugging Face model directory's config.json (None = the packaged MiniLM)."""
    with open(os.path.join(path or default_minilm_path(), "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def build_tower(cfg: ModelConfig) -> QueryEncoder:
    """One tower of the kind model.tower names; weights from torch's current RNG state."""
    if cfg.tower == "tokenbag":
        base: nn.Module = TokenBagTower(tokenizer_vocab_size(cfg.path), cfg.embed_dim, cfg.hidden_dims, cfg.dropout)
    else:
        base = TransformerEncoder(cfg.path, pooling=cfg.pooling)
    return QueryEncoder(base, cfg.bottleneck_dim, cfg.dropout, cfg.normalize)


class DualTowers(nn.Module):
    """The trained modules of the dual mode: `query` (f) and `label` (g, the same module when shared).

    One module so that one optimizer, one gradient all-reduce and one state dict cover both towers;
    a shared tower's parameters appear once in `parameters()`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.query = build_tower(cfg)
        self.shared = cfg.share_towers
        self.label_tower = None if cfg.share_towers else build_tower(cfg)
        self.out_dim = self.query.out_dim

    @property
    def label(self) -> QueryEncoder:
        return self.query if self.label_tower is None else self.label_tower
