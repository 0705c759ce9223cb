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
RUN_TIMEOUT_S = 120  # each further run of a shared launch (scripts/runs.py): seconds of the tiny model on 2 ranks


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
    """One Trainer run of tests/distributed/scripts/strategies_train.py (or, ``script=``, another script's)."""

    name: str
    strategy: str  # "none" = single process, no distributed wrapper
    offload: str = "none"
    extra: tuple[str, ...] = ()  # more flags of strategies_train.py (micro-batch, accumulation, sync_each_batch)
    script: str = "strategies_train"

    @property
    def nproc(self) -> int:
        return 1 if self.strategy == "none" else NPROC

    @property
    def group(self) -> str:
        """The launch this run shares: one per engine (scripts/runs.py); a single process alone."""
        return self.name if self.strategy == "none" else strategy(self.strategy).engine.value

    def argv(self, workdir: Path, out: Path) -> list[str]:
        args = ["--strategy", self.strategy, "--output-dir", workdir / "run", "--out", out]
        if self.script == "strategies_train":
            args += ["--offload", self.offload, "--steps", TRAIN_STEPS, *self.extra]
        return [self.script, *map(str, args)]


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
# test_packing.py's runs: variable-length sequences packed into one global batch of rows (every step sees them all,
# so every layout's loss equals one process's), and the same sequences padded in one process
PACKED_STRATEGIES = ("ddp", "fsdp_full_shard", "zero1", "zero2", "zero3")
CASES.update(
    {
        "packed_baseline": StrategyCase("packed_baseline", "none", extra=("--data", "packed")),
        "padded_baseline": StrategyCase("padded_baseline", "none", extra=("--data", "padded", "--micro-batch", "4")),
        **{f"packed_{s}": StrategyCase(f"packed_{s}", s, extra=("--data", "packed")) for s in PACKED_STRATEGIES},
    }
)
# test_precision.py's runs (scripts/precision_train.py: a bf16-loaded model, default and pure bf16), in the same
# launches as the strategies of their engine
PRECISION_STRATEGIES = ("ddp", "fsdp_full_shard", "zero1", "zero2", "zero3")
CASES.update(
    {f"precision_{s}": StrategyCase(f"precision_{s}", s, script="precision_train") for s in PRECISION_STRATEGIES}
)


@dataclass(frozen=True)
class Run:
    """One run of a launch: its name, and its own folder where its report goes."""

    key: str
    workdir: Path

    @property
    def out(self) -> Path:
        return self.workdir / "report.json"


class LaunchCache:
    """Runs each keyed run at most once per session and returns its JSON report.

    ``group(key)`` names the launch a run shares with others (scripts/runs.py runs them one after another in the same
    ranks): the first ``get`` of any of them launches them all. A failed launch is cached for every run in it, so the
    dependent tests fail fast with the launcher's output instead of relaunching.
    """

    def __init__(
        self,
        root: Path,
        launch: Callable[[list[Run]], None],
        members: Callable[[str], tuple[str, ...]] = lambda key: (key,),
    ) -> None:
        self.root = root
        self._launch = launch
        self._members = members
        self._results: dict[str, dict | BaseException] = {}

    def get(self, key: str) -> dict:
        if key not in self._results:
            keys = self._members(key)
            try:
                self._results.update(retry_gloo_abort(lambda attempt: self._run(keys, attempt)))
            except Exception as exc:  # cached so dependent tests fail fast with the same output
                self._results.update(dict.fromkeys(keys, exc))
        result = self._results[key]
        if isinstance(result, BaseException):
            raise RuntimeError(f"launch of {key!r} failed (cached): {result}") from result
        return result

    def _run(self, keys: tuple[str, ...], attempt: int) -> dict[str, dict]:
        runs = [Run(key, self.root / (key if attempt == 0 else f"{key}-retry{attempt}")) for key in keys]
        for run in runs:  # a retry starts afresh
            run.workdir.mkdir(parents=True)
        start = time.perf_counter()
        self._launch(runs)
        seconds = round(time.perf_counter() - start, 1)
        return {run.key: {**json.loads(run.out.read_text()), "launch_seconds": seconds, "workdir": str(run.workdir)}
                for run in runs}  # fmt: skip


