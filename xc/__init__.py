"""xc: distributed extreme-classification training with asynchronous ANNS refresh of hard negatives."""

__version__ = "0.1.0"


def load(run_dir, checkpoint=None, device: str = "cpu", batch_size: int | None = None):
    """A trained run restored for inference: `xc.load(run_dir).predict(texts_or_rows, k=10)`.

    Imported lazily (torch, the data layer) so that `import xc` stays cheap; see `xc.predictor.TrainedModel`,
    and `xc.ensemble_serving.EnsembleModel` for an ensemble run (RUN_DIR/ensemble.json).
    """
    from pathlib import Path

    from xc.predictor import TrainedModel

    if (Path(run_dir) / "ensemble.json").exists():
        if checkpoint is not None:
            from xc.errors import XCError

            raise XCError(f"{run_dir} is an ensemble: each member has its own checkpoints; load one member with "
                          f"xc.load('{Path(run_dir) / 'members' / 'm0'}', checkpoint=...)")
        from xc.ensemble_serving import EnsembleModel

        return EnsembleModel(run_dir, device=device, batch_size=batch_size)

    return TrainedModel(run_dir, checkpoint, device=device, batch_size=batch_size)
