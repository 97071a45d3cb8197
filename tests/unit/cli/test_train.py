"""`xc-train`'s closing line: the run's wall time as the docs quote it."""

from xc.cli.train import wall_clock


def test_wall_clock_reads_as_the_docs_write_it():
    assert wall_clock(42.46) == "42.5s"
    assert wall_clock(59.96) == "1m00s"
    assert wall_clock(60.0) == "1m00s"
    assert wall_clock(303.6) == "5m04s"
    assert wall_clock(3723.0) == "1h02m03s"


def test_miner_ray_without_ray_installed_stops_in_one_line_before_anything_is_written(tmp_path):
    """`xc-train miner=ray` where Ray is not installed (hidden here: `import ray` raises ImportError) names the
    extra that installs it, exits 2, and leaves no run directory behind."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    run_dir = tmp_path / "run"
    code = "import sys; sys.modules['ray'] = None; from xc.cli.train import main; main()"
    proc = subprocess.run([sys.executable, "-c", code, "miner=ray", f"run_dir={run_dir}", "logger.wandb=disabled",
                           f"data.cache_dir={tmp_path / 'cache'}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "XC_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == ['error: miner=ray needs Ray, which is not installed: pip install -e ".[ray]" (in the xc checkout)']
    assert not run_dir.exists() and not (tmp_path / "cache").exists()  # stopped before the data and the run


def test_the_trainer_is_released_before_the_served_model_is_loaded(tmp_path, monkeypatch):
    """The score calibration loads the finished run as served (its rows, kNN memory and ranker): nothing of the
    trainer (rows, optimiser state, fusion memory) may still be alive then; the served model holds no optimiser."""
    import gc
    import weakref

    from tests.unit.train.test_plan import _setup
    from xc.cli import train as cli_train
    from xc.faults import NO_FAULTS
    from xc.serve.model import TrainedModel
    from xc.train import trainer as trainer_module

    cfg, ctx, dataset = _setup(tmp_path, "classifier", "train.epochs=1", "train.max_steps=2")
    made, alive = [], []

    class Recorded(trainer_module.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    def calibrated(run_cfg, served=None):
        gc.collect()
        alive.append([ref() is not None for ref in made])
        return {}

    monkeypatch.setattr(trainer_module, "Trainer", Recorded)
    monkeypatch.setattr(cli_train, "_calibrated", calibrated)
    metrics = cli_train._train_model(cfg, ctx, dataset, None, NO_FAULTS)
    assert alive == [[False]] and "P@1" in metrics
    served = TrainedModel(cfg.run_dir)
    assert served.components.enc_opt is None and served.components.clf_opt is None
    assert served.shard.row_sq is None  # row-wise Adagrad's accumulators are training state too


def test_the_final_phase_runs_without_the_training_state(tmp_path, monkeypatch):
    """Training is over and checkpointed when the final phase begins: the encoder's optimiser, the row optimiser,
    the rows' fp32 masters and Adagrad accumulators are gone before the kept epoch is loaded and evaluated (at 10^7
    labels they pushed that phase over the host's memory), and the phase still reports the served metrics."""
    from tests.unit.train.test_plan import _setup
    from xc.cli import train as cli_train
    from xc.faults import NO_FAULTS
    from xc.train.modes.classifier.mode import ClassifierMode

    cfg, ctx, dataset = _setup(tmp_path, "classifier", "train.epochs=1", "train.max_steps=2",
                               "model.classifier_dtype=bfloat16", "model.classifier_master_fp32=true")
    seen = []
    real_final, real_keep = ClassifierMode.final_metrics, ClassifierMode.keep_selected_epoch

    def held(mode) -> dict:
        c = mode.c
        return {"encoder optimiser": c.enc_opt is not None, "row optimiser": c.clf_opt is not None,
                "masters": c.shard.master is not None, "accumulators": c.shard.row_sq is not None}

    def keep(mode, micro):
        seen.append(("keep", held(mode)))
        return real_keep(mode, micro)

    def final(mode, *args):
        seen.append(("final", held(mode)))
        return real_final(mode, *args)

    def step(mode, *args, **kwargs):  # what training held, for the comparison
        seen.append(("step", held(mode)))
        return real_step(mode, *args, **kwargs)

    real_step = ClassifierMode.micro_step
    monkeypatch.setattr(ClassifierMode, "keep_selected_epoch", keep)
    monkeypatch.setattr(ClassifierMode, "final_metrics", final)
    monkeypatch.setattr(ClassifierMode, "micro_step", step)
    monkeypatch.setattr(cli_train, "_calibrated", lambda run_cfg, served=None: {})
    metrics = cli_train._train_model(cfg, ctx, dataset, None, NO_FAULTS)
    assert "P@1" in metrics
    parts = ["encoder optimiser", "row optimiser", "masters", "accumulators"]
    assert seen[0] == ("step", dict.fromkeys(parts, True))  # training held every part
    assert [s for s in seen if s[0] != "step"] == [("keep", dict.fromkeys(parts, False)),
                                                   ("final", dict.fromkeys(parts, False))]
