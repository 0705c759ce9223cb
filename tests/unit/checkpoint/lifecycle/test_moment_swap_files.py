"""ZeRO-Infinity moment swap files (``exp_avg-<ds_id>.tensor.swp``, ``exp_avg_sq-...``) are checked for presence and
length like the master ones (issue 38, leftovers): a truncated one in a checkpoint without a manifest made
``auto_resume`` accept it and the rank die with SIGABRT in DeepSpeed's aio reader. Here it is skipped, named."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch

from hf_dist.checkpoint.lifecycle.auto_resume import auto_resume
from hf_dist.checkpoint.lifecycle.proof import unproven_reasons
from hf_dist.checkpoint.safety.paths import PathEscapeError
from tests.unit.checkpoint.fakes import make_zero_checkpoint

DS_ID = "0_7"


def _zero_infinity(root, tiny_state, step, *, keys=("exp_avg", "exp_avg_sq")):
    """A Trainer checkpoint-<step> of ZeRO-3 on 2 ranks whose sub-group 0 was swapped to NVMe: its master partition
    and Adam moments in ``offloaded_tensors/rankNN/`` (as DeepSpeed copies them), placeholders in the optimizer file."""
    config, state = tiny_state
    ckpt = root / f"checkpoint-{step}"
    tag = make_zero_checkpoint(ckpt, config, state, stage=3, tag=f"global_step{step}")
    for rank in range(2):
        torch.save({"python": None}, ckpt / f"rng_state_{rank}.pth")
        path = tag / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        saved = torch.load(path, weights_only=True)
        optim = saved["optimizer_state_dict"]
        flat, swapped = optim["fp32_flat_groups"][0], torch.empty(0)
        swapped.ds_id = DS_ID
        optim["fp32_flat_groups"][0] = swapped
        moments = {key: torch.empty(0) for key in keys}
        optim["optimizer_state_dict"] = {"state": {0: {"step": torch.tensor(3.0), **moments}},
                                         "param_groups": [{"lr": 1e-3}]}  # fmt: skip
        torch.save(saved, path)
        swap = tag / "offloaded_tensors" / f"rank{rank:02d}"
        swap.mkdir(parents=True)
        flat.numpy().tofile(swap / f"{DS_ID}.tensor.swp")
        for key in keys:
            torch.full_like(flat, 0.1).numpy().tofile(swap / f"{key}-{DS_ID}.tensor.swp")
    torch.save({"last_epoch": step}, ckpt / "scheduler.pt")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return ckpt, tag


def test_a_clean_zero_infinity_checkpoint_is_proven(tmp_path, tiny_state):
    ckpt, _ = _zero_infinity(tmp_path, tiny_state, 4)
    assert unproven_reasons(ckpt, 2) == []  # control: the fake is what the proof accepts


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_moment_swap_file_is_named_and_the_older_checkpoint_resumed(key, damage, tmp_path, tiny_state,
                                                                              caplog):  # fmt: skip
    _zero_infinity(tmp_path, tiny_state, 2)
    ckpt, tag = _zero_infinity(tmp_path, tiny_state, 4)
    moment = tag / "offloaded_tensors" / "rank01" / f"{key}-{DS_ID}.tensor.swp"
    if damage == "truncated":
        moment.write_bytes(moment.read_bytes()[: moment.stat().st_size // 2])
    else:
        moment.unlink()
    said = "less than sub-group 0's fp32" if damage == "truncated" else "is missing: copy the complete checkpoint"
    reasons = " ".join(unproven_reasons(ckpt, 2))
    assert str(moment) in reasons and said in reasons, reasons
    with caplog.at_level(logging.WARNING):
        assert auto_resume(tmp_path, announce=False) == str(tmp_path / "checkpoint-2")
    assert str(moment) in caplog.text


def test_a_moment_name_leading_out_is_refused(tmp_path, tiny_state):
    """The moment's name is built from a key unpickled from the optimizer file: confined like ``ds_id`` (the proof
    names the refusal as the checkpoint's reason; nothing outside is opened)."""
    ckpt, _ = _zero_infinity(tmp_path, tiny_state, 4, keys=("../../../../x",))
    reasons = " ".join(unproven_reasons(ckpt, 2))
    assert re.search(r"optim_states.pt names '.*\.\./x-0_7.tensor.swp', which leaves", reasons), reasons
    with pytest.raises(PathEscapeError, match="which leaves"):
        from hf_dist.checkpoint.formats.checkpoint_folder import open_checkpoint
        from hf_dist.checkpoint.formats.deepspeed import DeepSpeedReader

        DeepSpeedReader(open_checkpoint(ckpt)).check_swap_files()
