"""Ensembles of M models with different seeds: the member rule, their folds and training (`members`), and the ensemble served
as one model (`model`); the members' averaged probabilities are fused once with the kNN vote by xc/eval/memory.py.

Built on training (each member is a run of its own), evaluation (xc/eval/) and serving (xc/serve/); nothing below it
imports it. Submodules are imported by name; this package imports none of them itself.
"""
