"""The one loader: torch's weights_only unpickler with hf_dist's allowlist, for hf_dist's reads and the loads it drives."""

from __future__ import annotations

import argparse
import os
import sys
import types
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import pytest
import torch

from hf_dist.checkpoint.safety import loading
from hf_dist.checkpoint.safety.errors import CorruptCheckpointError, UnsafePickleError
from hf_dist.checkpoint.safety.loading import (
    LossScalerStub,
    ZeroStageStub,
    check_loadable,
    guarded_loads,
    guarded_pool,
    safe_load,
)
from hf_dist.checkpoint.safety.paths import PathEscapeError
from tests.unit.checkpoint.safety.payloads import FORMATS, Payload, plant


@pytest.mark.parametrize("fmt", FORMATS)
def test_safe_load_refuses_a_payload_in_every_format_naming_file_and_global(fmt, tmp_path):
    path = tmp_path / "optimizer.pt"
    torch.save({"w": torch.ones(2)}, path)
    plant(path, tmp_path / "RAN", fmt)
    named = "torch's legacy tar format" if fmt == "tar" else "the global posix.mkdir"
    with pytest.raises(UnsafePickleError, match=rf"^refusing to load {path}: it (names|is in) {named}") as caught:
        safe_load(path)
    assert "\n" not in str(caught.value) and "--trust-pickles" in str(caught.value)
    assert not (tmp_path / "RAN").exists()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_library_load_under_the_guard_is_the_same_load(fmt, tmp_path):
    """torch.load(weights_only=False), as DeepSpeed calls it, becomes the weights_only load while guarded; outside
    the guard torch.load is torch's own again."""
    path = tmp_path / "model_states.pt"
    torch.save({"w": torch.ones(2)}, path)
    plant(path, tmp_path / "RAN", fmt)
    original = torch.load
    with pytest.raises(UnsafePickleError, match=f"refusing to load {path}"), guarded_loads(tmp_path):
        torch.load(path, map_location="cpu", weights_only=False)
    assert torch.load is original and torch.serialization.load is original
    assert not (tmp_path / "RAN").exists()


def test_a_guarded_load_to_cpu_0_lands_on_the_cpu(tmp_path):
    """transformers 5.0 loads a multi-rank resume's optimizer.pt with map_location=args.device, cpu:0 on CPU ranks
    launched without use_cpu, which torch's own load cannot place; the guarded load reads it onto the CPU."""
    path = tmp_path / "optimizer.pt"
    torch.save({"exp_avg": torch.ones(2)}, path)
    with pytest.raises(RuntimeError, match="don't know how to restore data location"):
        torch.load(path, map_location=torch.device("cpu", 0), weights_only=True)
    with guarded_loads(tmp_path):
        for where in (torch.device("cpu", 0), "cpu:0"):
            assert torch.equal(torch.load(path, map_location=where, weights_only=True)["exp_avg"], torch.ones(2))


def test_the_guard_confines_library_loads_and_nests(tmp_path):
    inside, outside = tmp_path / "ckpt", tmp_path / "other"
    inside.mkdir(), outside.mkdir()
    torch.save({"w": torch.ones(2)}, outside / "x.pt")
    torch.save({"w": torch.ones(2)}, inside / "y.pt")
    with guarded_loads(tmp_path):
        assert torch.equal(torch.load(outside / "x.pt", weights_only=False)["w"], torch.ones(2))
        with guarded_loads(inside):
            assert loading.active_root() == inside
            with pytest.raises(PathEscapeError, match=r"refusing to read .*x\.pt: it resolves to .* outside"):
                torch.load(str(outside / "x.pt"), weights_only=False)
            with open(outside / "x.pt", "rb") as handle, pytest.raises(PathEscapeError):
                torch.load(handle)  # an open file is confined by its name
            torch.load(inside / "y.pt")
        assert loading.active_root() == tmp_path
    assert loading.active_root() is None


