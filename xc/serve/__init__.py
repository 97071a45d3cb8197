"""A trained run restored for inference: `xc.load` (`load`) over the loaded model behind `xc-predict` (`model`), an
ensemble run served as one model (`ensemble`), ANN serving with its saved indexes (`ann`), and the served model
written as safetensors and JSON files that load without unpickling anything (`export`, `xc-export`).

Built on the run directory's checkpoints (xc/run/), the component builder, evaluation (xc/eval/: exact sharded
top-k), what training fitted after it (xc/fitting/: kNN fusion, the lexical ranker, the label prior) and the ANN
backends; training never imports it, ensembles' training does (to evaluate their members). Submodules are imported
by name; this package imports none of them itself.
"""
