"""Overhead of hf_dist's default callbacks against a bare Trainer on the same tiny run.

    python benchmarks/callback_overhead.py                     # 1 CPU process, ~2 minutes
    python benchmarks/callback_overhead.py --logging-steps 10 --no-nan-skip

Two figures:

Times are the training thread's CPU time by default (``--clock wall`` for wall time): on a shared
machine wall time mostly measures the neighbours.

1. Direct: the time spent inside hf_dist's callback methods and the token-counting forward
   hook, divided by the run's optimizer steps, over the step time. Robust on a busy machine.
2. A/B: a bare ``Trainer`` and the same Trainer with ``hf_dist.callbacks.attach(trainer)``
   (complete checkpoints, NaN guard, throughput, memory, reshard repair), ``--repeats`` times each
   in A B B A order; step time = mean of the fastest half of the steps (between consecutive
   ``on_step_end``, first 5 dropped), since interference only ever adds time; the median over runs.
   Catches costs outside the callback methods. (Plain alternation A B A B with median step times
   read +9.7 % on an idle machine — the second run of each pair was slower whichever it was.)

Logging every step is the worst case: memory and throughput work on logging steps only; the NaN
guard's gradient check and the token-counting hook run every step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


# CPU time of the training thread (torch runs ops on it with OMP_NUM_THREADS=1): unlike wall time it
# is not inflated when other processes share the cores. --clock wall switches to wall time.
CLOCK = time.thread_time


def _timed(fn, bucket: list[float]):
    def wrapper(*args, **kwargs):
        start = CLOCK()
        try:
            return fn(*args, **kwargs)
        finally:
            bucket.append(CLOCK() - start)

    return wrapper


def _instrument(callbacks: list, buckets: dict[str, list[float]]) -> None:
    """Time every event method and forward hook of ``callbacks``, one bucket per callback class."""
    for cb in callbacks:
        bucket = buckets.setdefault(type(cb).__name__, [])
        for name in dir(cb):
            if name.startswith("on_") and callable(getattr(cb, name)):
                setattr(cb, name, _timed(getattr(cb, name), bucket))
        if hasattr(cb, "_hook"):
            cb._hook = _timed(cb._hook, bucket)


def step_seconds(opts: argparse.Namespace, with_callbacks: bool) -> tuple[float, dict[str, float]]:
    """(step seconds: mean of the fastest half of the steps after the 5th, seconds per step inside each callback)."""
    import torch
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from hf_dist.callbacks import attach
    from hf_dist.testing import TokenDataset, tiny_llama_config

    times: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times.append(CLOCK())

    torch.manual_seed(0)
    config = tiny_llama_config(
        hidden_size=opts.hidden, intermediate_size=opts.hidden * 2, num_hidden_layers=opts.layers
    )
    args = TrainingArguments(
        output_dir=opts.output_dir,
        max_steps=opts.steps,
        per_device_train_batch_size=opts.batch,
        logging_steps=opts.logging_steps,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    data = TokenDataset(opts.steps * opts.batch, opts.seq, config.vocab_size, seed=0)
    trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=data, callbacks=[StepClock()])
    inside: dict[str, list[float]] = {}
    if with_callbacks:
        _instrument(attach(trainer, default(nan_skip=opts.nan_skip)), inside)
    trainer.train()
    deltas = sorted(b - a for a, b in zip(times[5:], times[6:], strict=False))
    # the mean of the fastest half: interference from other processes only ever adds time
    return statistics.fmean(deltas[: max(1, len(deltas) // 2)]), {k: sum(v) / opts.steps for k, v in inside.items()}


def default(*, nan_skip: bool) -> list:
    from hf_dist.callbacks import default as hf_default
    from hf_dist.callbacks.nan_guard import NanGuardCallback

    return [NanGuardCallback(skip=nan_skip) if isinstance(c, NanGuardCallback) else c for c in hf_default()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--logging-steps", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-dir", default="/tmp/hf_dist_callback_overhead")
    parser.add_argument("--clock", choices=["thread", "wall"], default="thread")
    parser.add_argument("--no-nan-skip", dest="nan_skip", action="store_false", help="NanGuardCallback(skip=False)")
    opts = parser.parse_args()
    global CLOCK
    CLOCK = time.thread_time if opts.clock == "thread" else time.perf_counter

    import transformers

    transformers.logging.set_verbosity_error()
    # The console printer would dominate a tiny step; both variants drop it.
    from transformers import trainer_callback

    trainer_callback.PrinterCallback.on_log = lambda self, *a, **k: None
    bare, hooked, inside = [], [], []
    for i in range(opts.repeats):  # A B B A ...: drifts in machine state hit both sides alike
        for with_callbacks in (False, True) if i % 2 == 0 else (True, False):
            step, costs = step_seconds(opts, with_callbacks=with_callbacks)
            (hooked if with_callbacks else bare).append(step)
            if with_callbacks:
                inside.append(costs)
    b, h = statistics.median(bare), statistics.median(hooked)
    per_callback = {k: statistics.median(run[k] for run in inside) for k in inside[0]}
    c = sum(per_callback.values())
    print(
        f"setup: hidden {opts.hidden}, {opts.layers} layers, batch {opts.batch} x seq {opts.seq}, logging every {opts.logging_steps} step(s)"
    )
    print(f"direct: {c * 1e3:.3f} ms/step inside hf_dist callbacks = {100 * c / h:.2f}% of a {h * 1e3:.2f} ms step")
    for name, cost in sorted(per_callback.items(), key=lambda kv: -kv[1]):
        print(f"          {name:28s} {cost * 1e3:7.3f} ms/step  {100 * cost / h:5.2f}%")
    print(
        f"A/B   : bare {b * 1e3:.2f} ms/step (runs {', '.join(f'{x * 1e3:.2f}' for x in bare)}), "
        f"with callbacks {h * 1e3:.2f} ms/step (runs {', '.join(f'{x * 1e3:.2f}' for x in hooked)}): "
        f"{100 * (h - b) / b:+.2f}%"
    )


if __name__ == "__main__":
    main()
