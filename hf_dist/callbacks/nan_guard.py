"""NanGuardCallback: skip updates with non-finite gradients; stop after ``patience`` such steps in a row."""

from __future__ import annotations

import logging
import math
from typing import Any

from transformers import TrainerCallback

logger = logging.getLogger(__name__)

ADVICE = (
    "what to try: lower the learning rate or add warmup; use bf16 instead of fp16 (fp16 overflows above 65504); "
    "keep gradient clipping on (max_grad_norm=1.0); look for empty, all-padding or label=-100-only batches "
    "and bad tokens in the data around these steps"
)


def grads_finite(model: Any) -> bool | None:
    """False when any local gradient has a NaN/Inf; None when the model holds no gradients (DeepSpeed)."""
    import torch

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return None
    # FSDP2 gradients are DTensors; the local shard is enough: with clipping on, a non-finite
    # global norm turns every shard non-finite.
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    norms = torch._foreach_norm(local)
    return bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return True


class NanGuardCallback(TrainerCallback):
    """Guards against non-finite loss / gradients.

    "Skip" means: just before ``optimizer.step()`` (``on_pre_optimizer_step``) the gradients are
    checked; when one is NaN/Inf every ``param.grad`` is set to ``None``, so torch optimizers leave
    the weights *and* their moments untouched for that step (the LR schedule still advances).
    Under DeepSpeed the engine owns the gradients: its fp16 loss scaler already skips overflow
    steps, and this callback counts non-finite ``loss``/``grad_norm`` from the logs instead.
    After ``patience`` consecutive non-finite steps training stops with a message naming the
    steps and what to try; ``self.bad_steps`` lists every step that was non-finite.

    Cost: with ``skip=True`` one read pass over the gradients per step (like ``clip_grad_norm_``).
    ``skip=False`` pays nothing per step and watches the logged ``loss``/``grad_norm`` only, so
    patience then counts logging steps (use ``logging_steps=1`` for step granularity).
    """

    def __init__(self, patience: int = 3, *, skip: bool = True) -> None:
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(
                f"patience must be an int >= 1 (consecutive non-finite steps before stopping), got {patience!r}"
            )
        self.patience = patience
        self.skip = skip
        self.bad_steps: list[int] = []
        self.skipped_steps: list[int] = []
        self.stopped_at: int | None = None
        self._consecutive = 0
        self._grads_finite: bool | None = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is None or not self.skip:
            return  # without skipping, the logged loss/grad_norm suffice and no gradient pass is paid
        finite = self._grads_finite = grads_finite(model)
        if finite is False and self.skip:
            for p in model.parameters():
                p.grad = None
            self.skipped_steps.append(state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs):
        if self._grads_finite is not None:
            self._record(state, control, bad=not self._grads_finite)
        self._grads_finite = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        # Under DeepSpeed (no .grad) the logged loss and grad_norm are the only signal.
        if logs and "loss" in logs:
            bad = not (_finite(logs["loss"]) and _finite(logs.get("grad_norm", 0.0)))
            if bad or not self.bad_steps or self.bad_steps[-1] != state.global_step:
                self._record(state, control, bad=bad)

    def _record(self, state, control, *, bad: bool) -> None:
        step = state.global_step
        if not bad:
            self._consecutive = 0
            return
        if self.bad_steps and self.bad_steps[-1] == step:
            return
        self.bad_steps.append(step)
        self._consecutive += 1
        if state.is_world_process_zero:
            action = "update skipped" if self.skip and step in self.skipped_steps else "update applied"
            logger.warning("hf_dist NanGuard: non-finite loss or gradient at step %d (%s)", step, action)
        if self._consecutive >= self.patience and self.stopped_at is None:
            first = step - self._consecutive + 1
            self.stopped_at = step
            control.should_training_stop = True
            logger.error(
                "hf_dist NanGuard: stopping training: steps %d..%d (%d in a row, patience %d) had a non-finite loss "
                "or gradient; %s",
                first,
                step,
                self._consecutive,
                self.patience,
                ADVICE,
            )
