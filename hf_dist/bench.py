"""Measure training throughput of each feasible strategy at 1 and N processes, next to the planner's pick.

Each (strategy, process count) runs a few ``Trainer`` steps in fresh processes launched with torchrun (the
same code path a user's run takes), timed after warm-up steps. The report prints samples/s, tokens/s and the
scaling efficiency ``throughput_N / (N * throughput_1)`` (weak scaling: the per-device batch is fixed), and
says where the planner's pick is not the fastest measured. ``write_autotune`` writes the accelerate config
of the fastest one.

    from hf_dist.bench import BenchConfig, run_bench
    report = run_bench(BenchConfig(nproc=8, model="meta-llama/Llama-3.1-8B", seq_len=2048))
    print(report.format())

The worker half of this module runs inside the launched processes (``python -m hf_dist.bench --worker``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hf_dist.planning.layout import REGISTRY, Layout
from hf_dist.planning.remote_code import RemoteCodeError
from hf_dist.runtime.launch import GLOO_ABORT

# strategies a single node can run; hsdp needs >= 2 nodes, which one bench run does not launch
SINGLE_NODE_STRATEGIES = tuple(name for name, s in REGISTRY.items() if s.min_nodes == 1)
PRECISIONS = ("auto", "bf16", "fp16", "no")


@dataclass(frozen=True)
class BenchConfig:
    """What to measure. ``model=None`` is a tiny Llama (hidden 64, 2 layers) that runs anywhere."""

    nproc: int = 2  # N: processes of the scaled run (GPUs on a GPU node)
    model: str | None = None  # local folder / config.json / hub name; only its config is used (random init)
    strategies: tuple[str, ...] | None = None  # None: the planner's fitting candidates
    steps: int = 5  # timed steps
    warmup: int = 2  # untimed steps first (allocation, autotuning, first all-gather)
    micro_batch_size: int = 4
    seq_len: int = 64
    mixed_precision: str = "auto"  # auto: bf16 on GPU, no (fp32) on CPU
    gpu_memory_gib: float | None = None  # for the planner; detected on GPU, 80 assumed on CPU
    timeout_s: float = 600.0  # per launch
    trust_remote_code: bool = False  # import the model config's auto_map code (hf_dist.planning.remote_code)

    def __post_init__(self) -> None:
        if self.nproc < 2:
            raise ValueError(f"nproc must be >= 2 to measure scaling (1 is always measured too), got {self.nproc}")
        for name in ("steps", "micro_batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.mixed_precision not in PRECISIONS:
            raise ValueError(f"mixed_precision {self.mixed_precision!r} is not one of {PRECISIONS}")
        unknown = [s for s in self.strategies or () if s not in SINGLE_NODE_STRATEGIES]
        if unknown:
            raise ValueError(
                f"cannot benchmark strategies {unknown} on one node; choose from {', '.join(SINGLE_NODE_STRATEGIES)}"
            )


@dataclass(frozen=True)
class Measurement:
    strategy: str
    nproc: int
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    step_s: float = 0.0
    error: str | None = None  # why the run failed (then the figures are 0)
    log_tail: str | None = None  # the failed launch's last output lines (in --json)
    wrapped: str = ""  # the model class the Trainer trained (proves the strategy ran: FSDP..., DeepSpeedEngine)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class BenchReport:
    config: BenchConfig
    device: str
    measurements: list[Measurement] = field(default_factory=list)
    planner_pick: str | None = None
    planner_note: str = ""

    def get(self, strategy: str, nproc: int) -> Measurement | None:
        return next((m for m in self.measurements if m.strategy == strategy and m.nproc == nproc), None)

    def efficiency(self, strategy: str) -> float | None:
        """throughput_N / (N * throughput_1) for ``strategy``; None when either run failed."""
        one, many = self.get(strategy, 1), self.get(strategy, self.config.nproc)
        if not (one and many and one.ok and many.ok and one.samples_per_s > 0):
            return None
        return many.samples_per_s / (self.config.nproc * one.samples_per_s)

    def fastest(self, nproc: int | None = None) -> Measurement | None:
        runs = [m for m in self.measurements if m.ok and m.nproc == (nproc or self.config.nproc)]
        return max(runs, key=lambda m: m.samples_per_s, default=None)

    def notes(self) -> list[str]:
        best = self.fastest()
        if best is None:
            return [f"no strategy ran at {self.config.nproc} processes"]
        if self.planner_pick is None:
            return [f"fastest at {self.config.nproc} processes: {best.strategy} ({self.planner_note})"]
        pick = self.get(self.planner_pick, self.config.nproc)
        if pick is None or not pick.ok:
            return [f"planner's pick {self.planner_pick} was not measured or failed; fastest is {best.strategy}"]
        if pick.strategy == best.strategy:
            return [f"planner's pick {pick.strategy} is the fastest measured"]
        gap = best.samples_per_s / pick.samples_per_s - 1
        return [
            f"planner's pick {pick.strategy} is not the fastest measured: {best.strategy} is {gap:.0%} faster "
            f"({best.samples_per_s:.1f} vs {pick.samples_per_s:.1f} samples/s); --autotune writes {best.strategy}"
        ]

    def format(self) -> str:
        n = self.config.nproc
        head = f"{'strategy':<20} {'procs':>5} {'samples/s':>10} {'tokens/s':>10} {'step s':>8} {'scaling':>8}  trained as"
        lines = [f"device: {self.device}  model: {self.config.model or 'tiny-llama'}  "
                 f"micro batch {self.config.micro_batch_size} x seq {self.config.seq_len}, "
                 f"{self.config.steps} timed steps after {self.config.warmup} warm-up", head, "-" * len(head)]  # fmt: skip
        for m in self.measurements:
            mark = " *" if m.strategy == self.planner_pick and m.nproc == n else ""
            if not m.ok:
                lines.append(f"{m.strategy:<20} {m.nproc:>5}  failed: {m.error}")
                continue
            eff = self.efficiency(m.strategy) if m.nproc == n else None
            eff_text = f"{eff:.0%}" if eff is not None else ""
            lines.append(
                f"{m.strategy:<20} {m.nproc:>5} {m.samples_per_s:>10.2f} {m.tokens_per_s:>10.0f} {m.step_s:>8.3f} "
                f"{eff_text:>8}  {m.wrapped}{mark}"
            )
        lines.append("scaling = throughput_N / (N * throughput_1);  * = planner's pick")
        return "\n".join(lines + self.notes())

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "device": self.device,
            "planner_pick": self.planner_pick,
            "measurements": [asdict(m) for m in self.measurements],
            "efficiency": {s: self.efficiency(s) for s in dict.fromkeys(m.strategy for m in self.measurements)},
            "fastest": self.fastest().strategy if self.fastest() else None,
            "notes": self.notes(),
        }


def run_bench(config: BenchConfig, *, progress: bool = True) -> BenchReport:
    """Plan, then measure every chosen strategy at 1 and ``config.nproc`` processes."""
    device = _device()
    pick, note, strategies = _planned_strategies(config, device)
    report = BenchReport(config, device, planner_pick=pick, planner_note=note)
    runs = [(s, n) for s in strategies for n in (1, config.nproc)]
    from tqdm.auto import tqdm

    bar = tqdm(runs, desc="hf-dist bench", disable=not progress or not sys.stderr.isatty())
    for strategy, nproc in bar:
        bar.set_postfix_str(f"{strategy} x{nproc}")
        report.measurements.append(measure(config, strategy, nproc, device))
    return report


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _planned_strategies(config: BenchConfig, device: str) -> tuple[str | None, str, list[str]]:
    """(planner's pick, a note, strategies to run): fitting candidates without offload, in planner order."""
    from hf_dist.planning.planner import plan

    memory = config.gpu_memory_gib or (None if device == "cuda" else 80.0)
    try:
        result = plan(
            _model_config(config),
            gpus=config.nproc,
            gpu_memory_gib=memory,
            seq_len=config.seq_len,
            micro_batch_size=config.micro_batch_size,
            trust_remote_code=config.trust_remote_code,
        )
    except RemoteCodeError:
        raise
    except ValueError as exc:  # PlanError: nothing fits; the user's explicit list may still be measured
        if not config.strategies:
            raise ValueError(
                f"the planner found no feasible strategy ({exc}); pass --strategies to force some"
            ) from exc
        return None, f"planner: {exc}", list(config.strategies)
    fitting = [c.strategy for c in result.candidates if c.fits and c.offload == "none"]
    ordered = list(dict.fromkeys(fitting))
    if config.strategies:
        ordered = [s for s in config.strategies if s in ordered] + [s for s in config.strategies if s not in ordered]
    return result.strategy, f"planner picked {result.strategy}", [s for s in ordered if s in SINGLE_NODE_STRATEGIES]


def _model_config(config: BenchConfig) -> Any:
    if config.model is None:
        from hf_dist.embedded.model import tiny_llama_config

        return tiny_llama_config()
    from hf_dist.planning.model_source import resolve_config

    return resolve_config(config.model, trust_remote_code=config.trust_remote_code)


def measure(config: BenchConfig, strategy: str, nproc: int, device: str) -> Measurement:
    """Launch ``nproc`` processes with torchrun running the worker; return its figures or the failure."""
    first = _measure_once(config, strategy, nproc, device)
    if device == "cpu" and first.error is not None and first.error.startswith(GLOO_ABORT):
        return _measure_once(config, strategy, nproc, device)  # gloo's rare abort of a CPU rank: once more
    return first


def _measure_once(config: BenchConfig, strategy: str, nproc: int, device: str) -> Measurement:
    from hf_dist.runtime.launch import cpu_env, free_port

    with tempfile.TemporaryDirectory(prefix="hf-dist-bench-") as tmp:
        result = Path(tmp) / "result.json"
        worker = ["--worker", "--strategy", strategy, "--out", str(result), "--config", json.dumps(asdict(config))]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "hf_dist.bench", *worker]  # fmt: skip
        env = _launch_env(strategy, device, cpu_env if device == "cpu" else None)
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=config.timeout_s, cwd=tmp)
        except subprocess.TimeoutExpired:
            return Measurement(strategy, nproc, error=f"timed out after {config.timeout_s:.0f}s")
        if proc.returncode != 0 or not result.is_file():
            log = proc.stdout + proc.stderr
            tail = "\n".join(log.strip().splitlines()[-40:])
            error = f"{GLOO_ABORT} (gloo's rare abort of a rank)" if GLOO_ABORT in log else _last_error(log)
            return Measurement(strategy, nproc, error=error, log_tail=tail)
        return Measurement(strategy, nproc, **json.loads(result.read_text()))


