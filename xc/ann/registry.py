"""`build_index(backend, params)`: the one way to get an `AnnIndex`.

Backend classes (and so faiss / diskannpy / torch) are imported only when asked for.
"""

from __future__ import annotations

import dataclasses
import importlib

from xc.ann.base import AUTO_BACKEND, BACKENDS, AnnIndex, AnnParams
from xc.errors import ConfigError

_CLASSES = {
    "diskann": ("xc.ann.diskann_backend", "DiskannIndex"),
    "faiss_hnsw": ("xc.ann.faiss_backend", "FaissHNSWIndex"),
    "faiss_ivf": ("xc.ann.faiss_backend", "FaissIVFIndex"),
    "faiss_gpu": ("xc.ann.faiss_backend", "FaissGpuIndex"),
    "exact": ("xc.ann.exact_backend", "ExactIndex"),
    "torch": ("xc.ann.torch_backend", "TorchIndex"),
    "clustered": ("xc.ann.clustered", "ClusteredIndex"),
}
assert tuple(_CLASSES) == BACKENDS


def build_index(backend: str | None = None, params: AnnParams | None = None) -> AnnIndex:
    """An unbuilt index of `backend` (default: `params.backend`) configured by `params`.

    Raises ConfigError("ann.backend") for an unknown backend and ConfigError("ann.<field>") for an
    invalid parameter; call `.build(vectors)` next.
    """
    params = params if params is not None else AnnParams()
    if not isinstance(params, AnnParams):
        raise TypeError(f"params must be an AnnParams, got {type(params).__name__}")
    backend = params.backend if backend is None else backend
    if backend == AUTO_BACKEND:
        raise ConfigError("ann.backend", "'auto' is resolved by the trainer from the label count (miner=sync, "
                          "xc/defaults/); name one of " + ", ".join(BACKENDS))
    if backend not in _CLASSES:
        raise ConfigError("ann.backend", f"{backend!r} is not one of {', '.join(BACKENDS)}")
    if params.backend != backend:
        params = dataclasses.replace(params, backend=backend)
    params.validate()
    module, cls = _CLASSES[backend]
    return getattr(importlib.import_module(module), cls)(params)
