"""The dual-encoder (label-feature) mode, model.mode=dual: query and label towers over texts, negatives mined from
label-embedding caches. `mode` is the mode the Trainer conducts (`DualMode`); `step` one micro-step's candidates and
loss on this rank's label range; `memory` the kNN fusion after training (also what serving restores); `checkpoint`
loading its checkpoints, the label shards kept on any world size that divides their number.
"""

from xc.train.modes.dual.mode import DualMode

__all__ = ["DualMode"]
