"""Nearest-neighbour search over classifier vectors: exact, DiskANN and faiss backends behind AnnIndex."""

from xc.ann.base import AnnIndex, AnnParams, recall_at_k, search_excluding
from xc.ann.exact import exact_topk
from xc.ann.registry import build_index

__all__ = ["AnnIndex", "AnnParams", "build_index", "exact_topk", "recall_at_k", "search_excluding"]
