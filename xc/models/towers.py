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

import torch
from torch import nn

from xc.config import ModelConfig
from xc.models.encoders import QueryEncoder, mlp_layers


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
        return self.mlp(self.bag(flat, offsets))


def tokenizer_vocab_size(path: str | None) -> int:
    """vocab_size from a Hugging Face model directory's config.json (None = the packaged MiniLM)."""
    from xc.models.text_encoder import default_minilm_path

    with open(os.path.join(path or default_minilm_path(), "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def build_tower(cfg: ModelConfig) -> QueryEncoder:
    """One tower of the kind model.tower names; weights from torch's current RNG state."""
    if cfg.tower == "tokenbag":
        base: nn.Module = TokenBagTower(tokenizer_vocab_size(cfg.path), cfg.embed_dim, cfg.hidden_dims, cfg.dropout)
    else:
        from xc.models.text_encoder import TransformerEncoder  # heavy import only when asked for

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
