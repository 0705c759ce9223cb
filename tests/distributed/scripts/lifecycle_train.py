"""Tiny deterministic Trainer run used by the lifecycle tests (callbacks, auto-resume, kill -9 restarts).

    torchrun --nproc_per_node=2 --max-restarts=2 tests/distributed/scripts/lifecycle_train.py \
        --output-dir /tmp/run --max-steps 8 --save-steps 2 --kill 3:1 --kill-during-save 4:1

``--kill STEP:RANK`` SIGKILLs RANK at the end of optimizer step STEP, once per job (a marker file
in the output folder remembers it across restarts); ``--kill-during-save STEP:RANK`` does it in
the middle of checkpoint-STEP's save, after the model and optimizer files, before the RNG state.
``--packed`` trains on packed conversations and logs the conversation ids each step of each rank trained on.
``--hang STEP:RANK`` blocks RANK at STEP's start in the first attempt; ``--slow-save STEP:RANK:SECONDS`` and
``--slow-first-step SECONDS`` make a save and the first step after a resume slow, for the hang watchdog's phases.
Every attempt resumes with ``hf_dist.auto_resume`` and appends what it saw to ``attempts.jsonl``. It takes the
``--output_dir DIR --resume_from_checkpoint auto`` the SLURM scripts pass a recipe, so it runs as their ``SCRIPT``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import time
from pathlib import Path

import torch
from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import hf_dist
from hf_dist.callbacks import ExportCallback, HangWatchdogCallback, ProfilerCallback, attach, default
from hf_dist.runtime.bootstrap import init_distributed_for_restarts
from hf_dist.runtime.dist import shutdown
from hf_dist.testing import TokenDataset, tiny_llama_config

RANK = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def kill_once(out: Path, what: str, step: int) -> None:
    marker = out / f"killed_{what}_{step}"
    if marker.exists():
        return
    marker.write_text(str(ATTEMPT))
    os.kill(os.getpid(), signal.SIGKILL)


def parse_kill(text: str) -> tuple[int, int]:
    step, rank = text.split(":")
    return int(step), int(rank)


def parse_slow(text: str) -> tuple[int, int, float]:
    step, rank, seconds = text.split(":")
    return int(step), int(rank), float(seconds)


def parse_allowances(text: str) -> dict[str, float]:
    factor, min_limit_s, first_limit_s = map(float, text.split(","))
    return {"factor": factor, "min_limit_s": min_limit_s, "first_limit_s": first_limit_s}


class KillAtStep(TrainerCallback):
    def __init__(self, out: Path, points: list[tuple[int, int]]) -> None:
        self.out, self.points = out, points

    def on_step_end(self, args, state, control, **kwargs):
        for step, rank in self.points:
            if state.global_step == step and rank == RANK:
                kill_once(self.out, "step", step)


class SleepAtStepBegin(TrainerCallback):
    """A straggler: ``rank`` (None: every rank) sleeps ``seconds`` at the start of every micro-step (of ``at_step``;
    ``"first"``: of the first step after a resume)."""

    def __init__(self, rank: int | None, seconds: float, at_step: int | str | None = None) -> None:
        self.rank, self.seconds, self.at_step = rank, seconds, at_step
        self._first: int | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._first = state.global_step + 1 if state.global_step else None

    def on_step_begin(self, args, state, control, **kwargs):
        at_step = self._first if self.at_step == "first" else self.at_step
        if self.at_step == "first" and at_step is None:
            return
        if self.rank in (None, RANK) and at_step in (None, state.global_step + 1):
            time.sleep(self.seconds)


class KillDuringSaveTrainer(Trainer):
    kill_during_save: list[tuple[int, int]] = []

    slow_save: tuple[int, int, float] | None = None

    def _save_rng_state(self, output_dir):
        for step, rank in self.kill_during_save:
            if self.state.global_step == step and rank == RANK:
                kill_once(Path(self.args.output_dir), "save", step)
        if self.slow_save is not None and self.slow_save[:2] == (self.state.global_step, RANK):
            time.sleep(self.slow_save[2])  # inside the save (an async one: its staging), this rank only
        super()._save_rng_state(output_dir)


def slow_background_writes(seconds: float) -> None:
    """Every write queued by async_save's writer thread waits ``seconds`` first: a window to kill a rank in."""
    from hf_dist.checkpoint.lifecycle.async_save import BackgroundWriter

    submit = BackgroundWriter._submit

    def slow_submit(self, fn, *args, **kwargs):
        submit(self, time.sleep, seconds)
        submit(self, fn, *args, **kwargs)

    BackgroundWriter._submit = slow_submit


