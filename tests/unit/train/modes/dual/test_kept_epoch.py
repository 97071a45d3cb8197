"""The dual mode keeps the epoch chosen on validation, as the classifier mode does (xc/eval/epoch_select.py through
xc/train/modes/dual/mode.py): its validation rows ranked against every label after each epoch, the selector's state in
each checkpoint, the kept epoch's checkpoint protected from pruning, its towers loaded back at the end and its test
metrics the run's (`eval_kept`)."""

from __future__ import annotations

import json

import numpy as np
import torch
from omegaconf import OmegaConf

from xc.config import build_config
from xc.run import checkpoint as ckpt

TINY = ["experiment=synthetic_lf", "data.name=lf-tiny", "data.synthetic_lf.num_train=512",
        "data.synthetic_lf.num_test=128", "data.synthetic_lf.num_labels=300", "data.synthetic_lf.vocab=400",
        "model.embed_dim=16", "train.batch_size=64", "train.epochs=3", "train.warmup_steps=2",
        "sampler.k_hard=8", "sampler.k_random=16", "sampler.corrector_hidden=16", "train.keep_checkpoints=1",
        "eval.knn_fusion.enabled=false", "logger.wandb=disabled", "logger.progress=false", "train.resume=never"]


def _trainer(tmp_path):
    from hydra import compose, initialize_config_dir

    from xc.cli.train import CONF_DIR
    from xc.datasets import load_configured_dataset
    from xc.distributed import init_distributed
    from xc.train.plan import resolve_run
    from xc.train.trainer import Trainer

    overrides = [*TINY, f"run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = build_config(OmegaConf.to_container(compose("config", overrides=overrides), resolve=True))
    ctx, dataset = init_distributed(device="cpu"), load_configured_dataset(cfg)
    return Trainer(resolve_run(cfg, ctx, dataset), ctx, dataset)


def test_dual_run_keeps_the_epoch_validation_chooses(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path)
    mode = trainer.mode
    assert mode.selector.enabled and len(mode.valid_ids) > 0
    real = mode.validation_per_point
    seen, towers_at = [], {}

    def scripted():  # the real ranking runs (and must give one figure per validation row); epoch 1 then leads
        points = real()
        assert points.shape == (len(mode.valid_ids),) and 0 <= points.min() <= points.max() <= 1
        seen.append(points)
        towers_at[trainer.global_step] = {k: v.clone() for k, v in mode.towers.state_dict().items()}
        return np.ones_like(points) if len(seen) == 1 else np.zeros_like(points)

    monkeypatch.setattr(mode.selector, "score_validation", scripted)
    trainer.fit()

    run = tmp_path / "run"
    selection = json.loads((run / ckpt.SELECTION_FILE).read_text())
    assert len(seen) == 3 and [row["epoch"] for row in selection["epochs"]] == [1, 2, 3]
    kept, last = selection["kept"], selection["last"]
    assert kept["epoch"] == 1 and last["epoch"] == 3
    # keep_checkpoints=1 prunes to the last one, plus the kept epoch's
    assert ckpt.list_checkpoints(run) == [ckpt.step_dir(run, kept["global_step"]), ckpt.step_dir(run, last["global_step"])]
    for name, tensor in mode.towers.state_dict().items():  # the towers the run ends with are epoch 1's
        assert torch.equal(tensor, towers_at[kept["global_step"]][name]), name
    events = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    kept_eval = [e for e in events if e["event"] == "eval_kept"]
    assert len(kept_eval) == 1 and trainer.last_metrics["P@1"] == kept_eval[0]["P@1"]  # fusion is off here
    assert [e["epoch"] for e in events if e["event"] == "valid"] == [1, 2, 3]
