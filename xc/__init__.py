"""xc: distributed extreme-classification training with asynchronous ANNS refresh of hard negatives."""

__version__ = "0.1.0"


def load(run_dir, checkpoint=None, device: str = "cpu", batch_size: int | None = None):
    """A trained run restored for inference: `xc.load(run_dir).predict(texts_or_rows, k=10)`.

    Imported lazily (torch, the data layer) so that `import xc` stays cheap; see `xc.predictor.TrainedModel`.
    """
    from xc.predictor import TrainedModel

    return TrainedModel(run_dir, checkpoint, device=device, batch_size=batch_size)