def packed_conversations() -> tuple[object, dict[tuple[int, ...], int]]:
    """100 random 'conversations' of 3-12 tokens packed into 16-token rows (hf_dist.data.pack): 8 steps of 2 ranks x 2
    rows take 32 of its 47 rows, all inside one epoch. Also the conversation id of each token tuple."""
    import random

    from datasets import Dataset

    from hf_dist.data import pack

    rng = random.Random(0)
    sequences = [[rng.randrange(256) for _ in range(rng.randint(3, 12))] for _ in range(100)]
    ids = {tuple(seq): i for i, seq in enumerate(sequences)}
    assert len(ids) == len(sequences)
    return pack(Dataset.from_list([{"input_ids": s, "labels": s} for s in sequences]), 16), ids


class ConversationLog(TrainerCallback):
    """Writes the conversation ids each optimizer step of this rank trained on (read from its packed rows) to
    ``conversations-rank<R>.jsonl``, with the attempt: what a resume must continue without repeating or skipping."""

    def __init__(self, out: Path, model, ids: dict[tuple[int, ...], int]) -> None:
        self.path, self.ids, self.seen = out / f"conversations-rank{RANK}.jsonl", ids, []
        model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        if module.training:
            for row, pos in zip(kwargs["input_ids"].tolist(), kwargs["position_ids"].tolist(), strict=True):
                starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
                pieces = (tuple(row[a:b]) for a, b in zip(starts, starts[1:], strict=False))
                self.seen += [self.ids[p] for p in pieces if p in self.ids]  # the padded tail is no conversation

    def on_step_end(self, args, state, control, **kwargs):
        with open(self.path, "a") as log:
            log.write(json.dumps({"attempt": ATTEMPT, "step": state.global_step, "ids": self.seen}) + "\n")
        self.seen = []


