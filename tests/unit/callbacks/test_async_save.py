"""async_save in one process under the real Trainer: the background-written checkpoint equals a synchronous one, the
marker waits for the writes, a failed write stops the run and leaves the checkpoint unresumable, and the refusals.
Two ranks, FSDP2 and a kill -9 during the write: tests/distributed/test_callbacks_fsdp.py, test_fault_tolerance.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_dist.callbacks import attach, default
from hf_dist.callbacks.resume import AsyncCheckpointCallback, CompleteCheckpointCallback
from hf_dist.checkpoint.formats.names import MANIFEST_NAME, WRITING_NAME
from hf_dist.checkpoint.lifecycle import async_save
from hf_dist.checkpoint.lifecycle.auto_resume import auto_resume
from hf_dist.checkpoint.lifecycle.manifest import is_complete
from hf_dist.checkpoint.lifecycle.proof import unproven_reasons

SAVE = dict(save_strategy="steps", save_steps=2, save_total_limit=3)


def trained(make_trainer, *, async_save: bool, **overrides):
    trainer = make_trainer(**{**SAVE, **overrides})
    attach(trainer, async_save=async_save)
    trainer.train()
    return trainer


def test_background_checkpoint_equals_the_synchronous_one(make_trainer, tmp_path):
    sync = trained(make_trainer, async_save=False, output_dir=str(tmp_path / "sync"))
    background = trained(make_trainer, async_save=True, output_dir=str(tmp_path / "async"))
    callback = next(c for c in background.callback_handler.callbacks if isinstance(c, AsyncCheckpointCallback))
    assert len(callback.stalls) == 2 and callback.writer is None  # two saves; the writer closed at train end
    for step in (2, 4):
        want, got = (
            Path(sync.args.output_dir, f"checkpoint-{step}"),
            Path(background.args.output_dir, f"checkpoint-{step}"),
        )
        assert is_complete(got) and not (got / WRITING_NAME).exists()
        assert sorted(json.loads((got / MANIFEST_NAME).read_text())["files"]) == sorted(
            json.loads((want / MANIFEST_NAME).read_text())["files"]
        )
        a, b = load_file(want / "model.safetensors"), load_file(got / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        opt_a, opt_b = (torch.load(d / "optimizer.pt", weights_only=True) for d in (want, got))
        for pid, state in opt_a["state"].items():
            assert all(torch.equal(state[k], opt_b["state"][pid][k]) for k in state)
        assert not list(got.glob(".*.tmp"))  # every file renamed into place whole


def test_the_staged_copy_is_the_saved_steps_state(tmp_path):
    """Staging copies: a parameter changed right after the save (the next optimizer step) does not reach the file."""
    model = torch.nn.Linear(4, 4)
    writer = async_save.BackgroundWriter()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with writer.intercept():
        torch.save(model.state_dict(), tmp_path / "w.pt")
    with torch.no_grad():
        model.weight.add_(1.0)
    assert writer.wait() is None
    got = torch.load(tmp_path / "w.pt", weights_only=True)
    assert all(torch.equal(got[k], want[k]) for k in want)
    writer.close()


def test_a_failed_background_write_stops_the_run_and_leaves_the_checkpoint_unresumable(make_trainer, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(async_save, "_write_atomically", disk_full)
    trainer = make_trainer(**SAVE)
    attach(trainer, async_save=True)
    with pytest.raises(
        async_save.AsyncSaveError, match=r"(?s)checkpoint-2 failed:\n  - rank 0: OSError.*No space left"
    ):
        trainer.train()
    checkpoint = Path(trainer.args.output_dir, "checkpoint-2")
    assert not (checkpoint / MANIFEST_NAME).exists() and (checkpoint / WRITING_NAME).exists()
    assert "a save was writing into this folder and did not finish" in unproven_reasons(checkpoint, 1)[0]
    with pytest.raises(RuntimeError, match="none can be proven complete"):
        auto_resume(trainer.args.output_dir)


def test_deepspeed_saves_synchronously_and_says_so_once(make_trainer, monkeypatch, caplog):
    trainer = make_trainer()
    (callback,) = attach(trainer, [AsyncCheckpointCallback()])
    monkeypatch.setattr("hf_dist.runtime.dist.live_strategy", lambda args=None: "zero2")
    with caplog.at_level(logging.WARNING):
        callback.on_train_begin(trainer.args, trainer.state, trainer.control, model=trainer.model)
    assert callback.writer is None
    assert [r.getMessage() for r in caplog.records if "async_save" in r.getMessage()] == [
        "hf_dist: async_save does not apply to DeepSpeed (its engine writes the checkpoint itself, "
        "engine.save_checkpoint): checkpoints are saved synchronously"
    ]


def test_async_save_needs_the_trainer(make_trainer):
    with pytest.raises(ValueError, match=r"attach\(trainer, async_save=True\)"):
        make_trainer(callbacks=[AsyncCheckpointCallback()])
    with pytest.raises(ValueError, match="add AsyncCheckpointCallback"):
        attach(make_trainer(), [CompleteCheckpointCallback()], async_save=True)
    kinds = [type(c) for c in default(async_save=True)]
    assert AsyncCheckpointCallback in kinds and CompleteCheckpointCallback not in kinds


def test_staging_is_counted_before_the_optimizer_state_exists():
    """Adam's moments are created at the first step: the estimate before it equals what is staged after it."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    before = async_save.staging_bytes(model, optimizer, writes_weights=True)
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    steps = 4 * len(optimizer.state)  # AdamW's fp32 step counter per parameter
    assert async_save.staging_bytes(model, optimizer, writes_weights=True) == before + steps
    assert async_save.staging_bytes(model, optimizer, writes_weights=False) == 0  # a DDP rank that writes no weights


def test_staging_that_does_not_fit_the_node_is_refused():
    gib = 1024**3
    refusal = async_save.staging_refusal([("n0", 30 * gib, 40 * gib), ("n0", 30 * gib, 40 * gib), ("n1", 1, 40 * gib)])
    assert refusal.startswith(
        "async_save stages each checkpoint in host memory before writing it: 60.00 GiB on host n0 (ranks 0, 1: "
        "their weights and optimizer state), but only 40.00 GiB is available there.\n"
    )
    assert "Train without async_save" in refusal
    assert async_save.staging_refusal([("n0", 30 * gib, 40 * gib), ("n1", 30 * gib, 40 * gib)]) is None


def test_staging_refusal_comes_before_the_first_step(make_trainer, monkeypatch):
    import psutil

    class Tiny:
        available = 1024

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tiny)
    trainer = make_trainer(**SAVE)
    attach(trainer, async_save=True)
    with pytest.raises(ValueError, match="only 0.00 GiB is available"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_a_second_train_call_brackets_each_save_once(make_trainer):
    trainer = make_trainer(**SAVE)
    (callback,) = [c for c in attach(trainer, async_save=True) if isinstance(c, AsyncCheckpointCallback)]
    trainer.train()
    trainer.train()
    assert "_save_checkpoint" not in vars(trainer) and len(callback.stalls) == 4 and len(callback.written_s) == 4
    assert all(is_complete(Path(trainer.args.output_dir, f"checkpoint-{s}")) for s in (2, 4))
