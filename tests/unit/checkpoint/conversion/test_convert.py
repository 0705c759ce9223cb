import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_dist.checkpoint.conversion.convert import convert
from hf_dist.checkpoint.conversion.verify import verify
from hf_dist.checkpoint.formats.names import MANIFEST_NAME
from hf_dist.checkpoint.output.paths import UnsafeOutputError
from hf_dist.cli.main import main


def write_hf(folder, config, state):
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


def test_existing_dst_is_refused_before_reading(zero_ckpt, tmp_path):
    root, _ = zero_ckpt
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"DST .*out already exists; pass --overwrite"):
        convert(root, tmp_path / "out", progress=False)
    assert os.listdir(tmp_path / "out") == ["keep.txt"]
    # --overwrite replaces only an earlier output of hf_dist (hf_dist_output.json), never someone else's folder
    with pytest.raises(UnsafeOutputError, match=r"out was not written by hf_dist \(it has no hf_dist_output.json\)"):
        convert(root, tmp_path / "out", overwrite=True, progress=False)
    assert os.listdir(tmp_path / "out") == ["keep.txt"]
    convert(root, tmp_path / "out2", progress=False)
    (tmp_path / "out2" / "stale.txt").write_text("from the first conversion")
    convert(root, tmp_path / "out2", overwrite=True, progress=False)
    assert "stale.txt" not in os.listdir(tmp_path / "out2") and (tmp_path / "out2" / "config.json").is_file()
    assert json.loads((tmp_path / "out2" / "hf_dist_output.json").read_text())["tool"] == "hf-dist convert"
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []


@pytest.mark.parametrize("inner", ["global_step3", "optimizer_0"])
def test_overwrite_never_deletes_another_runs_shards(zero_ckpt, tmp_path, inner):
    """A run's shard folders hold no name that marks training state at their top level; --overwrite still refuses
    them, because they are no output of hf_dist."""
    root, _ = zero_ckpt
    other = tmp_path / "other-run" / "checkpoint-9" / inner
    other.mkdir(parents=True)
    (other / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"another run's shard")
    with pytest.raises(UnsafeOutputError, match="was not written by hf_dist"):
        convert(root, other, overwrite=True, progress=False)
    assert (other / "zero_pp_rank_0_mp_rank_00_optim_states.pt").read_bytes() == b"another run's shard"


