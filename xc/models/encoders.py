"""Query encoders: sparse bag-of-words, precomputed dense features, and the shared output head.

Every encoder maps a batch dict of tensors to embeddings (B, d). The transformer encoder lives in
`text_encoder.py`; `build_encoder` picks one from the model config.
"""

from __future__ import annotations

import torch
from torch import nn

from xc.config import ModelConfig
from xc.errors import ConfigError
from xc.models.text_encoder import TransformerEncoder


class Dropout(nn.Module):
    """Inverted dropout (as nn.Dropout: zero each element with probability p, scale the rest by 1 / (1 - p)) whose
    CPU mask comes from 16-bit slices of 64-bit random words, one draw per four elements: torch's CPU dropout
    draws each element (3.4 ms for a (256, 1024) batch on 2 threads, about a tenth of a debian-deps training step;
    this layer 0.8 ms, 1.0 with its backward). Elements are dropped with probability round(p 2^16) / 2^16, p itself
    for p = 0.5 and within 2^-17 of it otherwise. Draws from torch's default generator, as nn.Dropout does; CUDA
    keeps torch's kernel."""

    def __init__(self, p: float):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.threshold = round(p * 65536)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if x.device.type != "cpu":
            return nn.functional.dropout(x, self.p, True)
        words = torch.randint(-2 ** 63, 2 ** 63 - 1, (-(-x.numel() // 4),), dtype=torch.int64)
        slices = words.view(torch.int16)[:x.numel()].to(torch.int32) & 0xFFFF  # uniform on [0, 2^16)
        keep = (slices >= self.threshold).view(x.shape)
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}"


def mlp_layers(width: int, hidden_dims: list[int], dropout: float) -> tuple[nn.Sequential, int]:
    """ReLU -> Dropout -> Linear per hidden width, after a bag or projection of `width` features;
    returns the layers and the output width (`width` itself when hidden_dims is empty)."""
    layers: list[nn.Module] = []
    for hidden in hidden_dims or []:  # None (not yet derived from the data, xc/defaults/) = no hidden layer
        layers += [nn.ReLU(), Dropout(dropout), nn.Linear(width, hidden)]
        width = hidden
    return nn.Sequential(*layers), width


def _caught_up_first(module, prefix, keep_vars) -> None:
    module._catch_up()


class BowEncoder(nn.Module):
    """Sparse bag-of-words: a weighted EmbeddingBag over feature ids, then an optional MLP.

    batch: "feat_ids" (nnz,) int64, "feat_offsets" (B,) int64, "feat_values" (nnz,) float32.
    Feature values arrive L2-normalised per row (see `xc.data.inputs.sparse_inputs`).
    """

    def __init__(self, num_features: int, embed_dim: int, hidden_dims: list[int], dropout: float,
                 input_dropout: float = 0.0, sparse_grad: bool = False):
        super().__init__()
        self.input_dropout = input_dropout
        if num_features < 1:
            raise ConfigError("model.encoder", "bow needs sparse features; this dataset has none")
        self.bag = nn.EmbeddingBag(num_features, embed_dim, mode="sum")
        nn.init.normal_(self.bag.weight, std=embed_dim ** -0.5)
        self.mlp, self.out_dim = mlp_layers(embed_dim, hidden_dims, dropout)
        # model.sparse_features: the table is not a trained parameter of autograd's; each forward with grad
        # gathers the batch's unique feature rows as a leaf (U, embed_dim) and records (ids, rows) in
        # `touched`, which xc.train.optim.RowTableAdam consumes at the step, as the classifier's rows are.
        self.gather_rows = sparse_grad
        self.touched: list[tuple[torch.Tensor, torch.Tensor]] = []
        # set by RowTableAdam: brings rows up to date (the momentum steps it defers) before they are read, the
        # batch's rows in a training step, every row outside one; the state-dict hook makes checkpoints read it so
        self.before_read = None
        if sparse_grad:
            self.bag.weight.requires_grad_(False)
            self.register_state_dict_pre_hook(_caught_up_first)

    def _catch_up(self, ids: torch.Tensor | None = None) -> None:
        if self.before_read is not None:
            self.before_read(ids)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids, offsets, values = batch["feat_ids"], batch["feat_offsets"], batch["feat_values"]
        if self.training and self.input_dropout:  # word dropout: each example sees a random subset of its words
            values = nn.functional.dropout(values, self.input_dropout)
        if self.gather_rows and torch.is_grad_enabled():
            unique, inverse = torch.unique(ids, return_inverse=True)
            self._catch_up(unique)
            rows = self.bag.weight[unique].requires_grad_()  # (U, embed_dim): the step's only table traffic
            self.touched.append((unique, rows))
            pooled = nn.functional.embedding_bag(inverse, rows, offsets, mode="sum", per_sample_weights=values)
        else:
            self._catch_up()
            pooled = self.bag(ids, offsets, per_sample_weights=values)
        return self.mlp(pooled)


class DenseEncoder(nn.Module):
    """Precomputed dense query features (B, F) followed by a projection MLP."""

    def __init__(self, num_features: int, embed_dim: int, hidden_dims: list[int], dropout: float):
        super().__init__()
        head, self.out_dim = mlp_layers(embed_dim, hidden_dims, dropout)
        self.net = nn.Sequential(nn.Linear(num_features, embed_dim), *head)  # same layer indices as before

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.net(batch["dense"])


class QueryEncoder(nn.Module):
    """Base encoder + dropout + optional bottleneck projection + optional L2 normalisation, and an
    optional constant 1 appended last (so the classifier row's last column acts as a label bias, in
    training, mining, snapshots and ANN serving alike)."""

    def __init__(self, base: nn.Module, bottleneck_dim: int | None, dropout: float, normalize: bool,
                 label_bias: bool = False):
        super().__init__()
        self.base = base
        self.dropout = Dropout(dropout)
        self.project = nn.Linear(base.out_dim, bottleneck_dim) if bottleneck_dim else nn.Identity()
        self.normalize = normalize
        self.label_bias = label_bias
        self.out_dim = (bottleneck_dim or base.out_dim) + int(label_bias)
        # Mixed precision (train.amp, xc.train.precision): base + projection run under torch.autocast in this
        # dtype on the parameters' device type; the embedding leaves as float32 either way.
        self.autocast: torch.dtype | None = None

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.autocast is None:
            emb = self.project(self.dropout(self.base(batch)))
        else:
            with torch.autocast(next(self.parameters()).device.type, dtype=self.autocast):
                emb = self.project(self.dropout(self.base(batch)))
            emb = emb.float()
        if self.normalize:
            emb = nn.functional.normalize(emb, dim=-1)
        if self.label_bias:
            emb = torch.cat([emb, emb.new_ones(emb.shape[0], 1)], dim=1)
        return emb


def build_encoder(cfg: ModelConfig, num_features: int) -> QueryEncoder:
    """The query encoder the config names; weights drawn from torch's current RNG state."""
    if cfg.encoder == "bow":
        base: nn.Module = BowEncoder(num_features, cfg.embed_dim, cfg.hidden_dims, cfg.dropout, cfg.input_dropout,
                                     bool(cfg.sparse_features))
    elif cfg.encoder == "dense":
        base = DenseEncoder(num_features, cfg.embed_dim, cfg.hidden_dims, cfg.dropout)
    else:
        base = TransformerEncoder(cfg.path, pooling=cfg.pooling)
    return QueryEncoder(base, cfg.bottleneck_dim, cfg.dropout, cfg.normalize, cfg.label_bias)


def row_tables(module: nn.Module) -> list[BowEncoder]:
    """The bag-of-words encoders in `module` whose feature table trains by gathered rows (model.sparse_features)."""
    return [m for m in module.modules() if isinstance(m, BowEncoder) and m.gather_rows]


def touched_row_grads(module: nn.Module) -> list[torch.Tensor]:
    """The gradients (U, embed_dim) of the table rows the micro-steps since the last step gathered."""
    return [rows.grad for m in row_tables(module) for _, rows in m.touched if rows.grad is not None]
