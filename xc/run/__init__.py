"""The life of a run directory: who may write it (`lock`, `guard`, `identity`), how it survives faults (`signals`,
`heartbeat`; the tests inject them with xc/faults.py), what it keeps (`checkpoint`, `resume`) and what it says (`runlog`).

Imports only config, errors, file helpers and torch; never the trainer, the models or the data layer. Submodules
are imported by name (`from xc.run import checkpoint`); this package imports none of them itself.
"""
