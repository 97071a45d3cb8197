"""The classifier mode, model.mode=classifier: an encoder and sharded classifier rows, ASTRA's Algorithm 1. `mode` is
the mode the Trainer conducts (`ClassifierMode`); `step` one micro-step's candidates and loss on this rank's label
range; `batches` micro-batches prepared on the host, optionally a step ahead; `device_batches` micro-batches
assembled on the training device, also with fixed shapes (`train.static_shapes`).
"""

from xc.train.modes.classifier.mode import ClassifierMode

__all__ = ["ClassifierMode"]
