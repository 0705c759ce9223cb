"""Helpers for running real ranks on CPU over gloo, shared by tests, benchmarks and recipes' checks.

Nothing here is needed at training time; it exists so every distributed test launches ranks
the same way a user would (``torchrun`` / ``accelerate launch``) with a bounded time.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


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


def torchrun(
    script: str | Path,
    args: Sequence[str] = (),
    *,
    nproc: int = 2,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    cwd: str | Path | None = None,
    extra_launcher_args: Sequence[str] = (),
) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` CPU ranks with torchrun; raise with the output on failure."""
    cmd = torchrun_command(script, args, nproc=nproc, extra_launcher_args=extra_launcher_args)
    return run_checked(cmd, env=cpu_env(env), timeout=timeout, cwd=cwd)


def torchrun_command(
    script: str | Path, args: Sequence[str] = (), *, nproc: int = 2, extra_launcher_args: Sequence[str] = ()
) -> list[str]:
    """The torchrun command line for ``script`` on ``nproc`` local ranks, on a free port of 127.0.0.1."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        *extra_launcher_args,
        str(script),
        *map(str, args),
    ]


def accelerate_launch(
    script: str | Path,
    args: Sequence[str] = (),
    *,
    config_file: str | Path | None = None,
    nproc: int = 2,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess:
    """Run ``script`` with ``accelerate launch`` on ``nproc`` CPU processes."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if config_file is not None:
        cmd += ["--config_file", str(config_file)]
    else:  # the values accelerate would otherwise default, each with a line of warning
        cmd += ["--num_machines", "1", "--dynamo_backend", "no", "--mixed_precision", "no"]
        if nproc > 1:
            cmd.append("--multi_gpu")  # without a config file and without GPUs accelerate would start one process
    cmd += ["--num_processes", str(nproc), "--main_process_port", str(free_port()), str(script), *map(str, args)]
    return run_checked(cmd, env=cpu_env(env), timeout=timeout, cwd=cwd)


def run_checked(cmd: Sequence[str], *, env: dict[str, str], timeout: float, cwd=None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout kill the whole group (launcher and ranks)."""
    with subprocess.Popen(
        list(cmd), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            stdout, stderr = popen.communicate()
            raise RuntimeError(_failure(f"timed out after {timeout:.0f}s", cmd, stdout, stderr)) from None
    proc = subprocess.CompletedProcess(list(cmd), popen.returncode, stdout, stderr)
    if proc.returncode != 0:
        raise RuntimeError(_failure(f"failed with exit code {proc.returncode}", cmd, stdout, stderr))
    return proc


# lines that say why a rank died; launchers bury them under pages of other ranks' output
_CAUSE = re.compile(
    r"terminate called|what\(\):|Fatal Python error|Segmentation fault|Aborted|"
    r"^\w+(Error|Exception|Exit)\b|^\[rank\d+\]:\s*\w+(Error|Exception)\b|exitcode\s*:|traceback\s*:"
)


def cause_lines(stderr: str) -> list[str]:
    """The distinct lines of a launch's stderr that say why a rank died, in order."""
    return list(dict.fromkeys(line.rstrip() for line in stderr.splitlines() if _CAUSE.search(line)))


def _failure(what: str, cmd: Sequence[str], stdout: str, stderr: str, keep: int = 20) -> str:
    """The error text of a failed launch: the lines naming the cause first, then the output's tails."""
    causes = cause_lines(stderr)
    if len(causes) > 2 * keep:  # the ranks' own errors come first, the launcher's summary last
        causes = [*causes[:keep], "[...]", *causes[-keep:]]
    summary = "\n".join(causes)
    return (
        f"command {what}: {' '.join(cmd)}\n--- lines naming the cause ---\n{summary}\n"
        f"--- stdout (tail) ---\n{stdout[-4000:]}\n--- stderr (tail) ---\n{stderr[-8000:]}"
    ).strip()


def cpu_has_onednn_fp16() -> bool:
    """Whether this CPU computes fp16 through oneDNN (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``).

    DeepSpeed's CPU accelerator asks exactly this before it accepts ``fp16`` (``Type fp16 is not supported on
    your device.``); many x86-64 CPUs answer no (an AMD EPYC with AVX-512 bf16, any AVX2-only CPU).
    """
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def allow_portable_fp16_in_deepspeed() -> bool:
    """Let DeepSpeed's CPU accelerator run fp16 on torch's portable CPU kernels when oneDNN has no fp16.

    Tests need DeepSpeed's fp16 *checkpoint format* (fp16 module weights, fp32 master partitions, loss scaler)
    on any CPU. The engine's fp16 path is the same code either way; only the matmul kernels differ. Returns
    True when it had to patch (the CPU lacks oneDNN fp16), False when DeepSpeed accepts fp16 as is. Tests only.
    """
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu" or accelerator.is_fp16_supported():
        return False
    type(accelerator).is_fp16_supported = lambda self: True
    return True


def tiny_llama_config(**overrides):
    """A Llama config small enough for 2 CPU ranks to train in seconds."""
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


class TokenDataset:
    """``n`` fixed random sequences of ``seq`` token ids (labels = inputs) for tiny causal-LM runs."""

    def __init__(self, n: int = 64, seq: int = 16, vocab: int = 256, *, seed: int = 1234) -> None:
        import torch

        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
