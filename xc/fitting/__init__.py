"""What is fitted after training, on the training points and the validation split: the label prior
(`label_prior`), the kNN vote (`knn`, searched by `split_search` at millions of points), the lexical ranker
(`ranker`, solved by `lbfgs`) and the kNN fusion that combines them with the model (`fusion`; `memory`: one
evaluator for a model, an ensemble or a dual run).

Built on evaluation (xc/eval/: metrics, encoding and exact sharded top-k), ANN search, the data layer and
collectives; never training, the refresh path, ensembles or serving, which all build on it
(import contracts: pyproject.toml). Submodules are imported by name; this package imports none of them itself.
"""
