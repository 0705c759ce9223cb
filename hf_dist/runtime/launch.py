"""Starting CPU ranks: a free port and the environment every CPU rank runs with (the demo, bench, tests)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


# The rare abort of a gloo rank (a C++ thread destroyed while joinable), at start or at exit, whatever the script
# does: measured about 1 launch in 100 (benchmarks/gloo_exit.py). CPU launches that measure or test relaunch once.
GLOO_ABORT = "terminate called without an active exception"


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


def requested_processes(cmdline: list[str] | None = None) -> int | None:
    """``N`` of the ``accelerate launch --num_processes N`` that started this process (its parent), else None.

    Without ``--multi_gpu`` (or a config file) accelerate starts one process on a machine without GPUs whatever N
    says, and nothing in the child's environment tells; the parent's command line does.
    """
    if cmdline is None:
        try:
            import psutil

            cmdline = psutil.Process().parent().cmdline()
        except Exception:  # no parent, no permission, no psutil: nothing to tell
            return None
    launcher = " ".join(cmdline[:3])
    if "accelerate" not in launcher or "launch" not in launcher:
        return None
    for i, arg in enumerate(cmdline):
        value = arg.split("=", 1)[1] if arg.startswith(("--num_processes=", "--num-processes=")) else None
        if arg in ("--num_processes", "--num-processes") and i + 1 < len(cmdline):
            value = cmdline[i + 1]
        if value is not None and value.isdigit():
            return int(value)
    return None


def check_one_process_launch(cmdline: list[str] | None = None) -> None:
    """Refuse a single process started by an ``accelerate launch`` that asked for several: it would train alone
    while the user believes it trains on N ranks."""
    asked = requested_processes(cmdline)
    if asked and asked > 1 and int(os.environ.get("WORLD_SIZE", "1") or 1) == 1:
        raise RuntimeError(
            f"accelerate launch was asked for --num_processes {asked} but started this one process (WORLD_SIZE unset): "
            "without --multi_gpu or a config file it starts one process on a machine without GPUs. Launch with\n"
            f"  ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes {asked} ...   (CPU ranks, DDP/FSDP)\n"
            f"  accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes {asked} ...   (GPUs)"
        )