def _launch_env(strategy: str, device: str, cpu_env: Any) -> dict[str, str]:
    env = cpu_env() if cpu_env else dict(os.environ)
    if REGISTRY[strategy].is_deepspeed:
        env["ACCELERATE_USE_CPU"] = "0"  # accelerate drops DeepSpeed when forced onto CPU; DS falls back to gloo
    return env


def _last_error(log: str) -> str:
    """The root cause in a failed launch's output: the last exception line (``RuntimeError: ...``), else the
    last line mentioning an error, else the last line, skipping torchrun's own summary (``error_file: <N/A>``)."""
    boilerplate = ("error_file:", "traceback :", "root cause", "failures:")
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(boilerplate) and "ChildFailedError" not in ln] or lines
    exceptions = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt): *\S", ln)]
    mentions = [ln for ln in lines if "rror" in ln]
    return ((exceptions or mentions or lines or ["no output"])[-1])[:300]


def write_autotune(report: BenchReport, path: str | Path, *, force: bool = False) -> Path:
    """Write the accelerate config of the fastest measured strategy at N processes (atomically)."""
    from hf_dist.configs.accelerate import accelerate_config, write_yaml

    best = report.fastest()
    if best is None:
        raise RuntimeError(f"no strategy ran at {report.config.nproc} processes; nothing to write to {path}")
    precision = _precision(report.config.mixed_precision, report.device)
    cfg = accelerate_config(best.strategy, num_processes=report.config.nproc, mixed_precision=precision)
    header = (
        f"{Path(path).name}: fastest strategy measured by `hf-dist bench --autotune`: {best.strategy}, "
        f"{best.samples_per_s:.2f} samples/s on {report.config.nproc} x {report.device}\n"
        f"Launch: accelerate launch --config_file {path} train.py"
    )
    return write_yaml(cfg, path, header=header, force=force)


