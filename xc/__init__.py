"""xc: distributed extreme-classification training with asynchronous ANNS refresh of hard negatives."""

__version__ = "0.1.0"


def load(run_dir, checkpoint=None, device: str = "cpu", batch_size: int | None = None):
    """A trained run restored for inference: `xc.load(run_dir).predict(texts_or_rows, k=10)`.

    Imported lazily (torch, the data layer) so that `import xc` stays cheap; see `xc.serve.load`: a
    `xc.serve.model.TrainedModel`, an `xc.serve.ensemble.EnsembleModel` for an ensemble run (RUN_DIR/ensemble.json),
    or a folder `xc-export` wrote (DIR/export.json: safetensors and JSON, nothing unpickled).
    """
    from xc.serve.load import load as _load  # lazy: `import xc` stays cheap (no torch)

    return _load(run_dir, checkpoint, device=device, batch_size=batch_size)


def fit(X, Y, *, X_test=None, Y_test=None, label_names=None, run_dir=None, **overrides):  # noqa: N803
    """Train from Python objects in this process, as `xc-train` does from files, and return the model
    (`xc.load(run_dir)`): `xc.fit(X, Y)` with X an (n, F) scipy sparse or numpy matrix or a list of n texts, Y an
    (n, L) 0/1 matrix or n lists of label names; hydra overrides as keywords (`sampler="uniform"`,
    `train__epochs=5` for train.epochs=5). See `xc.cli.fit`."""
    from xc.cli.fit import fit as _fit  # lazy: `import xc` stays cheap (no torch)

    return _fit(X, Y, X_test=X_test, Y_test=Y_test, label_names=label_names, run_dir=run_dir, **overrides)