def test_a_guard_applies_to_its_thread_and_the_threads_it_starts_not_to_threads_already_running(tmp_path):
    """Safe for other threads: a thread that ran before the guard (a data loader's, the user's) loads as it would
    without it, while the guarded thread and any thread started inside the guard (a library's helper) are confined;
    two threads' guards do not unwind each other's."""
    import threading

    root, outside = tmp_path / "ckpt", tmp_path / "other.pt"
    root.mkdir()
    torch.save({"w": torch.ones(2)}, outside)
    ready, go, said = threading.Event(), threading.Event(), {}

    def bystander() -> None:
        ready.set()
        go.wait()
        said["bystander"] = (loading.active_root(), float(torch.load(outside)["w"].sum()))

    def started_inside() -> None:
        try:
            torch.load(outside)
            said["started inside"] = "loaded"
        except PathEscapeError:
            said["started inside"] = "refused"

    running = threading.Thread(target=bystander)
    running.start()
    ready.wait()
    with guarded_loads(root):
        go.set()
        running.join()
        helper = threading.Thread(target=started_inside)
        helper.start()
        helper.join()
        with pytest.raises(PathEscapeError):
            torch.load(outside)
    assert said == {"bystander": (None, 2.0), "started inside": "refused"}

    other = loading.guarded_loads(tmp_path)  # entered by another thread, left before this one's guard
    with guarded_loads(root):
        helper = threading.Thread(target=other.__enter__)
        helper.start()
        helper.join()
        assert loading.active_root() == root  # the other thread's guard is not this thread's
        other.__exit__(None, None, None)
        assert loading.active_root() == root
    assert loading.active_root() is None and not loading._STACK


def test_trust_pickles_keeps_the_librarys_load_but_stays_confined(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"args": argparse.Namespace(lr=1.0)}, path)
    with guarded_loads(tmp_path, trust_pickles=True):
        assert torch.load(path, weights_only=False)["args"].lr == 1.0
    (tmp_path / "sub").mkdir()
    with guarded_loads(tmp_path / "sub", trust_pickles=True), pytest.raises(PathEscapeError):
        torch.load(path, weights_only=False)


def _load_in_worker(path: str) -> str:
    try:
        torch.load(path, weights_only=False)
    except UnsafePickleError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_librarys_worker_processes_are_guarded_too(method, tmp_path):
    """DeepSpeed's ds_to_universal loads in a ProcessPoolExecutor: each worker enters the guard itself, so a spawned
    worker (no inherited patch) refuses as the parent does."""
    path = tmp_path / "optim.pt"
    torch.save({"w": torch.ones(2)}, path)
    plant(path, tmp_path / "RAN")
    make = guarded_pool(ProcessPoolExecutor, tmp_path, False)
    with make(max_workers=1, mp_context=get_context(method)) as pool:
        got = pool.submit(_load_in_worker, str(path)).result()
    assert got.startswith(f"refusing to load {path}") and not (tmp_path / "RAN").exists()


def test_foreign_type_is_refused_and_trust_pickles_loads_it(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"args": argparse.Namespace(lr=1.0)}, path)
    with pytest.raises(UnsafePickleError, match=r"evil\.pt: it names the global argparse\.Namespace.*--trust-pickles"):
        safe_load(path)
    assert safe_load(path, trust_pickles=True)["args"].lr == 1.0


def test_torchscript_archive_is_refused(tmp_path):
    """torch.load(weights_only=False) hands a TorchScript zip to torch.jit.load, which runs the module's code."""
    path = tmp_path / "pytorch_model.bin"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), path)
    with pytest.warns(UserWarning, match="TorchScript archive"):
        torch.load(path, weights_only=False)  # the path is live: torch dispatches to torch.jit.load
    with pytest.raises(UnsafePickleError, match=rf"refusing to load {path}: it is a TorchScript archive"):
        safe_load(path)
    with pytest.raises(UnsafePickleError, match="TorchScript archive"):
        check_loadable(tmp_path)


