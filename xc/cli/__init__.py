"""The command-line entry points: `xc-train` (`train`), `xc-eval` (`evaluate`), `xc-predict` (`predict`) and
`xc-baseline` (`baseline`), with what they share (`entry`: config loading, one-line errors). `xc-data` and
`xc-miner` live with their packages (xc/data/cli.py, xc/miner/cli.py), which must stay importable alone.

Nothing in xc imports this package: it sits on top. Submodules are imported by name; this package imports none of
them itself.
"""
