"""The reliability probes that tools/probes/reliability_probes.py runs, split by concern:

- `common`: the outcomes and the classifier, running a command (read-only folders included), the @probe
  registry and the verdicts several rounds give;
- `fixtures`: the small runs' commands, hand-written data, and Ctx (the temporary root and the shared runs);
- one module of probes a round, the fourth in three: `round2_clean` (the 11 clean then), `round2_unclean` (the 7
  that were not), `round3`, `round4_records_fit`, `round4_exports` (exports, thresholds, `xc-data verify`) and
  `round4_storage` (storage errors, rough edges).

Each probe module registers its probes as it is imported; `load_probes` imports them in ROUNDS' order, the order
the probes run in and the table lists them.
"""

from __future__ import annotations

import importlib

from tools.probes.reliability.common import PROBES, Probe

ROUNDS = ("round2_clean", "round2_unclean", "round3", "round4_records_fit", "round4_exports", "round4_storage")


def load_probes() -> list[Probe]:
    """Every probe, the modules of ROUNDS imported in order (each registers its own once)."""
    for name in ROUNDS:
        importlib.import_module(f"{__name__}.{name}")
    return PROBES
