import os

import pytest
import torch
from safetensors.torch import load_file

from hf_dist.checkpoint.conversion.convert import convert
from tests.unit.checkpoint.fakes import make_autotp_checkpoint, make_zero_checkpoint


def load_folder(path):
    state = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            state.update(load_file(path / name))
    return state


@pytest.mark.parametrize(("stage", "world_size"), [(1, 2), (2, 3), (3, 2), (3, 3)])
def test_fp32_masters_are_reassembled_exactly(tmp_path, tiny_state, stage, world_size):
    config, state = tiny_state
    make_zero_checkpoint(tmp_path / "ckpt", config, state, stage=stage, world_size=world_size, num_groups=2)
    report = convert(tmp_path / "ckpt", tmp_path / "out", dtype="fp32", max_shard_size="20KB", progress=False)
    assert report.source.stage == stage and report.source.world_size == world_size
    out = load_folder(tmp_path / "out")
    assert set(out) == set(state)
    for name, tensor in state.items():
        assert torch.equal(out[name], tensor), name
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()


def test_auto_dtype_is_the_training_dtype_cast_from_masters(tmp_path, tiny_state):
    config, state = tiny_state
    make_zero_checkpoint(tmp_path / "ckpt", config, state, stage=3, bf16=True)
    report = convert(tmp_path / "ckpt", tmp_path / "out", progress=False)
    out = load_folder(tmp_path / "out")
    assert report.dtype == "bfloat16"
    assert all(torch.equal(out[n], t.to(torch.bfloat16)) for n, t in state.items())


def test_missing_rank_file(tmp_path, tiny_state):
    config, state = tiny_state
    tag = make_zero_checkpoint(tmp_path / "ckpt", config, state, stage=2, world_size=3)
    (tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(
        ValueError, match=r"saved by 3 ranks but has optimizer files for ranks \[0, 2\]; missing rank\(s\) \[1\]"
    ):
        convert(tmp_path / "ckpt", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_mixed_world_sizes(tmp_path, tiny_state):
    config, state = tiny_state
    make_zero_checkpoint(tmp_path / "ckpt", config, state, stage=3, world_size=3)
    make_zero_checkpoint(tmp_path / "ckpt", config, state, stage=3, world_size=2)  # newer save, same tag
    with pytest.raises(ValueError, match=r"unexpected rank\(s\) \[2\] \(files from a run with another world size"):
        convert(tmp_path / "ckpt", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_truncated_rank_file_names_the_file_and_leaves_no_dst(tmp_path, tiny_state):
    config, state = tiny_state
    tag = make_zero_checkpoint(tmp_path / "ckpt", config, state, stage=3)
    victim = tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:2000])
    with pytest.raises(RuntimeError, match=r"bf16_zero_pp_rank_1_mp_rank_00_optim_states\.pt.*truncated or corrupt"):
        convert(tmp_path / "ckpt", tmp_path / "out", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_shared_params_are_written_once_and_load_tied(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.unit.checkpoint.fakes import tiny_model_state

    config, state = tiny_model_state(tied=True)
    make_zero_checkpoint(tmp_path / "ckpt", config, state, stage=3, bf16=False,
                         shared={"lm_head.weight": "model.embed_tokens.weight"})  # fmt: skip
    convert(tmp_path / "ckpt", tmp_path / "out", progress=False)
    assert "lm_head.weight" not in load_folder(tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"])


@pytest.mark.parametrize("world_size", [1, 2])
def test_autotp_ranks_are_merged_by_their_recorded_split(tmp_path, tiny_state, world_size):
    """An AutoTP checkpoint (one ZeRO-2 checkpoint per TP rank, mp_rank_00/01): column-parallel tensors are joined on
    dim 0 (the 67-row vocabulary splits 34 + 33), row-parallel ones on dim 1, replicated ones taken once."""
    config, state = tiny_state
    make_autotp_checkpoint(tmp_path / "ckpt", config, state, tp=2, world_size=world_size)
    report = convert(tmp_path / "ckpt", tmp_path / "out", dtype="fp32", progress=False)
    assert (report.source.tp_size, report.source.world_size) == (2, 2 * world_size)
    assert "AutoTP size 2" in report.summary()
    out = load_folder(tmp_path / "out")
    assert set(out) == set(state)
    for name, tensor in state.items():
        assert torch.equal(out[name], tensor), name


def test_autotp_without_its_split_rules_is_refused(tmp_path, tiny_state):
    config, state = tiny_state
    tag = make_autotp_checkpoint(tmp_path / "ckpt", config, state, tp=2)
    for m in range(2):
        path = tag / f"mp_rank_{m:02d}_model_states.pt"
        states = torch.load(path, weights_only=False)
        del states["universal_checkpoint_info"]
        torch.save(states, path)
    with pytest.raises(ValueError, match=r"does not record how AutoTP split its tensors.*trainer.save_model"):
        convert(tmp_path / "ckpt", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_autotp_rank_missing_its_optimizer_file_is_named(tmp_path, tiny_state):
    """One TP rank's optimizer file gone: the reader names it (it had merged rank 0 alone: '15 shape mismatches')."""
    config, state = tiny_state
    tag = make_autotp_checkpoint(tmp_path / "ckpt", config, state, tp=2)
    (missing,) = tag.glob("*zero_pp_rank_0_mp_rank_01_optim_states.pt")
    missing.unlink()
    with pytest.raises(
        ValueError, match=r"ranks \[1\] of tensor-parallel rank 1 \(mp_rank_01\); missing rank\(s\) \[0\]"
    ):
        convert(tmp_path / "ckpt", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_pipeline_parallel_checkpoints_are_refused(tmp_path, tiny_state):
    config, state = tiny_state
    tag = make_zero_checkpoint(tmp_path / "ckpt", config, state, stage=2)
    (tag / "layer_01-model_states.pt").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"pipeline-parallel DeepSpeed checkpoint .*ds_to_universal"):
        convert(tmp_path / "ckpt", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
