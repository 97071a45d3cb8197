"""A trained run restored for inference: the loaded model behind `xc.load` and `xc-predict` (`model`), and ANN
serving with its saved indexes (`ann`), and the served model written as safetensors and JSON files that load
without unpickling anything (`export`, `xc-export`).

Built on the run directory's checkpoints (xc/run/), the component builder, evaluation (xc/eval/: exact sharded
top-k, kNN fusion, the label prior) and the ANN backends; training never imports it. Submodules are imported by
name; this package imports none of them itself.
"""
