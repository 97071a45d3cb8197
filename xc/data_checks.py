"""Config checks that need the loaded data (the number of labels), run before any training step."""

from __future__ import annotations

from xc.errors import ConfigError


def check_against_data(cfg, dataset) -> None:
    """Raise ConfigError naming the key when a setting cannot work on `dataset`."""
    labels = int(dataset.num_labels)
    if cfg.sampler.name != "full" and cfg.sampler.k_hard + cfg.sampler.k_random > labels:
        raise ConfigError("sampler.k_random", f"sampler.k_hard + sampler.k_random = "
                          f"{cfg.sampler.k_hard + cfg.sampler.k_random} negatives per query exceed the data's "
                          f"{labels} labels")
    if cfg.eval.topk > labels:
        raise ConfigError("eval.topk", f"{cfg.eval.topk} exceeds the data's {labels} labels")
