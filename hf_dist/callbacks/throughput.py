"""ThroughputCallback: step time, tokens/s per rank and in total, MFU and scaling efficiency."""

from __future__ import annotations

import time
from typing import Any

from transformers import TrainerCallback

from hf_dist.callbacks import phases
from hf_dist.callbacks.extension import extend
from hf_dist.callbacks.memory import _add_to_logs
from hf_dist.callbacks.stragglers import Arrivals, hostnames, report, stragglers
from hf_dist.data.packing import real_tokens
from hf_dist.planning.flops import mfu, scaling_efficiency, training_flops_per_token
from hf_dist.runtime import dist as _dist


def _count_tokens(args: tuple, kwargs: dict) -> tuple[Any, int, int]:
    """(real tokens, computed token slots, sequence length) of one forward call: real tokens are the non-padding
    ones (:func:`hf_dist.data.real_tokens`, a 0-d tensor: no host sync per step), slots every ``input_ids`` entry
    (or of the first tensor argument)."""
    ids = kwargs.get("input_ids")
    if ids is None:
        ids = kwargs.get("inputs_embeds")
        ids = ids[..., 0] if ids is not None else (args[0] if args and hasattr(args[0], "numel") else None)
    if ids is None:
        return 0, 0, 0
    slots = int(ids.numel())
    real = real_tokens({**kwargs, "input_ids": ids}) if ids.dim() == 2 else slots
    return real, slots, int(ids.shape[-1]) if ids.dim() else 1


def flops_per_token_of(model: Any, seq_len: int, plan: Any = None) -> int | None:
    """Training FLOPs per token for ``model`` at ``seq_len`` (PaLM appendix B); None when unknown."""
    spec = getattr(plan, "model", None)
    if spec is not None and getattr(spec, "num_layers", 0):
        num_params, layers, hidden = spec.num_params, spec.num_layers, spec.hidden_size
        embedding, tied = spec.embedding_params, spec.tie_word_embeddings
    else:
        config = getattr(model, "config", None)
        layers = getattr(config, "num_hidden_layers", 0)
        hidden = getattr(config, "hidden_size", 0)
        if not layers or model is None:
            return None
        # Parameters are counted once even when shared (tied embeddings).
        params = {id(p): p for p in model.parameters()}.values()
        num_params = sum(_dist_numel(p) for p in params)
        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        embedding = _dist_numel(embed.weight) if embed is not None else 0
        tied = bool(getattr(config, "tie_word_embeddings", False))
    return training_flops_per_token(
        num_params=num_params,
        num_layers=layers,
        hidden_size=hidden,
        seq_len=seq_len,
        embedding_params=embedding,
        tie_word_embeddings=tied,
    )


def _dist_numel(p: Any) -> int:
    # DTensor.numel() is the global size, which is what the FLOPs formula wants; DeepSpeed ZeRO-3
    # leaves an empty local tensor and keeps the full size in ds_numel.
    return int(getattr(p, "ds_numel", 0) or p.numel())


