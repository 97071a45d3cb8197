"""Every option's default is the typed config's (xc/config.py): the YAML files that list a group's options
(conf/miner/common.yaml, conf/sampler/common.yaml, the train, eval, parallel and logger defaults, the default
bag-of-words model) may not say otherwise, so a default is decided in one place and the YAML only shows it.
Presets (miner=pool, sampler=astra, ...) start from the common file and set what makes them the preset."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from xc.cli.train import CONF_DIR
from xc.config import EvalConfig, LoggerConfig, MinerConfig, ModelConfig, ParallelConfig, SamplerConfig, TrainConfig


def _differences(yaml_node: dict, default, prefix: str) -> list[str]:
    """Leaves of `yaml_node` whose value is not the dataclass instance `default`'s (nested dataclasses followed)."""
    out = []
    for key, value in yaml_node.items():
        assert hasattr(default, key), f"{prefix}{key} is no field of {type(default).__name__}"
        expected = getattr(default, key)
        if dataclasses.is_dataclass(expected):
            out += _differences(value, expected, f"{prefix}{key}.")
        elif (list(expected) if isinstance(expected, tuple) else expected) != value:
            out.append(f"{prefix}{key}: yaml {value!r}, dataclass {expected!r}")
    return out


# what a file sets on purpose: its group's preset name, not a default
ALLOWED = {"miner": {"mode"}, "sampler": {"name"}}


@pytest.mark.parametrize("file, group, config_class", [
    ("miner/common.yaml", "miner", MinerConfig), ("sampler/common.yaml", "sampler", SamplerConfig),
    ("train/default.yaml", "train", TrainConfig), ("eval/default.yaml", "eval", EvalConfig),
    ("parallel/default.yaml", "parallel", ParallelConfig), ("logger/default.yaml", "logger", LoggerConfig),
    ("model/bow.yaml", "model", ModelConfig)])
def test_the_yaml_of_a_group_restates_the_dataclass_defaults(file, group, config_class):
    node = OmegaConf.to_container(OmegaConf.load(f"{CONF_DIR}/{file}"), resolve=False)
    node.pop("defaults", None)
    diffs = [d for d in _differences(node, config_class(), f"{group}.")
             if d.split(":")[0].split(".")[-1] not in ALLOWED.get(group, ())]
    assert not diffs, "\n".join(diffs)


def test_the_checker_reports_a_changed_default():
    node = {"workers": 99, "ann": {"exact_head": 1}}
    assert _differences(node, MinerConfig(), "miner.") == [
        f"miner.workers: yaml 99, dataclass {MinerConfig().workers!r}",
        f"miner.ann.exact_head: yaml 1, dataclass {MinerConfig().ann.exact_head!r}"]
