"""Mixed precision for the encoder: which autocast dtype a run uses, and dynamic loss scaling for fp16.

`train.amp` picks the autocast dtype of the encoder forward (`QueryEncoder.autocast`): bf16 runs on
CPU and CUDA alike; fp16 only on CUDA, where its narrow exponent range needs loss scaling (gradients
of fp16 activations underflow otherwise). The encoder returns float32 embeddings either way, so scores,
losses, classifier rows and optimiser states stay float32 (or in the rows' own storage dtype).

`LossScaler` is a small dynamic loss scaler in place of torch.amp.GradScaler, because the classifier
rows are not an optimizer parameter and because the decision to skip a step must be the same on every
rank: the trainer's non-finite check, which all-reduces its flags, is what detects an overflow here.
Scaling by a power of two and unscaling is exact in float32 (barring overflow), so a run with a scaler
that never overflows gives bit-identical updates to one without.
"""

from __future__ import annotations

import logging

import torch

from xc.errors import ConfigError

log = logging.getLogger(__name__)

AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    """The encoder's autocast dtype for `train.amp` on `device`, or None for full precision."""
    if amp not in AMP_DTYPES:
        raise ConfigError("train.amp", f"{amp!r} is not one of {', '.join(AMP_DTYPES)}")
    dtype = AMP_DTYPES[amp]
    if dtype == torch.float16 and device.type != "cuda":
        raise ConfigError("train.amp", f"fp16 autocast needs a CUDA device (it relies on loss scaling and fp16 "
                          f"kernels); this run is on {device.type}. Use train.amp=bf16 or train.amp=none")
    return dtype


class LossScaler:
    """Dynamic loss scale: multiply the loss by `scale` before backward, divide the gradients after.

    On an overflow (non-finite gradients with a finite loss) the step is dropped and the scale halves;
    after `growth_interval` good optimizer steps in a row it doubles. Disabled, every method is a no-op
    and `scale` is 1.
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0 ** 16, growth_interval: int = 2000,
                 min_scale: float = 1.0):
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.good_steps = 0
        self.overflows = 0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The tensor to call backward on: loss * scale (loss itself when disabled)."""
        return loss * self.scale if self.enabled else loss

    def unscale_(self, grads: list[torch.Tensor]) -> None:
        """Divide gradients in place by the scale (exact: the scale is a power of two)."""
        if self.enabled and grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def unscale_params_(self, params) -> None:
        self.unscale_([p.grad for p in params if p.grad is not None])

    def overflow(self) -> None:
        """A step's gradients overflowed: halve the scale (never below `min_scale`)."""
        self.overflows += 1
        self.good_steps = 0
        self.scale = max(self.min_scale, self.scale / 2.0)
        log.info("fp16 gradient overflow: step skipped, loss scale now %g (%d overflows so far)",
                 self.scale, self.overflows)

    def step_done(self) -> None:
        """An optimizer step was applied: grow the scale after `growth_interval` of them in a row."""
        if not self.enabled:
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= 2.0
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        if self.enabled and state:
            self.scale = float(state["scale"])
            self.good_steps, self.overflows = int(state["good_steps"]), int(state["overflows"])
