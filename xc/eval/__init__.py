"""How a trained model scores and how it is judged: the metrics (`metrics`), encoding and exact sharded top-k
(`inference`) and the epoch kept on validation (`epoch_select`).

Imports config, errors, file helpers, the data layer, models, ANN search, collectives and the run directory's
checkpoints; never what is fitted after training (xc/fitting/), training, the refresh path, ensembles or serving,
which all build on it (import contracts: pyproject.toml). Submodules are imported by name; this package imports none
of them itself.
"""
