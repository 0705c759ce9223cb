import os

import pytest

# Tests never reach a hub and keep each process to one thread (CI has 2 cores).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture(autouse=True)
def _restore_environ():
    """TrainingArguments and accelerate write FSDP_* / ACCELERATE_* variables into os.environ; keep
    each test from leaking them into the next."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
