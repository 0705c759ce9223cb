"""hf-dist convert / verify on REAL checkpoints written by 2 CPU ranks (DeepSpeed, the Trainer, FSDP2).

Each checkpoint is produced once per session (session fixtures); every test converts copies or
reads them. References are the trained weights consolidated by the engines themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_dist.checkpoint.conversion.convert import convert
from hf_dist.cli.main import main
from hf_dist.testing import cpu_has_onednn_fp16, torchrun

pytestmark = pytest.mark.distributed
SCRIPTS = Path(__file__).parent / "scripts"
DS_VARIANTS = {  # name -> (stage, training dtype, flags)
    "z1": "1:fp32",
    "z2": "2:bf16",
    "z2fp16": "2:fp16",
    "z3": "3:bf16",
    "z3tied": "3:fp32:tied",
    "z3lora": "3:bf16:lora",
}


@pytest.fixture(scope="session")
def ds_runs(tmp_path_factory) -> Path:
    """deepspeed.initialize + engine.save_checkpoint for every variant, in one 2-rank launch."""
    out = tmp_path_factory.mktemp("ds")
    torchrun(
        SCRIPTS / "convert_make_deepspeed.py",
        [out, *(f"{k}:{v}" for k, v in DS_VARIANTS.items())],
        timeout=600,
        outputs=[out],
    )
    return out


ZERO_STAGES = ("zero1", "zero2", "zero3")


@pytest.fixture(scope="session")
def trainer_zero_runs(tmp_path_factory) -> dict[str, Path]:
    """A Trainer-written bf16 checkpoint-2 for each ZeRO stage, the three runs in one 2-rank launch."""
    from tests.distributed.conftest import torchrun_runs

    outs = {stage: tmp_path_factory.mktemp(f"trainer_{stage}") for stage in ZERO_STAGES}
    runs = [["convert_trainer", str(out), "--mode", stage, "--bf16"] for stage, out in outs.items()]
    torchrun_runs(runs, tmp_path_factory.mktemp("trainer_zero") / "runs.json", env={}, outputs=list(outs.values()))
    return outs


@pytest.fixture(params=ZERO_STAGES)
def trainer_zero(request, trainer_zero_runs) -> Path:
    return trainer_zero_runs[request.param]


@pytest.fixture(scope="session")
def trainer_fsdp2(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trainer_fsdp2")
    torchrun(
        SCRIPTS / "convert_trainer.py",
        [out, "--mode", "fsdp2"],
        env={"HF_DIST_FSDP_ON_CPU": "1"},
        timeout=600,
        outputs=[out],
    )
    return out


def hf_state(folder: Path) -> dict[str, torch.Tensor]:
    state = {}
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            state.update(load_file(folder / name))
    return state


def assert_matches_reference(out: Path, reference: dict[str, torch.Tensor], tied: tuple[str, ...] = ()) -> None:
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for name, expected in reference.items():
        if name in tied:
            continue
        got = loaded[name]
        assert got.dtype == expected.dtype or expected.dtype == torch.float32, name
        assert torch.equal(got.to(expected.dtype), expected), f"{name} differs from the engine's consolidated weights"


@pytest.mark.parametrize("variant", ["z1", "z2", "z2fp16", "z3", "z3tied"])
def test_deepspeed_checkpoints_convert_to_the_trained_weights(ds_runs, tmp_path, variant):
    stage, dtype = DS_VARIANTS[variant].split(":")[:2]
    src = ds_runs / variant / "ds"
    report = convert(src, tmp_path / "auto", max_shard_size="100KB", progress=False)
    assert (report.source.format, report.source.stage, report.source.world_size) == ("deepspeed", int(stage), 2)
    assert report.dtype == {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    if dtype == "fp16":  # oneDNN fp16 or not, DeepSpeed's own fp16 engine wrote this checkpoint
        facts = json.loads((ds_runs / variant / "facts.json").read_text())
        assert facts["fp16_kernels"] == ("native" if cpu_has_onednn_fp16() else "portable")
    reference = load_file(ds_runs / variant / "reference.safetensors")
    # the 16-bit weights the engine trained with are exactly the cast of the fp32 masters we read
    assert_matches_reference(tmp_path / "auto", reference, tied=("lm_head.weight",))
    # fp32 output equals DeepSpeed's own reconstruction (trusted here: we wrote these files)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    convert(src, tmp_path / "fp32", dtype="fp32", progress=False)
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(src))
    ours = hf_state(tmp_path / "fp32")
    assert set(ours) == set(theirs) - ({"lm_head.weight"} if variant == "z3tied" else set())
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_tied_embeddings_are_written_once_and_load_tied(ds_runs, tmp_path):
    from transformers import AutoModelForCausalLM

    report = convert(ds_runs / "z3tied" / "ds", tmp_path / "out", progress=False)
    assert "lm_head.weight" not in hf_state(tmp_path / "out")
    assert report.dropped_tied == [] and report.source.num_params == report.num_params
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_lora_under_zero3_adapter_and_merge(ds_runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    src = ds_runs / "z3lora" / "ds"
    with pytest.raises(ValueError, match="holds a PEFT \\(LoRA\\) model; pass --adapter .* or --merge-adapter"):
        convert(src, tmp_path / "plain", progress=False)
    convert(src, tmp_path / "adapter", adapter=True, progress=False)
    convert(src, tmp_path / "merged", merge_adapter=True, progress=False)
    written = sorted(os.listdir(tmp_path / "adapter"))  # PEFT's two files, and the note that hf-dist wrote the folder
    assert written == ["adapter_config.json", "adapter_model.safetensors", "hf_dist_output.json"]
    reference = load_file(ds_runs / "z3lora" / "reference.safetensors")
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src)).to(torch.bfloat16)
    base.load_state_dict({k.replace("base_model.model.", "").replace(".base_layer", ""): v
                          for k, v in reference.items() if "lora_" not in k})  # fmt: skip
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    state = peft_model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in reference.items())
    merged_by_peft = peft_model.merge_and_unload().state_dict()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    assert set(merged) == set(merged_by_peft)
    for name, value in merged_by_peft.items():  # PEFT merges in bf16, we merge in fp32: within one bf16 step
        torch.testing.assert_close(merged[name].float(), value.float(), rtol=1e-2, atol=1e-3)
    q_ref = reference["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], q_ref)  # the merge changed it


def test_trainer_zero_bf16_checkpoint_and_inner_folder(trainer_zero, tmp_path):
    facts = json.loads((trainer_zero / "facts.json").read_text())
    stage = int(facts["mode"][-1])
    assert (facts["distributed_type"], facts["zero_stage"], facts["bf16"]) == ("DEEPSPEED", stage, True)
    reference = load_file(trainer_zero / "reference.safetensors")
    assert {t.dtype for t in reference.values()} == {torch.bfloat16}
    ckpt = trainer_zero / "checkpoint-2"
    # the files are the ones ZeRO writes at this stage (stage 1/2: one model file + per-rank optimizer shards)
    files = sorted(os.listdir(ckpt / "global_step2"))
    assert ("zero_pp_rank_0_mp_rank_00_model_states.pt" in files) == (stage == 3), files
    assert "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt" in files
    for i, src in enumerate((ckpt, ckpt / "global_step2")):
        report = convert(src, tmp_path / f"out{i}", progress=False)
        assert (report.source.stage, report.source.step, report.dtype) == (stage, 2, "bfloat16")
        # no manifest: the bf16 masters' casts were compared with the weights the Trainer gathered, bit for bit
        assert report.checked.startswith(f"{report.num_tensors} of the {report.num_tensors} tensors"), report.checked
        assert "generation_config.json" in os.listdir(tmp_path / f"out{i}")
        assert_matches_reference(tmp_path / f"out{i}", reference)
    assert main(["verify", str(ckpt), str(tmp_path / "out0"), "--atol", "0.01", "--logits"]) == 0
    assert main(["verify", str(ckpt), str(tmp_path / "out0")]) == 1  # fp32 masters vs their bf16 cast


def test_trainer_fsdp2_dcp_checkpoint(trainer_fsdp2, tmp_path):
    facts = json.loads((trainer_fsdp2 / "facts.json").read_text())
    assert (facts["distributed_type"], facts["model_class"]) == ("FSDP", "FSDPLlamaForCausalLM")
    ckpt = trainer_fsdp2 / "checkpoint-2"
    with pytest.raises(ValueError, match="no config.json found .*pass --model-config DIR"):
        convert(ckpt, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    report = convert(ckpt, tmp_path / "out", model_config=trainer_fsdp2 / "model-config", progress=False)
    assert (report.source.format, report.source.world_size, report.source.step) == ("dcp", 2, 2)
    assert_matches_reference(tmp_path / "out", load_file(trainer_fsdp2 / "reference.safetensors"))
    inner = convert(ckpt / "pytorch_model_fsdp_0", tmp_path / "inner", model_config=trainer_fsdp2 / "model-config",
                    progress=False)  # fmt: skip
    assert inner.num_tensors == report.num_tensors


def test_zero_to_hf_to_dcp_to_hf_round_trip_and_dcp_loads_on_2_ranks(ds_runs, tmp_path):
    src = ds_runs / "z3" / "ds"
    convert(src, tmp_path / "hf", dtype="fp32", progress=False)
    convert(tmp_path / "hf", tmp_path / "dcp", to="dcp", progress=False)
    convert(tmp_path / "dcp", tmp_path / "back", model_config=tmp_path / "hf", progress=False)
    first, back = hf_state(tmp_path / "hf"), hf_state(tmp_path / "back")
    assert set(first) == set(back)
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in first.items())
    torchrun(
        SCRIPTS / "convert_load_dcp.py",
        [tmp_path / "dcp", tmp_path / "hf", tmp_path / "load.json"],
        timeout=300,
        outputs=[tmp_path / "load.json"],
    )
    assert json.loads((tmp_path / "load.json").read_text()) == {"equal": True, "mismatched": [], "world_size": 2}


def copy_ckpt(ds_runs: Path, tmp_path: Path, variant: str = "z2") -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(ds_runs / variant / "ds", dst)
    return dst


def test_bad_inputs_on_real_checkpoints(ds_runs, tmp_path):
    out = tmp_path / "out"
    ckpt = copy_ckpt(ds_runs, tmp_path)
    tag = ckpt / "global_step2"
    with pytest.raises(ValueError, match=r"tag 'global_step9' not found .*\['global_step2'\]"):
        convert(ckpt, out, tag="global_step9", progress=False)
    rank1 = tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    saved = rank1.read_bytes()
    rank1.write_bytes(saved[: len(saved) // 3])
    with pytest.raises(RuntimeError, match=r"bf16_zero_pp_rank_1_mp_rank_00_optim_states\.pt.*truncated or corrupt"):
        convert(ckpt, out, progress=False)
    rank1.unlink()
    with pytest.raises(ValueError, match=r"saved by 2 ranks .*missing rank\(s\) \[1\]"):
        convert(ckpt, out, progress=False)
    rank1.write_bytes(saved)
    shutil.copy(rank1, tag / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt")
    with pytest.raises(ValueError, match=r"unexpected rank\(s\) \[2\]"):
        convert(ckpt, out, progress=False)
    (tag / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_foreign_pickle_is_refused_unless_trusted(ds_runs, tmp_path):
    ckpt = copy_ckpt(ds_runs, tmp_path)
    model_states = ckpt / "global_step2" / "mp_rank_00_model_states.pt"
    state = torch.load(model_states, weights_only=False)
    state["args"] = argparse.Namespace(lr=0.1)  # what older training scripts pickle into checkpoints
    torch.save(state, model_states)
    with pytest.raises(RuntimeError, match=r"mp_rank_00_model_states\.pt: it names the global argparse\.Namespace"):
        convert(ckpt, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert main(["convert", str(ckpt), str(tmp_path / "out"), "--trust-pickles", "--no-progress"]) == 0
