"""Launch helpers shared by the distributed tests: every configuration is launched once per session.

A launch costs seconds (imports, process group, a few steps), so tests that check different facts
of the same run (what wrapped the model, the checkpoint files, the loss curve) share one launch
through a session-scoped :class:`LaunchCache`. A failed launch is cached too: every test that
needs it fails with the launcher's output instead of relaunching.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from hf_dist.planning.layout import Engine, strategy
from hf_dist.testing import REPO_ROOT, cpu_env, free_port, retry_gloo_abort, run_checked, torchrun

SCRIPTS = Path(__file__).parent / "scripts"
CONFIG_DIR = REPO_ROOT / "accelerate_configs"
NPROC = 2
TRAIN_STEPS = 6  # optimizer steps per Trainer run (strategies_train.py)
# Generous per launch: a cold DeepSpeed start JIT-builds its shared-memory comm op once (~20 s).
LAUNCH_TIMEOUT_S = 300


# Extra environment for CPU ranks of each engine (on top of hf_dist.testing.cpu_env).
CPU_ENV = {
    # accelerate takes its DeepSpeed branch only when not forced onto CPU; DeepSpeed then runs on
    # its CPU accelerator over gloo by itself.
    Engine.DEEPSPEED: {"ACCELERATE_USE_CPU": "false"},
    Engine.FSDP2: {"HF_DIST_FSDP_ON_CPU": "1"},  # see hf_dist/runtime/cpu_fsdp.py
    Engine.DDP: {},
}


def launch_env(strategy_name: str) -> dict[str, str]:
    """Extra environment for CPU ranks of one strategy (``"none"``: one process, no wrapper)."""
    return {} if strategy_name == "none" else CPU_ENV[strategy(strategy_name).engine]


@dataclass(frozen=True)
class StrategyCase:
    """One Trainer run of tests/distributed/scripts/strategies_train.py."""

    name: str
    strategy: str  # "none" = single process, no distributed wrapper
    offload: str = "none"
    extra: tuple[str, ...] = ()  # more flags of strategies_train.py (micro-batch, accumulation, sync_each_batch)

    @property
    def nproc(self) -> int:
        return 1 if self.strategy == "none" else NPROC


BASELINE = StrategyCase("baseline", "none")
# Each 2-rank configuration is compared with BASELINE (1 process, gradient accumulation 2).
CASES = {
    case.name: case
    for case in (
        BASELINE,
        StrategyCase("ddp", "ddp"),
        StrategyCase("fsdp_full_shard", "fsdp_full_shard"),
        StrategyCase("zero1", "zero1"),
        StrategyCase("zero2", "zero2"),
        StrategyCase("zero3", "zero3"),
        StrategyCase("zero3_offload", "zero3", offload="optimizer"),
        # FSDP2 with gradient accumulation (the same 4 samples per step): under the Trainer's no_sync, and with
        # each micro-batch reduce-scattered (sync_each_batch, planned and emitted by auto_args)
        StrategyCase("fsdp_no_sync", "fsdp_full_shard", extra=("--micro-batch", "1", "--grad-accum", "2")),
        StrategyCase(
            "fsdp_sync_each_batch",
            "fsdp_full_shard",
            extra=("--micro-batch", "1", "--grad-accum", "2", "--sync-each-batch"),
        ),  # fmt: skip
    )
}


class LaunchCache:
    """Runs each keyed launch at most once per session and returns its JSON report."""

    def __init__(self, root: Path, launch: Callable[[str, Path, Path], None]) -> None:
        self.root = root
        self._launch = launch
        self._results: dict[str, dict | BaseException] = {}

    def get(self, key: str) -> dict:
        if key not in self._results:
            try:
                self._results[key] = retry_gloo_abort(lambda attempt: self._run(key, attempt))
            except Exception as exc:  # cached so dependent tests fail fast with the same output
                self._results[key] = exc
        result = self._results[key]
        if isinstance(result, BaseException):
            raise RuntimeError(f"launch {key!r} failed (cached): {result}") from result
        return result

    def _run(self, key: str, attempt: int) -> dict:
        workdir = self.root / (key if attempt == 0 else f"{key}-retry{attempt}")  # a retry starts afresh
        workdir.mkdir(parents=True)
        out = workdir / "report.json"
        start = time.perf_counter()
        self._launch(key, workdir, out)
        report = json.loads(out.read_text())
        report["launch_seconds"] = round(time.perf_counter() - start, 1)
        report["workdir"] = str(workdir)
        return report


def launch_strategy(case: StrategyCase, workdir: Path, out: Path) -> None:
    script = SCRIPTS / "strategies_train.py"
    args = ["--strategy", case.strategy, "--offload", case.offload, "--steps", TRAIN_STEPS, *case.extra]
    args += ["--output-dir", workdir / "run", "--out", out]
    if case.nproc == 1:
        # One process, accumulation 2 == two ranks, accumulation 1 (same samples per optimizer step).
        cmd = [sys.executable, str(script), *map(str, args), "--grad-accum", "2"]
        run_checked(cmd, env=cpu_env(), timeout=LAUNCH_TIMEOUT_S)
        return
    env = launch_env(case.strategy)
    if case.strategy == "ddp":  # plain torchrun, no ACCELERATE_USE_CPU: auto_args' use_cpu makes it one 2-rank job
        env = {**env, "ACCELERATE_USE_CPU": "0"}
    torchrun(script, args, nproc=case.nproc, env=env, timeout=LAUNCH_TIMEOUT_S, outputs=[workdir / "run", out])


def launch_accelerate_config(config: str, out: Path) -> None:
    """``accelerate launch --config_file accelerate_configs/<config>.yaml`` on 2 CPU ranks, fp32.

    No ``--cpu``: with it accelerate picks its single-process/MPI launcher and never spawns ranks.
    The CPU is selected by ``ACCELERATE_USE_CPU=1`` (cpu_env) for DDP/FSDP, and by DeepSpeed's own
    CPU accelerator for ZeRO. ``--mixed_precision no`` overrides the YAMLs' bf16 (slow on CPU).
    """
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(CONFIG_DIR / f"{config}.yaml"),
        "--num_processes",
        str(NPROC),
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(free_port()),
        "--mixed_precision",
        "no",
        str(SCRIPTS / "strategies_minimal.py"),
        "--out",
        str(out),
    ]
    run_checked(cmd, env=cpu_env(CPU_ENV[_config_engine(config)]), timeout=LAUNCH_TIMEOUT_S)


def _config_engine(config: str) -> Engine:
    """The engine an accelerate YAML chooses (its ``distributed_type``)."""
    import yaml

    kind = yaml.safe_load((CONFIG_DIR / f"{config}.yaml").read_text())["distributed_type"]
    return {"DEEPSPEED": Engine.DEEPSPEED, "FSDP": Engine.FSDP2}.get(kind, Engine.DDP)


@pytest.fixture(scope="session")
def strategy_runs(tmp_path_factory: pytest.TempPathFactory) -> LaunchCache:
    return LaunchCache(
        tmp_path_factory.mktemp("strategies"), lambda key, wd, out: launch_strategy(CASES[key], wd, out)
    )


@pytest.fixture(scope="session")
def accelerate_runs(tmp_path_factory: pytest.TempPathFactory) -> LaunchCache:
    return LaunchCache(tmp_path_factory.mktemp("accelerate"), lambda key, wd, out: launch_accelerate_config(key, out))


def launch_user_script(strategy_name: str, workdir: Path, out: Path) -> None:
    """scripts/user_script_train.py on 2 CPU ranks under plain torchrun: no ACCELERATE_USE_CPU, no
    HF_DIST_FSDP_ON_CPU, only the script's own hf_dist calls."""
    env = {"ACCELERATE_USE_CPU": "0", "HF_DIST_FSDP_ON_CPU": "0"}  # cpu_env sets ACCELERATE_USE_CPU=1: undo it
    args = ["--strategy", strategy_name, "--output-dir", workdir / "run", "--out", out]
    torchrun(SCRIPTS / "user_script_train.py", args, env=env, timeout=LAUNCH_TIMEOUT_S, outputs=[workdir / "run", out])


@pytest.fixture(scope="session")
def user_script_runs(tmp_path_factory: pytest.TempPathFactory) -> LaunchCache:
    return LaunchCache(tmp_path_factory.mktemp("user_script"), launch_user_script)
