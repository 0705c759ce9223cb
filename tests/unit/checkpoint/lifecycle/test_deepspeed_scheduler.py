"""A ZeRO checkpoint of a run whose DeepSpeed config names its own LR scheduler has no ``scheduler.pt``: the Trainer
writes one only for its own scheduler (transformers' ``_save_scheduler``), and DeepSpeed keeps its scheduler's state in
the model-states file (``lr_scheduler``). The proof of a checkpoint without a manifest took the missing file for an
incomplete save (issue 38, leftovers). tests/distributed/test_callbacks_deepspeed.py proves the files a real Trainer
writes under such a config."""

from __future__ import annotations

import json

import torch

from hf_dist.checkpoint.lifecycle.proof import unproven_reasons
from tests.unit.checkpoint.fakes import make_zero_checkpoint

MISSING = "scheduler.pt is missing (the LR schedule would restart)"


def _zero2(root, tiny_state, step, lr_scheduler=None):
    """A Trainer checkpoint-<step> of ZeRO-2 on 2 ranks, without scheduler.pt and without a manifest."""
    config, state = tiny_state
    ckpt = root / f"checkpoint-{step}"
    make_zero_checkpoint(ckpt, config, state, stage=2, tag=f"global_step{step}", lr_scheduler=lr_scheduler)
    for rank in range(2):
        torch.save({"python": None}, ckpt / f"rng_state_{rank}.pth")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return ckpt


def test_deepspeeds_own_scheduler_state_stands_for_scheduler_pt(tmp_path, tiny_state):
    ckpt = _zero2(tmp_path, tiny_state, 4, lr_scheduler={"last_batch_iteration": 3})
    assert not (ckpt / "scheduler.pt").exists()
    assert unproven_reasons(ckpt, 2) == []


def test_without_either_the_lost_schedule_is_named(tmp_path, tiny_state):
    ckpt = _zero2(tmp_path, tiny_state, 4)  # the Trainer's scheduler ran, and its scheduler.pt is gone
    assert unproven_reasons(ckpt, 2) == [MISSING]
    torch.save({"last_epoch": 4}, ckpt / "scheduler.pt")
    assert unproven_reasons(ckpt, 2) == []  # control


def test_a_damaged_model_states_file_is_named_not_taken_for_a_schedule(tmp_path, tiny_state):
    ckpt = _zero2(tmp_path, tiny_state, 4, lr_scheduler={"last_batch_iteration": 3})
    model_states = ckpt / "global_step4" / "mp_rank_00_model_states.pt"
    model_states.write_bytes(model_states.read_bytes()[:100])
    reasons = unproven_reasons(ckpt, 2)
    assert MISSING in reasons and any("mp_rank_00_model_states.pt" in r for r in reasons), reasons
