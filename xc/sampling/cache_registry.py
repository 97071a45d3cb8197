"""`sampler=<name>` in the dual mode: the one place that maps a name to a TargetCacheSource factory.

Built-in sources register themselves when their module is imported (`_BUILTIN_MODULES`); another
source (e.g. the dynamic tree index) registers with `register_cache_source(name, factory)` from its
own module and adds that module here, so the trainer never names a concrete source.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from xc.config import SamplerConfig
from xc.errors import ConfigError
from xc.sampling.target_cache import TargetCacheSource


@dataclass(frozen=True)
class CacheSpec:
    """What a factory gets to build the source of ONE label shard.

    num_rows: the shard's real labels (padding rows have no text and are never cached or mined);
    lo: the shard's first global label id; cache_path: where its (num_rows, dim) float32 memmap lives."""

    cfg: SamplerConfig
    shard: int
    lo: int
    num_rows: int
    dim: int
    cache_path: str
    seed: int
    device: torch.device = torch.device("cpu")


CacheFactory = Callable[[CacheSpec], TargetCacheSource]
_REGISTRY: dict[str, CacheFactory] = {}
_BUILTIN_MODULES = ("xc.sampling.label_cache", "xc.sampling.corrector", "xc.sampling.dyntree")


def register_cache_source(name: str, factory: CacheFactory) -> None:
    _REGISTRY[name] = factory


def cache_source_names() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def build_cache_source(name: str, spec: CacheSpec) -> TargetCacheSource:
    _load_builtins()
    if name not in _REGISTRY:
        raise ConfigError("sampler.name", f"no label-cache source {name!r} is registered "
                          f"(registered: {', '.join(sorted(_REGISTRY))})")
    return _REGISTRY[name](spec)