class ThroughputCallback(TrainerCallback):
    """Adds ``perf/*`` keys at every logging step.

    - ``perf/step_time_s``: wall time per optimizer step since the previous log.
    - ``perf/tokens_per_s_rank_max|min`` and ``perf/tokens_per_s``: per rank and summed over ranks, the real
      (non-padding) tokens each rank's model received: the ones of a 2D ``attention_mask``, all but the padded
      tails of packed rows (:func:`hf_dist.data.real_tokens`).
    - ``perf/fill``: real tokens over the token slots computed (1.0 packed full, ~0.4 for padded chat data).
    - ``perf/mfu``: of the real tokens, when ``peak_tflops`` (dense, per device) is given or known from
      ``plan.hardware``.
    - ``perf/scaling_efficiency``: tokens/s / (world size * ``baseline_tokens_per_s``), the
      single-process figure measured on the same setup.
    - ``perf/eta_s``: seconds to ``max_steps`` at the speed measured since training began (the plan's estimate
      corrected by what runs), and ``perf/tokens_per_s_vs_plan``: token slots computed per second over the plan's
      estimate (which counts micro-batch x seq_len slots per step).
    - ``perf/straggler_rank_<r>_late_s``: a rank that arrives at its steps' forward later than the median rank by
      over 20 % of a step (:mod:`hf_dist.callbacks.stragglers`), in seconds per step, with one warning line naming
      rank and host. It rides on the same gather as the tokens/s: no extra collective per log. ``trainer``
      (:func:`hf_dist.callbacks.attach` passes it) times the outermost module, before the engine's own collectives.
      The step after a save, an evaluation or an export is left out (:mod:`hf_dist.callbacks.phases`).
    """

    def __init__(
        self,
        plan: Any = None,
        *,
        peak_tflops: float | None = None,
        baseline_tokens_per_s: float | None = None,
        trainer: Any = None,
    ):
        if peak_tflops is not None and peak_tflops <= 0:
            raise ValueError(f"peak_tflops must be > 0 (dense TFLOP/s of one device), got {peak_tflops}")
        hardware = getattr(plan, "hardware", None)
        self.plan = plan
        self.peak_tflops = peak_tflops or getattr(hardware, "peak_tflops", None)
        self.baseline_tokens_per_s = baseline_tokens_per_s
        self._tokens = 0  # real tokens since the last log (a tensor once counted)
        self._slots = 0  # token slots computed since the last log
        self._seq_len = 0
        self._fpt: dict[int, int | None] = {}
        self._handle = None
        self._model = None
        self._last_time = 0.0
        self._last_step = 0
        self._trained_s = 0.0  # wall time of the steps measured so far (the logging gathers left out)
        self._trained_steps = 0
        self.trainer = trainer
        self._arrivals = Arrivals()
        self._phases_seen = 0  # phases entered by the last step's end (phases.CLOCK.entered)
        self._hosts: list[str] = []
        self._arrival_handle = None

    def _hook(self, module, args, kwargs):
        if module.training:
            tokens, slots, seq_len = _count_tokens(args, kwargs)
            self._tokens += tokens
            self._slots += slots
            self._seq_len = seq_len or self._seq_len

    def _arrival_hook(self, module, args):
        self._arrivals.forward_called()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and self._handle is None:
            self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)
            self._model = model
        if self._arrival_handle is None:
            outer = getattr(self.trainer, "model_wrapped", None) or model  # DDP / DeepSpeed engine, or the model
            if outer is not None:  # first among its hooks: before FSDP2's own pre-forward all-gather
                self._arrival_handle = outer.register_forward_pre_hook(self._arrival_hook, prepend=True)
        extend(self.trainer or phases.running_trainer())  # its evaluations and saves are phases
        self._hosts = hostnames()
        self._phases_seen = phases.CLOCK.entered
        self._last_time = time.perf_counter()
        self._last_step = state.global_step

    def on_step_begin(self, args, state, control, **kwargs):
        self._arrivals.step_began()

    def on_step_end(self, args, state, control, **kwargs):
        # a save, evaluation or export since the last step's end: this step's arrivals say nothing of the ranks
        entered = phases.CLOCK.entered
        self._arrivals.step_ended(excused=entered != self._phases_seen)
        self._phases_seen = entered

    def on_train_end(self, args, state, control, **kwargs):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._arrival_handle is not None:
            self._arrival_handle.remove()
            self._arrival_handle = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs:
            return
        now = time.perf_counter()
        steps = max(state.global_step - self._last_step, 1)
        elapsed = max(now - self._last_time, 1e-9)
        arrival_sum, counted = self._arrivals.take()
        real, slots = float(self._tokens), float(self._slots)
        ranks = _dist.gather_floats([real / elapsed, arrival_sum, counted, slots / elapsed])  # one collective
        per_rank = [r[0] for r in ranks]
        total, computed = sum(per_rank), sum(r[3] for r in ranks)
        metrics = {
            "perf/step_time_s": round(elapsed / steps, 6),
            "perf/tokens_per_s": round(total, 2),
            "perf/tokens_per_s_rank_max": round(max(per_rank), 2),
            "perf/tokens_per_s_rank_min": round(min(per_rank), 2),
            "perf/fill": round(total / computed, 4) if computed else 0.0,
        }
        if self._seq_len and self._seq_len not in self._fpt:  # counting parameters is not free: once per length
            self._fpt[self._seq_len] = flops_per_token_of(self._model, self._seq_len, self.plan)
        fpt = self._fpt.get(self._seq_len)
        if fpt and self.peak_tflops:
            metrics["perf/mfu"] = round(mfu(total, fpt, self.peak_tflops * 1e12 * len(per_rank)), 5)
        if self.baseline_tokens_per_s:
            metrics["perf/scaling_efficiency"] = round(
                scaling_efficiency(total, len(per_rank), self.baseline_tokens_per_s), 4
            )
        metrics.update(self._eta(state, elapsed, steps, computed))
        late = stragglers([r[1] for r in ranks], _same_count([r[2] for r in ranks]), elapsed / steps)
        metrics.update(report(late, self._hosts, elapsed / steps, state.global_step))
        _add_to_logs(state, logs, metrics)
        self._tokens = self._slots = 0
        self._last_time = time.perf_counter()  # the gather above is not training time
        self._last_step = state.global_step

    def _eta(self, state, elapsed: float, steps: int, slots_per_s: float) -> dict[str, float]:
        """Time to ``max_steps`` at the mean step time measured so far, and the speed against the plan's (token
        slots computed: the plan's estimate counts micro-batch x seq_len per step)."""
        self._trained_s += elapsed
        self._trained_steps += steps
        out = {}
        if state.max_steps and state.max_steps > 0:
            remaining = max(state.max_steps - state.global_step, 0)
            out["perf/eta_s"] = round(remaining * self._trained_s / self._trained_steps, 1)
        planned = getattr(self.plan, "tokens_per_s", None)
        if planned:
            out["perf/tokens_per_s_vs_plan"] = round(slots_per_s / planned, 4)
        return out


def _same_count(counts: list[float]) -> int:
    """The steps every rank counted, or 0 when the ranks left out different steps (their sums do not compare)."""
    return int(counts[0]) if len(set(counts)) == 1 else 0