def main(argv: list[str] | None = None) -> None:
    """One Trainer run; the process group stays up (scripts/runs.py runs several in one launch)."""
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints where a hung rank is
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", "--output_dir", dest="output_dir", required=True)
    parser.add_argument(
        "--resume_from_checkpoint",
        choices=["auto"],
        help="what examples/slurm's scripts pass to the recipe; every attempt here resumes with auto_resume anyway",
    )
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--kill", action="append", default=[], type=parse_kill)
    parser.add_argument("--kill-during-save", action="append", default=[], type=parse_kill)
    parser.add_argument("--export", action="store_true", help="add ExportCallback(on_save=True)")
    parser.add_argument("--profile", action="store_true", help="add ProfilerCallback on steps 2..3 of every rank")
    parser.add_argument("--straggler", type=int, help="this rank sleeps 2 s at the start of every step")
    parser.add_argument(
        "--hang", type=parse_kill, help="STEP:RANK: in the first attempt, that rank blocks for 120 s at STEP's start"
    )
    parser.add_argument("--slow-save", type=parse_slow, help="STEP:RANK:SECONDS: that rank's save at STEP sleeps")
    parser.add_argument("--slow-first-step", type=float, help="every rank sleeps this long at a resume's first step")
    parser.add_argument("--async-save", action="store_true", help="attach the default callbacks with async_save=True")
    parser.add_argument("--slow-write", type=float, default=0.0, help="each background write first sleeps this long")
    parser.add_argument(
        "--no-average-tokens", action="store_true", help="average_tokens_across_devices=False (no sync before a step)"
    )
    parser.add_argument(
        "--watchdog",
        type=parse_allowances,
        help="FACTOR,MIN_LIMIT_S,FIRST_LIMIT_S: HangWatchdogCallback's allowances instead of the defaults",
    )
    parser.add_argument(
        "--packed", action="store_true", help="train on packed conversations; log which ones each step trained on"
    )
    strategy = parser.add_mutually_exclusive_group()
    strategy.add_argument(
        "--fsdp", action="store_true", help="FSDP2 full shard on CPU (hf_dist.runtime.cpu_fsdp), DCP checkpoints"
    )
    strategy.add_argument("--deepspeed", choices=["zero2", "zero3"], help="DeepSpeed ZeRO (fp32 on CPU)")
    parser.add_argument(
        "--ds-scheduler", action="store_true", help="DeepSpeed's own LR scheduler (WarmupLR in its config's scheduler)"
    )
    opts = parser.parse_args(argv)
    out = Path(opts.output_dir)
    init_distributed_for_restarts()  # before TrainingArguments, which would initialize it

    strategy_kwargs = {"use_cpu": True}
    if opts.deepspeed:
        from hf_dist.configs.deepspeed import deepspeed_config
        from hf_dist.runtime.cpu_fsdp import cpu_deepspeed_training_kwargs

        # accelerate drops DeepSpeed when use_cpu=True; the launcher sets ACCELERATE_USE_CPU=0 as well
        strategy_kwargs = {"deepspeed": deepspeed_config(opts.deepspeed, mixed_precision="no"), "use_cpu": False}
        if opts.ds_scheduler:  # the Trainer fills the "auto" values (transformers' HfTrainerDeepSpeedConfig)
            warmup = {"warmup_min_lr": 0, "warmup_max_lr": "auto", "warmup_num_steps": "auto"}
            strategy_kwargs["deepspeed"]["scheduler"] = {"type": "WarmupLR", "params": warmup}
        strategy_kwargs.update(cpu_deepspeed_training_kwargs())
    elif opts.fsdp:
        from hf_dist.configs.fsdp import fsdp_config
        from hf_dist.runtime.cpu_fsdp import enable_fsdp_on_cpu

        enable_fsdp_on_cpu()  # accelerate would otherwise drop FSDP on CPU and train plain DDP
        strategy_kwargs.update(
            fsdp_config("fsdp_full_shard", wrap_classes=["LlamaDecoderLayer"], mixed_precision="no")
        )

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    args = TrainingArguments(
        **strategy_kwargs,
        output_dir=str(out),
        max_steps=opts.max_steps,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_steps=opts.save_steps,
        save_total_limit=3,
        seed=0,
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
        average_tokens_across_devices=not opts.no_average_tokens,
    )
    KillDuringSaveTrainer.kill_during_save = opts.kill_during_save
    KillDuringSaveTrainer.slow_save = opts.slow_save
    dataset, collator = TokenDataset(), None
    if opts.packed:
        from hf_dist.data import PackedCollator

        dataset, conversation_ids = packed_conversations()
        collator = PackedCollator(16)
    trainer = KillDuringSaveTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    extra = [ExportCallback(on_save=True)] if opts.export else []
    extra += [ProfilerCallback(start_step=1, num_steps=2, ranks=(0, 1))] if opts.profile else []
    callbacks = default(async_save=opts.async_save) + extra
    if opts.slow_write:
        slow_background_writes(opts.slow_write)
    if opts.watchdog:
        callbacks = [c for c in callbacks if not isinstance(c, HangWatchdogCallback)]
        callbacks.append(HangWatchdogCallback(**opts.watchdog, gather_s=5))
    attach(trainer, callbacks)
    if opts.packed:
        trainer.add_callback(ConversationLog(out, model, conversation_ids))
    trainer.add_callback(KillAtStep(out, opts.kill))
    if opts.straggler is not None:
        trainer.add_callback(SleepAtStepBegin(opts.straggler, 2.0))
    if opts.hang is not None and ATTEMPT == 0:
        step, rank = opts.hang
        trainer.add_callback(SleepAtStepBegin(rank, 120.0, at_step=step))
    if opts.slow_first_step:
        trainer.add_callback(SleepAtStepBegin(None, opts.slow_first_step, at_step="first"))

    resume = hf_dist.auto_resume(out, strategy=trainer)
    if RANK == 0:
        out.mkdir(parents=True, exist_ok=True)
        seen = sorted(p.name for p in out.glob("checkpoint-*"))
        with open(out / "attempts.jsonl", "a") as log:
            log.write(json.dumps({"attempt": ATTEMPT, "resume": resume, "checkpoints": seen}) + "\n")
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(str(out / "final"))
    if RANK == 0:
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
        facts = {"model_class": type(trainer.model).__name__, "wrapped": type(trainer.model_wrapped).__name__}
        facts["save_stalls_s"] = next((c.stalls for c in callbacks if hasattr(c, "stalls")), None)
        if trainer.is_deepspeed_enabled:
            facts["zero_stage"] = trainer.model_wrapped.zero_optimization_stage()
        (out / "facts.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main()
    shutdown()