def _precision(requested: str, device: str) -> str:
    if requested != "auto":
        return requested
    return "bf16" if device == "cuda" else "no"


# ----------------------------------------------------------------------------------------------------------
# worker: runs inside each launched process


def strategy_kwargs(strategy: str, model: Any, precision: str, device: str) -> dict[str, Any]:
    """TrainingArguments kwargs for ``strategy`` on this process's world, from the shared emitter."""
    from hf_dist.configs.training_args import strategy_args
    from hf_dist.planning.features import installed_features
    from hf_dist.planning.wrap import fsdp_wrap_classes

    layout = Layout(strategy, int(os.environ.get("WORLD_SIZE", "1")), mixed_precision=precision)
    wrap = fsdp_wrap_classes(model) if layout.strategy.is_fsdp else None
    # cpu_ram_efficient_loading broadcasts from a device, which CPU ranks do not have
    return strategy_args(
        layout, features=installed_features(), wrap_classes=wrap, cpu_ram_efficient_loading=device != "cpu"
    )


def _worker(argv: list[str]) -> None:
    args, config = _worker_args(argv)

    import torch
    from transformers import Trainer, TrainingArguments

    from hf_dist.planning.model_source import causal_lm_from_config
    from hf_dist.runtime.dist import shutdown

    device = _device()
    cpu_kwargs = _cpu_training_kwargs(args.strategy, device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    precision = _precision(config.mixed_precision, device)
    torch.manual_seed(0)
    model = causal_lm_from_config(_model_config(config), trust_remote_code=config.trust_remote_code)
    steps = config.warmup + config.steps
    data = torch.randint(0, model.config.vocab_size, (config.micro_batch_size * world * steps, config.seq_len))
    dataset = [{"input_ids": row, "labels": row} for row in data]
    marks: dict[str, float] = {}
    training_args = TrainingArguments(
        output_dir=str(Path(args.out).parent / "trainer"),
        per_device_train_batch_size=config.micro_batch_size,
        max_steps=steps,
        save_strategy="no",
        logging_strategy="no",
        report_to=[],
        **cpu_kwargs,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        dataloader_num_workers=0,
        disable_tqdm=True,
        **strategy_kwargs(args.strategy, model, precision, device),
    )
    timer = _step_timer(config.warmup, steps, marks)
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, callbacks=[timer])
    trainer.train()
    if trainer.is_world_process_zero():
        _write_result(args.out, config, world, marks["end"] - marks["start"], type(trainer.model_wrapped).__name__)
    shutdown()