def launch_strategies(runs: list[Run]) -> None:
    """The runs of one group: the single-process baseline as a plain process, the others in one 2-rank launch."""
    cases = [CASES[run.key] for run in runs]
    if cases[0].nproc == 1:
        # One process, accumulation 2 == two ranks, accumulation 1 (same samples per optimizer step).
        ((run, case),) = zip(runs, cases, strict=True)
        script, *args = case.argv(run.workdir, run.out)
        accumulation = [] if "--grad-accum" in case.extra else ["--grad-accum", "2"]
        cmd = [sys.executable, str(SCRIPTS / f"{script}.py"), *args, *accumulation]
        run_checked(cmd, env=cpu_env(), timeout=LAUNCH_TIMEOUT_S)
        return
    env = launch_env(cases[0].strategy)
    if (
        cases[0].group == Engine.DDP.value
    ):  # plain torchrun, no ACCELERATE_USE_CPU: auto_args' use_cpu makes it one job
        env = {**env, "ACCELERATE_USE_CPU": "0"}
    torchrun_runs([case.argv(run.workdir, run.out) for case, run in zip(cases, runs, strict=True)],
                  runs[0].workdir / "runs.json", env=env, outputs=[run.workdir for run in runs])  # fmt: skip


def torchrun_runs(runs: list[list[str]], spec: Path, *, env: dict[str, str], outputs: list[Path], nproc: int = NPROC):
    """One 2-rank launch of scripts/runs.py running each ``[script, *argv]`` in turn; its limit grows with the runs."""
    spec.write_text(json.dumps(runs))
    timeout = LAUNCH_TIMEOUT_S + RUN_TIMEOUT_S * (len(runs) - 1)
    torchrun(SCRIPTS / "runs.py", [str(spec)], nproc=nproc, env=env, timeout=timeout, outputs=[spec, *outputs])


def members_of_group(key: str) -> tuple[str, ...]:
    return tuple(name for name, case in CASES.items() if case.group == CASES[key].group)


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
    """test_strategies.py's and test_precision.py's runs, one launch per engine."""
    return LaunchCache(tmp_path_factory.mktemp("strategies"), launch_strategies, members_of_group)


def _single(launch: Callable[[str, Path, Path], None]) -> Callable[[list[Run]], None]:
    def run_one(runs: list[Run]) -> None:
        (run,) = runs
        launch(run.key, run.workdir, run.out)

    return run_one


@pytest.fixture(scope="session")
def accelerate_runs(tmp_path_factory: pytest.TempPathFactory) -> LaunchCache:
    return LaunchCache(
        tmp_path_factory.mktemp("accelerate"), _single(lambda key, wd, out: launch_accelerate_config(key, out))
    )


def launch_user_script(strategy_name: str, workdir: Path, out: Path) -> None:
    """scripts/user_script_train.py on 2 CPU ranks under plain torchrun: no ACCELERATE_USE_CPU, no
    HF_DIST_FSDP_ON_CPU, only the script's own hf_dist calls."""
    env = {"ACCELERATE_USE_CPU": "0", "HF_DIST_FSDP_ON_CPU": "0"}  # cpu_env sets ACCELERATE_USE_CPU=1: undo it
    args = ["--strategy", strategy_name, "--output-dir", workdir / "run", "--out", out]
    torchrun(SCRIPTS / "user_script_train.py", args, env=env, timeout=LAUNCH_TIMEOUT_S, outputs=[workdir / "run", out])


@pytest.fixture(scope="session")
def user_script_runs(tmp_path_factory: pytest.TempPathFactory) -> LaunchCache:
    return LaunchCache(tmp_path_factory.mktemp("user_script"), _single(launch_user_script))
