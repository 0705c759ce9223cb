"""hf_dist.runtime.dist.shutdown: the last call of every distributed script."""

from __future__ import annotations

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
