"""A trained run restored for inference: the loaded model behind `xc.load` and `xc-predict` (`model`), and ANN
serving with its saved indexes (`ann`).

Built on the run directory's checkpoints (xc/run/), the component builder, evaluation (xc/eval/: exact sharded
top-k, kNN fusion, the label prior) and the ANN backends; training never imports it. Submodules are imported by
name; this package imports none of them itself.
"""
