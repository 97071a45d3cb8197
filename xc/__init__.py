"""xc: distributed extreme-classification training with asynchronous ANNS refresh of hard negatives."""

__version__ = "0.1.0"


def load(run_dir, checkpoint=None, device: str = "cpu", batch_size: int | None = None):
    """A trained run restored for inference: `xc.load(run_dir).predict(texts_or_rows, k=10)`.

    Imported lazily (torch, the data layer) so that `import xc` stays cheap; see `xc.serve.model.TrainedModel`,
    `xc.ensemble.model.EnsembleModel` for an ensemble run (RUN_DIR/ensemble.json), and `xc.serve.export` for a
    folder `xc-export` wrote (DIR/export.json: safetensors and JSON, nothing unpickled).
    """
    from pathlib import Path

    from xc.serve.model import TrainedModel

    if (Path(run_dir) / "export.json").exists():
        from xc.serve.export import load_export

        return load_export(run_dir, checkpoint, device=device, batch_size=batch_size)

    refuse_unfinished_ensemble(run_dir)
    if (Path(run_dir) / "ensemble.json").exists():
        if checkpoint is not None:
            from xc.errors import XCError

            raise XCError(f"{run_dir} is an ensemble: each member has its own checkpoints; load one member with "
                          f"xc.load('{Path(run_dir) / 'members' / 'm0'}', checkpoint=...)")
        from xc.ensemble.model import EnsembleModel

        return EnsembleModel(run_dir, device=device, batch_size=batch_size)

    return TrainedModel(run_dir, checkpoint, device=device, batch_size=batch_size)


def fit(X, Y, *, X_test=None, Y_test=None, label_names=None, run_dir=None, **overrides):  # noqa: N803
    """Train from Python objects in this process, as `xc-train` does from files, and return the model
    (`xc.load(run_dir)`): `xc.fit(X, Y)` with X an (n, F) scipy sparse or numpy matrix or a list of n texts, Y an
    (n, L) 0/1 matrix or n lists of label names; hydra overrides as keywords (`sampler="uniform"`,
    `train__epochs=5` for train.epochs=5). See `xc.cli.fit`."""
    from xc.cli.fit import fit as _fit

    return _fit(X, Y, X_test=X_test, Y_test=Y_test, label_names=label_names, run_dir=run_dir, **overrides)


def refuse_unfinished_ensemble(run_dir) -> None:
    """An ensemble run directory whose members have not all finished has nothing to serve as a whole yet:
    say so (and what to do) instead of "no valid checkpoint"."""
    from pathlib import Path

    run_dir = Path(run_dir)
    if (run_dir / "members").is_dir() and not (run_dir / "ensemble.json").exists():
        from xc.errors import XCError

        raise XCError(f"{run_dir} holds an ensemble whose members have not all finished (no ensemble.json yet): "
                      f"xc-train resumes it; a finished member loads alone, e.g. {run_dir / 'members' / 'm0'}")
