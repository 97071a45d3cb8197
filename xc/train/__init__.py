"""Training: the components built from the typed config (`components`), the one loop of both modes
(`trainer`), the modes it conducts (`modes/classifier/`: ASTRA's Algorithm 1, its micro-step and its batches
assembled on the host or the device; `modes/dual/`: the dual encoder's mode, step, kNN fusion and checkpoint
loading), the losses (`loss`), the optimisers (`optim`), mixed precision (`precision`), phase timing (`phases`),
the run lifecycle around the loop (`lifecycle`: checkpoints, signals, non-finite steps).

Built on the models, sampling, the refresh path, evaluation and the run directory; only the command line (xc/cli/),
serving (which restores a model with `components`) and ensembles import it. Submodules are imported by name; this
package imports none of them itself.
"""
