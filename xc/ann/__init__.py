"""Nearest-neighbour search over classifier vectors (exact here; DiskANN and faiss backends plug in beside it)."""

from xc.ann.exact import exact_topk

__all__ = ["exact_topk"]
