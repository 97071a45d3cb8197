"""Data layer: sparse containers, source parsers, the convert-once memmap cache and synthetic data.

The trainer needs only :func:`load_dataset` and the containers it returns; see ``cache.py`` for the
cache layout, ``formats.py`` for the accepted source formats (``sources.py`` maps kinds to readers) and
``synthetic.py`` for the generator.
"""

from .cache import KINDS, build_atomically, generate_synthetic, load_dataset, open_dataset, read_texts
from .sources import convert_source
from .sparse import CSRWriter, SparseMatrix, XCDataset, XCSplit, load_csr, save_csr
from .synthetic import DEFAULTS as SYNTHETIC_DEFAULTS
from .synthetic import label_signatures, normalize_params

__all__ = [
    "KINDS", "SYNTHETIC_DEFAULTS", "CSRWriter", "SparseMatrix", "XCDataset", "XCSplit",
    "build_atomically", "convert_source", "generate_synthetic", "label_signatures", "load_csr",
    "load_dataset", "normalize_params", "open_dataset", "read_texts", "save_csr",
]
