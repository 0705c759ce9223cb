"""hf_dist.runtime.dist.shutdown, the last call of every distributed script, and the launch checks."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hf_dist.runtime.dist import shutdown
from hf_dist.testing import free_port


def test_shutdown_destroys_the_process_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert dist.is_initialized()
        shutdown()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_shutdown_is_a_no_op_without_a_process_group():
    assert not dist.is_initialized()
    shutdown()
    assert not dist.is_initialized()


def test_an_accelerate_launch_that_started_one_of_several_processes_is_refused(monkeypatch):
    from hf_dist.runtime.launch import check_one_process_launch, requested_processes

    python_m = ["/venv/bin/python", "-m", "accelerate.commands.launch", "--num_processes", "2", "train.py"]
    script = ["/venv/bin/python", "/venv/bin/accelerate", "launch", "--num_processes=4", "train.py"]
    assert requested_processes(python_m) == 2 and requested_processes(script) == 4
    assert requested_processes(["/venv/bin/python", "-m", "torch.distributed.run", "--nproc_per_node", "2"]) is None
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match=r"(?s)asked for --num_processes 2 but started this one process.*"
                       r"ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2"):  # fmt: skip
        check_one_process_launch(python_m)
    monkeypatch.setenv("WORLD_SIZE", "2")  # --multi_gpu: every rank sees the world
    check_one_process_launch(python_m)
    check_one_process_launch(["/venv/bin/python", "-m", "accelerate.commands.launch", "train.py"])
