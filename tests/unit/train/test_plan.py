"""A run's config is resolved once, before anything trains (xc/train/plan.py): the resolution is a fixed point on
its own result, the Trainer takes only a resolved plan, nothing the Trainer or its mode does resolves again, and the
entry point resolves each model's config once, before the Trainer is built."""

from __future__ import annotations

from dataclasses import replace

import pytest
from omegaconf import OmegaConf

from xc.config import build_config
from xc.errors import ConfigError
from xc.faults import NO_FAULTS
from xc.run import resume
from xc.train import plan as plan_module
from xc.train.modes import ModePlan

# the classifier mode on small synthetic data, the dual mode on tiny generated label texts
# (tests/unit/train/modes/dual/test_kept_epoch.py's data); rules decide every null key left here
MODES = {
    "classifier": ["data.synthetic.num_train=600", "data.synthetic.num_test=80", "data.synthetic.num_labels=300",
                   "data.synthetic.num_features=500", "model.embed_dim=16", "train.warmup_steps=2",
                   "train.ensemble=1", "eval.knn_fusion.enabled=false", "eval.ranker.enabled=false"],
    "dual": ["experiment=synthetic_lf", "data.name=lf-tiny", "data.synthetic_lf.num_train=512",
             "data.synthetic_lf.num_test=128", "data.synthetic_lf.num_labels=300", "data.synthetic_lf.vocab=400",
             "model.embed_dim=16", "train.batch_size=64", "train.warmup_steps=2", "sampler.k_hard=8",
             "sampler.k_random=16", "sampler.corrector_hidden=16", "eval.knn_fusion.enabled=false"],
}