def test_no_config_says_which_flag(zero_ckpt, tmp_path):
    root, _ = zero_ckpt
    (tmp_path / "cfg").mkdir()
    (root / "config.json").rename(tmp_path / "cfg" / "config.json")
    with pytest.raises(ValueError, match=r"no config.json found .*pass --model-config DIR"):
        convert(root, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    convert(root, tmp_path / "out", model_config=tmp_path / "cfg", progress=False)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"


def test_config_that_does_not_match_the_weights(zero_ckpt, tmp_path):
    root, _ = zero_ckpt
    config = json.loads((root / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (root / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"parameters missing from the checkpoint: \['model.layers.1"):
        convert(root, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_hf_to_dcp_to_hf_is_bit_exact_and_dcp_loads_without_ranks(tiny_state, tmp_path):
    import torch.distributed.checkpoint as dcp

    config, state = tiny_state
    src = write_hf(tmp_path / "hf", config, state)
    convert(src, tmp_path / "dcp", to="dcp", progress=False)
    target = {"model": {k: torch.zeros_like(v) for k, v in state.items()}}
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)  # world size 1, torch's own loader
    assert all(torch.equal(target["model"][k], v) for k, v in state.items())
    convert(tmp_path / "dcp", tmp_path / "back", model_config=src, tokenizer=src, progress=False)
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert (tmp_path / "back" / "tokenizer_config.json").is_file()


def test_verify_reports_diffs_and_missing_keys(tiny_state, tmp_path):
    config, state = tiny_state
    a = write_hf(tmp_path / "a", config, state)
    changed = dict(state)
    changed["model.norm.weight"] = state["model.norm.weight"] + 0.5
    b = write_hf(tmp_path / "b", config, changed)
    report = verify(a, b)
    assert not report.ok and report.diffs["model.norm.weight"] == pytest.approx(0.5)
    assert verify(a, b, atol=0.6).ok
    assert main(["verify", str(a), str(b)]) == 1
    assert main(["verify", str(a), str(a)]) == 0


def test_cli_convert_reports_and_errors(zero_ckpt, tmp_path, capsys):
    root, state = zero_ckpt
    assert main(["convert", str(root), str(tmp_path / "out"), "--dtype", "fp32", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "deepspeed ZeRO-3, world size 2" in out and "parameters" in out
    assert torch.equal(
        load_file(tmp_path / "out" / "model.safetensors")["model.norm.weight"], state["model.norm.weight"]
    )
    assert main(["convert", str(root), str(tmp_path / "out")]) == 1
    assert "already exists" in capsys.readouterr().err


def test_peft_flags_need_a_peft_checkpoint(zero_ckpt, tmp_path):
    root, _ = zero_ckpt
    with pytest.raises(ValueError, match="holds no PEFT/LoRA tensors"):
        convert(root, tmp_path / "out", adapter=True, progress=False)
    with pytest.raises(ValueError, match="exclude each other"):
        convert(root, tmp_path / "out", adapter=True, merge_adapter=True, progress=False)


def test_fsdp_full_state_dict_with_wrapper_prefixes(tiny_state, tmp_path):
    config, state = tiny_state
    ckpt = tmp_path / "checkpoint-5"
    ckpt.mkdir()
    config.save_pretrained(ckpt)
    # FSDP1/accelerate wrappers leave these segments in the names; the converter removes them
    wrapped = {
        "_forward_module." + k.replace("layers.0.", "layers.0._fsdp_wrapped_module."): v for k, v in state.items()
    }
    torch.save(wrapped, ckpt / "pytorch_model_fsdp.bin")
    report = convert(ckpt, tmp_path / "out", progress=False)
    assert (report.source.format, report.source.step) == ("fsdp_full", 5)
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert set(out) == set(state) and all(torch.equal(out[k], v) for k, v in state.items())


def test_prefetch_keeps_order_raises_errors_and_stops_with_the_consumer():
    import threading

    from hf_dist.checkpoint.conversion.convert import prefetch

    assert list(prefetch(iter(range(50)))) == list(range(50))

    def failing():
        yield 1
        raise OSError("disk gone")

    got = []
    with pytest.raises(OSError, match="disk gone"):
        for item in prefetch(failing()):
            got.append(item)
    assert got == [1]

    produced = []

    def endless():
        for i in range(10**9):
            produced.append(i)
            yield i

    stream = prefetch(endless(), depth=2)
    assert next(stream) == 0
    stream.close()  # the consumer stops: the producer must stop too, a few items ahead at most
    assert len(produced) <= 5
    assert not any(t.name == "hf_dist-prefetch" for t in threading.enumerate())


@pytest.mark.parametrize("kernel", ["copy_file_range", "refused", "missing"])
def test_copy_ranges_by_kernel_or_buffer(tmp_path, monkeypatch, kernel):
    import errno

    import hf_dist.checkpoint.write.hf_folder as writer

    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 40)
    if kernel == "refused":  # e.g. source and destination on different filesystems

        def refuse(*args):
            raise OSError(errno.EXDEV, "Invalid cross-device link")

        monkeypatch.setattr(writer.os, "copy_file_range", refuse, raising=False)
    monkeypatch.setattr(writer, "_KERNEL_COPY", kernel != "missing")
    with open(tmp_path / "dst.bin", "wb", buffering=0) as dst:
        dst.write(b"head")
        writer.copy_ranges([(str(src), 10, 300), (str(src), 5000, 100)], dst.fileno())
    data = src.read_bytes()
    assert (tmp_path / "dst.bin").read_bytes() == b"head" + data[10:310] + data[5000:5100]
    with (
        open(tmp_path / "dst2.bin", "wb", buffering=0) as dst,
        pytest.raises(RuntimeError, match="ends at byte 10240"),
    ):
        writer.copy_ranges([(str(src), 10_000, 500)], dst.fileno())  # the source is 10240 bytes long


def test_disk_full_up_front_and_while_writing_leave_nothing(zero_ckpt, tmp_path, monkeypatch):
    import errno
    from collections import namedtuple

    import hf_dist.checkpoint.write.hf_folder as writer

    root, _ = zero_ckpt
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(writer.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(
        RuntimeError, match=r"not enough disk space in .*: the output needs [0-9.]+ [kMG]?B, 1.00 kB free"
    ):
        convert(root, tmp_path / "out", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3"]
    monkeypatch.undo()

    calls = []

    def fill_up(ranges, fd):  # fp32 output: tensors go file to file; the disk fills on the third
        calls.append(ranges)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_copy(ranges, fd)

    real_copy = writer.copy_ranges
    monkeypatch.setattr(writer, "copy_ranges", fill_up)
    with pytest.raises(
        RuntimeError, match=r"disk full while writing .*out; nothing was written, free space and retry"
    ):
        convert(root, tmp_path / "out", dtype="fp32", progress=False)
    assert len(calls) == 3 and sorted(os.listdir(tmp_path)) == ["checkpoint-3"]  # no DST, no temp folder


def test_a_sharded_checkpoint_without_a_manifest_converts_and_says_it_could_not_be_verified(
    zero_ckpt, tmp_path, capsys
):
    """Issue 38: same-length but wrong rank files in a checkpoint without a manifest converted silently. The files
    alone cannot show it; the conversion now says so, and with the manifest of the save it is not said."""
    from hf_dist.checkpoint.lifecycle.manifest import write_manifest

    root, _ = zero_ckpt
    assert main(["convert", str(root), str(tmp_path / "plain"), "--no-progress"]) == 0
    note = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:  not verified: ")]
    assert len(note) == 1 and f"has no {MANIFEST_NAME}" in note[0] and "two ranks' files exchanged" in note[0]
    write_manifest(root, hashed={}, world_size=2)
    report = convert(root, tmp_path / "marked", progress=False)
    assert report.unverified == "" and "not verified" not in report.summary()


def test_a_checkpoint_without_a_manifest_is_checked_against_the_weights_the_trainer_gathered_beside_it(
    zero_ckpt, tmp_path, capsys
):
    """Issue 38: where a ZeRO checkpoint without a manifest also holds the Trainer's gathered weights
    (model.safetensors beside global_step3/), every tensor read from the rank files is compared with its gathered
    copy. Two ranks' same-length optimizer files exchanged (which converted silently before) are refused, naming a
    tensor, and nothing is written."""
    root, state = zero_ckpt
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, root / "model.safetensors")
    report = convert(root, tmp_path / "checked", progress=False)
    total = len(state)
    assert report.checked.startswith(f"{total} of the {total} tensors written, read from the rank files, equal")
    assert report.unverified == "" and "not verified" not in report.summary()
    assert f"checked: {total} of the {total}" in report.summary()

    # the fp32 output would be copied file to file; under the check every tensor is read and compared
    assert convert(root, tmp_path / "fp32", dtype="fp32", progress=False).checked == report.checked
    # weights beside a tag of another step (a DeepSpeed folder of several saves) are not taken for this save's copy
    engine = tmp_path / "engine"
    shutil.copytree(root, engine)
    other = convert(engine, tmp_path / "engine-out", progress=False)
    assert other.checked == "" and other.unverified.startswith("not verified: ")
    shutil.rmtree(engine)
    shutil.rmtree(tmp_path / "engine-out")

    tag = root / "global_step3"
    rank0, rank1 = (tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))
    assert rank0.stat().st_size == rank1.stat().st_size
    rank0.rename(tag / "swap")
    rank1.rename(rank0)
    (tag / "swap").rename(rank1)
    assert main(["convert", str(root), str(tmp_path / "exchanged"), "--no-progress"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "read from the rank files differs from its copy in" in err[0], err
    assert "max difference" in err[0] and "Nothing was written" in err[0]
    assert sorted(os.listdir(tmp_path)) == ["checked", "checkpoint-3", "fp32"]  # no output, no temp folder


def test_the_gathered_weights_are_read_as_safely_as_the_checkpoint(zero_ckpt, tmp_path, capsys):
    """The gathered file is one more file a handed folder holds: a payload planted in a gathered pytorch_model.bin
    never runs (refused in one line, nothing written), and a gathered model.safetensors linked out of the checkpoint is
    refused naming the link."""
    from tests.unit.checkpoint.safety.payloads import plant

    root, state = zero_ckpt
    marker = tmp_path / "PAYLOAD_RAN"
    torch.save({k: v.to(torch.bfloat16) for k, v in state.items()}, root / "pytorch_model.bin")
    plant(root / "pytorch_model.bin", marker)
    assert main(["convert", str(root), str(tmp_path / "out"), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"refusing to load {root / 'pytorch_model.bin'}" in err, err
    assert "nothing in it ran" in err
    assert not marker.exists() and not (tmp_path / "out").exists()

    (root / "pytorch_model.bin").unlink()
    outside = tmp_path / "elsewhere.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, outside)
    (root / "model.safetensors").symlink_to(outside)
    assert main(["convert", str(root), str(tmp_path / "out"), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert f"refusing to read {root / 'model.safetensors'}" in err and str(outside) in err, err
    assert not (tmp_path / "out").exists()
