"""Encoders and classifier shards. No torch.distributed in here."""

from xc.models.classifier import ClassifierShard, score
from xc.models.encoders import BowEncoder, DenseEncoder, QueryEncoder, build_encoder

__all__ = ["ClassifierShard", "score", "BowEncoder", "DenseEncoder", "QueryEncoder", "build_encoder"]
