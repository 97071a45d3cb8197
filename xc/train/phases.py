"""Per-phase timing of a training step (ASTRA Table 3), behind `train.profile_phases`.

Phases of one micro-step, in order:

* `data`: preparing the batch on the host: encoder inputs, positives and, for samplers that do not
  look at the current model, the negatives. With `train.prefetch` this is the time the step waits for
  the background thread, not the thread's own work.
* `h2d`: host-to-device copies of the inputs (and of prepared positives/candidates).
* `encoder_forward`: the encoder forward on this rank's slice, plus the all-gather of embeddings.
* `classifier_forward`: negative sampling (where it needs the model), candidate assembly, the row
  gather and the scores.
* `loss`, `backward`: the loss on the scores; autograd through scores, gather and encoder.
* `optimizer`: the non-finite check, the sparse row update and the encoder optimiser step.

On CUDA every boundary calls torch.cuda.synchronize so that a phase's kernels count towards it (this
costs throughput: profile separately from speed measurements); on the CPU it is plain perf_counter.
With profiling off the trainer holds a `NullTimer`, whose methods do nothing.
"""

from __future__ import annotations

import time

import torch

PHASES = ("data", "h2d", "encoder_forward", "classifier_forward", "loss", "backward", "optimizer")
# The dual (label-tower) mode's micro-step (xc/train/modes/dual/): batch rows and positives; the query tower and
# its all-gather; negatives (mining the label cache, uniform draws); the label tower on the step's unique
# labels, scores and loss; backward; the cache source's own update (the corrector's h); the optimisers.
DUAL_PHASES = ("data", "encoder_forward", "negatives", "label_forward_loss", "backward", "cache_update",
               "optimizer")


class PhaseTimer:
    """Sums of seconds per phase over a logging window of micro-steps."""

    enabled = True

    def __init__(self, device: torch.device, phases: tuple[str, ...] = PHASES):
        self.cuda = device.type == "cuda"
        self.device = device
        self.phases = phases
        self.sums = dict.fromkeys(phases, 0.0)
        self.steps = 0
        self._last = 0.0

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        """The micro-step begins: the next `mark` measures from here."""
        self._last = self._now()

    def mark(self, phase: str) -> None:
        """The phase `phase` ended now: add the time since the previous mark (or `start`) to it."""
        now = self._now()
        self.sums[phase] += now - self._last
        self._last = now

    def end_step(self) -> None:
        self.steps += 1

    def window(self) -> dict[str, float] | None:
        """Mean seconds per micro-step of each phase since the last call (None if no step ran); resets."""
        if not self.steps:
            return None
        out = {phase: total / self.steps for phase, total in self.sums.items()}
        self.sums = dict.fromkeys(self.phases, 0.0)
        self.steps = 0
        return out


class NullTimer:
    """Profiling off: nothing is measured or synchronised."""

    enabled = False

    def start(self) -> None:
        pass

    def mark(self, phase: str) -> None:
        pass

    def end_step(self) -> None:
        pass

    def window(self) -> None:
        return None


def make_timer(enabled: bool, device: torch.device, phases: tuple[str, ...] = PHASES) -> PhaseTimer | NullTimer:
    return PhaseTimer(device, phases) if enabled else NullTimer()