def _worker_args(argv: list[str]) -> tuple[argparse.Namespace, BenchConfig]:
    """The worker's command line: the strategy to time, where to write the result, the run's BenchConfig as JSON."""
    parser = argparse.ArgumentParser(prog="hf_dist.bench --worker")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    raw = json.loads(args.config)
    raw["strategies"] = tuple(raw["strategies"]) if raw.get("strategies") else None
    return args, BenchConfig(**raw)


def _cpu_training_kwargs(strategy: str, device: str) -> dict[str, Any]:
    """``use_cpu`` (and for DeepSpeed on CPU, the kwargs that keep it); FSDP enabled on CPU first."""
    if device == "cpu":
        from hf_dist.runtime.cpu_fsdp import cpu_deepspeed_training_kwargs, enable_fsdp_on_cpu

        enable_fsdp_on_cpu()
    if device == "cpu" and REGISTRY[strategy].is_deepspeed:
        cpu_kwargs = cpu_deepspeed_training_kwargs()  # accelerate drops DeepSpeed when cpu=True
        cpu_kwargs.setdefault("use_cpu", False)
        return cpu_kwargs
    return {"use_cpu": device == "cpu"}


def _step_timer(warmup: int, steps: int, marks: dict[str, float]) -> Any:
    """A TrainerCallback that records in ``marks`` when step ``warmup`` starts and step ``steps`` ends."""
    import torch
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def _now(self) -> float:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_step_begin(self, a, state, control, **kw):
            if state.global_step == warmup:
                marks["start"] = self._now()

        def on_step_end(self, a, state, control, **kw):
            if state.global_step == steps:
                marks["end"] = self._now()

    return Timer()


def _write_result(out: str, config: BenchConfig, world: int, elapsed: float, wrapped: str) -> None:
    """Rank 0's throughput over the timed steps, as JSON at ``out``."""
    samples = config.steps * config.micro_batch_size * world
    result = {
        "samples_per_s": samples / elapsed,
        "tokens_per_s": samples * config.seq_len / elapsed,
        "step_s": elapsed / config.steps,
        "wrapped": wrapped,
    }
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    if "--worker" not in sys.argv[1:]:
        raise SystemExit("hf_dist.bench is run by `hf-dist bench`; this entry point is its per-process worker")
    _worker(sys.argv[1:])