def _setup(tmp_path, mode: str, *extra: str):
    """(config as given, its ctx, its dataset) for `mode`, in tmp_path."""
    from hydra import compose, initialize_config_dir

    from xc.cli.train import CONF_DIR
    from xc.datasets import load_configured_dataset
    from xc.distributed import init_distributed

    overrides = [*MODES[mode], *extra, f"run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}",
                 "logger.wandb=disabled", "logger.progress=false", "logger.jsonl=false"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = build_config(OmegaConf.to_container(compose("config", overrides=overrides), resolve=True))
    return cfg, init_distributed(device="cpu"), load_configured_dataset(cfg)


@pytest.mark.parametrize("mode", list(MODES))
def test_resolving_a_resolved_config_gives_the_same_plan(tmp_path, mode):
    cfg, ctx, dataset = _setup(tmp_path, mode)
    plan = plan_module.resolve_run(cfg, ctx, dataset)
    assert isinstance(plan, ModePlan) and plan.source is None
    assert plan.cfg != cfg  # rules did decide
    assert plan_module.resolve_run(plan.cfg, ctx, dataset) == plan


def test_the_dual_mode_pins_and_preconditions_are_part_of_the_resolution(tmp_path):
    cfg, ctx, dataset = _setup(tmp_path, "dual", "train.optimizer_classifier=rowadagrad")
    assert plan_module.resolve_run(cfg, ctx, dataset).cfg.train.optimizer_classifier == "sgd"
    with pytest.raises(ConfigError, match="train.amp"):
        plan_module.resolve_run(replace(cfg, train=replace(cfg.train, amp="fp16")), ctx, dataset)


def test_the_trainer_refuses_a_config_that_was_not_resolved(tmp_path):
    from xc.train.trainer import Trainer

    cfg, ctx, dataset = _setup(tmp_path, "classifier")
    with pytest.raises(TypeError, match="resolve_run"):
        Trainer(cfg, ctx, dataset)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("mode", list(MODES))
def test_nothing_resolves_again_once_the_plan_is_made(tmp_path, mode, monkeypatch):
    """Building the Trainer and training a few steps neither re-resolves the config nor looks for a checkpoint
    again: the run uses exactly the plan's config and resume source."""
    from xc.train.trainer import Trainer

    cfg, ctx, dataset = _setup(tmp_path, mode, "train.epochs=1", "train.max_steps=2")
    plan = plan_module.resolve_run(cfg, ctx, dataset)

    def again(*args, **kwargs):
        raise AssertionError("the run's config was resolved again after its plan was made")

    for name in ("find_checkpoint", "adapt_config"):
        monkeypatch.setattr(resume, name, again)
    for name in ("resolve_run", "_resolve_classifier", "_resolve_dual"):
        monkeypatch.setattr(plan_module, name, again)
    trainer = Trainer(plan, ctx, dataset)
    assert trainer.cfg is plan.cfg and trainer.mode.cfg is plan.cfg and trainer.resume_from is plan.source
    trainer.fit()
    assert trainer.global_step == 2


def test_the_entry_point_resolves_once_and_builds_the_trainer_from_that_plan(tmp_path, monkeypatch):
    """xc/cli/train.py's one model (each ensemble member goes the same way): one resolution, after the run
    directory's guard, and the Trainer gets that very plan."""
    from xc.cli import train as cli_train
    from xc.run import guard
    from xc.train import trainer as trainer_module

    cfg, ctx, dataset = _setup(tmp_path, "classifier")
    calls, real = [], plan_module.resolve_run

    def counted(*args):
        calls.append(real(*args))
        return calls[-1]

    class Built(Exception):
        """Raised where the Trainer would be built, carrying the plan it was given."""

    def trainer(plan, *args, **kwargs):
        raise Built(plan)

    guarded = []
    monkeypatch.setattr(cli_train, "guard_run_dir", lambda *a: guarded.append(len(calls)) or guard.guard_run_dir(*a))
    monkeypatch.setattr(plan_module, "resolve_run", counted)
    monkeypatch.setattr(trainer_module, "Trainer", trainer)
    with pytest.raises(Built) as built:
        cli_train._train_model(cfg, ctx, dataset, None, NO_FAULTS)
    assert guarded == [0] and len(calls) == 1 and built.value.args[0] is calls[0]


def test_a_resumed_run_keeps_the_rows_width_and_precision_its_checkpoint_was_trained_with(tmp_path, monkeypatch):
    """The rows' width and precision come from the free memory (xc.defaults.resolve_rows); a run resumed where
    less is free keeps its checkpoint's rows (here the encoder's own 128 in float32, where a fresh run would now
    project to 64 in bfloat16), and every rule reading the width follows them."""
    from xc.models import row_memory
    from xc.train.trainer import Trainer

    cfg, ctx, dataset = _setup(tmp_path, "classifier", "model.embed_dim=128", "train.epochs=1", "train.max_steps=2")
    plan = plan_module.resolve_run(cfg, ctx, dataset)
    assert (plan.cfg.model.bottleneck_dim, plan.cfg.model.classifier_dtype) == (None, "float32")
    Trainer(plan, ctx, dataset).fit()
    # 300 labels (rows, accumulators, snapshot): 128 in float32 needs 300 x (512 + 4 + 512) B = 308,400 B, 64 in
    # float32 154,800 B, 64 in bfloat16 300 x (128 + 4 + 128) B = 78,000 B, within 60% of 200,000
    monkeypatch.setattr(row_memory, "available_memory",
                        lambda device: row_memory.FreeMemory(200_000, "MemAvailable"))
    fresh = plan_module.resolve_run(replace(cfg, run_dir=str(tmp_path / "fresh")), ctx, dataset)
    assert (fresh.cfg.model.bottleneck_dim, fresh.cfg.model.classifier_dtype) == (64, "bfloat16")
    resumed = plan_module.resolve_run(cfg, ctx, dataset)
    assert resumed.source is not None
    assert (resumed.cfg.model.bottleneck_dim, resumed.cfg.model.classifier_dtype) == (None, "float32")
    assert resumed.cfg == replace(plan.cfg, parallel=resumed.cfg.parallel)


def test_the_inputs_weighting_follows_the_lexical_weights_on_the_datas_counts(tmp_path):
    """`model.feature_weighting: auto` is resolved in the plan after the lexical weights: idf on the synthetic term
    counts where the model has lexical weights, none where it has none and in the dual mode (texts)."""
    cfg, ctx, dataset = _setup(tmp_path, "classifier")
    assert cfg.model.feature_weighting == "auto"
    plan = plan_module.resolve_run(cfg, ctx, dataset)
    assert (plan.cfg.model.lexical_features, plan.cfg.model.feature_weighting) == (0, "none")  # 600 points
    cfg, ctx, dataset = _setup(tmp_path, "classifier", "model.lexical_features=4")
    assert plan_module.resolve_run(cfg, ctx, dataset).cfg.model.feature_weighting == "idf"
    cfg, ctx, dataset = _setup(tmp_path, "dual")
    assert plan_module.resolve_run(cfg, ctx, dataset).cfg.model.feature_weighting == "none"
