"""Ensembles of M models with different seeds: the member rule, their folds, their training and the ensemble's
validation choices (`members`). The ensemble served as one model is xc/serve/ensemble.py; the members' averaged
probabilities are fused once with the kNN vote by xc/fitting/memory.py.

Built on training (each member is a run of its own), evaluation (xc/eval/), fitting (xc/fitting/) and serving
(xc/serve/, which restores the members); only the command line and the facade import it. Submodules are imported by
name; this package imports none of them itself.
"""
