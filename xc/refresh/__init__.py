"""The hard-negative refresh on the trainer's side: when to refresh (`schedule`), the classifier snapshots handed out
(`snapshots`, written by `writer`), the mined negatives taken in and their staleness (`negatives`), and the re-ranking
of an asynchronous generation at the switch (`rerank`).

Built on the hand-off contract (xc/handoff.py) and the miner (xc/miner/), which never import it; evaluation
(xc/eval/) and what is fitted after training (xc/fitting/) never import it either. Submodules are imported by
name; this package imports none of them itself.
"""
