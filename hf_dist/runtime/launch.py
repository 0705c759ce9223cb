"""Starting CPU ranks: a free port and the environment every CPU rank runs with (the demo, bench, tests)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for CPU ranks: one thread per rank, offline hub, quiet logs, repo importable."""
    env = dict(os.environ)
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
            "ACCELERATE_USE_CPU": "1",
            "CUDA_VISIBLE_DEVICES": "",
            # a rank that dies on a signal (SIGABRT, SIGSEGV) prints every thread's Python stack first
            "PYTHONFAULTHANDLER": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")])),
        }
    )
    if extra:
        env.update(extra)
    return env
