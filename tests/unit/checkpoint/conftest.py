import pytest

from tests.unit.checkpoint.fakes import make_zero_checkpoint, tiny_model_state


@pytest.fixture(scope="session")
def tiny_state():
    return tiny_model_state()


@pytest.fixture
def zero_ckpt(tmp_path, tiny_state):
    """A fake ZeRO-3 bf16 Trainer-style checkpoint-3 folder; returns (checkpoint dir, fp32 state)."""
    config, state = tiny_state
    root = tmp_path / "checkpoint-3"
    make_zero_checkpoint(root, config, state, stage=3)
    return root, state