def test_truncated_and_empty_files_name_the_file(tmp_path):
    good = tmp_path / "good.pt"
    torch.save({"w": torch.arange(10000.0)}, good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:3000])
    with pytest.raises(CorruptCheckpointError, match=r"truncated\.pt.*truncated or corrupt"):
        safe_load(truncated)
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(CorruptCheckpointError, match=r"empty\.pt is empty"):
        safe_load(empty)


@pytest.fixture
def fake_deepspeed_classes(monkeypatch):
    """Classes pickled under deepspeed's dotted names, without importing deepspeed."""
    made = {}
    for module_name, class_name, base in (
        ("deepspeed.runtime.zero.config", "ZeroStageEnum", int),
        ("deepspeed.runtime.fp16.loss_scaler", "LossScaler", object),
    ):
        parts = module_name.split(".")
        for i in range(1, len(parts)):  # fake parents too, whether or not real deepspeed is imported
            monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        module = types.ModuleType(module_name)
        cls = type(class_name, (base,), {"__module__": module_name})
        setattr(module, class_name, cls)
        monkeypatch.setitem(sys.modules, module_name, module)
        made[class_name] = cls
    return made


def test_deepspeed_types_load_as_inert_stand_ins_in_hf_dists_reads(tmp_path, fake_deepspeed_classes):
    scaler = fake_deepspeed_classes["LossScaler"]()
    scaler.cur_scale = 1024.0
    path = tmp_path / "optim.pt"
    torch.save(
        {"zero_stage": fake_deepspeed_classes["ZeroStageEnum"](3), "loss_scaler": scaler, "w": torch.ones(3)}, path
    )
    state = safe_load(path)
    assert isinstance(state["zero_stage"], ZeroStageStub) and int(state["zero_stage"]) == 3
    assert isinstance(state["loss_scaler"], LossScalerStub) and state["loss_scaler"].cur_scale == 1024.0
    assert torch.equal(state["w"], torch.ones(3))


def test_real_trainer_resume_files_load_and_training_args_is_never_loaded(tmp_path):
    """The files a Trainer save writes, loaded with the allowlist; training_args.bin (a whole TrainingArguments,
    which no allowlist admits) is not among the files a resume loads, so it is not checked either."""
    import random

    import numpy as np
    from transformers import TrainingArguments

    torch.save(TrainingArguments(output_dir=str(tmp_path), report_to="none"), tmp_path / "training_args.bin")
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()},
               tmp_path / "rng_state.pth")  # fmt: skip
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp_path / "scheduler.pt")
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    loaded = check_loadable(tmp_path)
    assert sorted(p.name for p in loaded) == ["legacy.pt", "optimizer.pt", "rng_state.pth", "scheduler.pt"]
    assert np.array_equal(safe_load(tmp_path / "rng_state.pth")["numpy"][1], np.random.get_state()[1])


def test_a_link_under_the_checkpoint_leading_out_is_refused_on_entry(tmp_path):
    ckpt, outside = tmp_path / "ckpt", tmp_path / "outside"
    ckpt.mkdir(), outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"x")
    (ckpt / "deep" / "er").mkdir(parents=True)
    (ckpt / "deep" / "er" / "model.safetensors").symlink_to(outside / "model.safetensors")
    with pytest.raises(PathEscapeError, match=r"deep/er/model\.safetensors: it resolves to .*outside"):
        check_loadable(ckpt)
    with pytest.raises(PathEscapeError), guarded_loads(ckpt):
        pass
    os.symlink(tmp_path / "nowhere", ckpt / "dangling")
    (ckpt / "deep" / "er" / "model.safetensors").unlink()
    with pytest.raises(PathEscapeError, match="broken link"):
        check_loadable(ckpt)


def test_payload_class_is_live():
    """The payload used by every test really runs when unpickled without an allowlist."""
    import pickle
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        marker = os.path.join(folder, "RAN")
        pickle.loads(pickle.dumps(Payload(marker)))
        assert os.path.isdir(marker)
