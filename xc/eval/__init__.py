"""What a trained model scores and how it is judged: the metrics (`metrics`), the tf-idf kNN vote (`knn`), encoding
and exact sharded top-k (`inference`), kNN fusion (`fusion`, `memory`), the label prior (`label_prior`) and the epoch
kept on validation (`epoch_select`).

Imports config, errors, file helpers, the data layer, models, ANN search, collectives and the run directory's
checkpoints; never training, the refresh path, ensembles or serving, which all build on it
(tests/unit/test_import_rules.py). Submodules are imported by name; this package imports none of them itself.
"""
