"""``trace_memory``: the public entry point, and the worker process it runs the trace in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hf_dist.planning.lora import from_peft_model, is_peft_model
from hf_dist.planning.lora_plan import place, resolve, same_adapters
from hf_dist.planning.modelinfo import model_spec
from hf_dist.planning.remote_code import RemoteCodeError
from hf_dist.tracing.result import TraceError, TraceResult, TraceTimeout
from hf_dist.tracing.setup import TraceSetup, TraceUnsupported, check_traceable
from hf_dist.tracing.speed import DEFAULT_LIMIT_S, check_time_limit
from hf_dist.tracing.trace import trace_here

# the worker's start (importing torch, transformers, accelerate, peft) on top of the trace's own limit
STARTUP_ALLOWANCE_S = 60.0
# a launcher's variables would make the worker a rank of the caller's job
_LAUNCH_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
_LAUNCH_PREFIXES = ("ACCELERATE_", "FSDP_", "TORCHELASTIC_")
_ERRORS = {"TraceUnsupported": TraceUnsupported, "TraceError": TraceError, "ValueError": ValueError,
           "RemoteCodeError": RemoteCodeError}  # fmt: skip


def trace_memory(
    model: Any,
    plan: Any = None,
    *,
    candidate: Any = None,
    time_limit_s: float = DEFAULT_LIMIT_S,
    isolate: bool = True,
    trust_remote_code: bool = False,
    peft_config: Any = None,
    **setup: Any,
) -> TraceResult:
    """Trace rank 0's training memory of ``model`` laid out as ``plan`` (or one of its ``candidate`` alternatives).

    ``model``: a transformers config, config dict, local folder / config.json, hub name or ``nn.Module`` (its
    config is used: the trace builds its own weightless copy). Without a plan, ``setup`` takes
    :class:`TraceSetup`'s fields (``strategy=``, ``world_size=``, ``seq_len=``, ``micro_batch_size=``, ...); with
    one, they override the plan's. ``isolate`` runs the trace in a separate process (the default: the caller may
    be a rank with a real process group, and a hard limit can stop it); ``time_limit_s`` bounds it.

    LoRA: the plan's (``Plan.lora``), which must be a ``PeftModel``'s own when one is traced; without a plan, a
    ``PeftModel``'s config, ``peft_config`` (a PEFT ``LoraConfig``) or the ``lora_rank`` / ``lora_dropout`` /
    ``lora_targets`` keywords, resolved as :func:`hf_dist.plan` resolves them (:func:`hf_dist.planning.lora_plan.resolve`),
    and applied through PEFT's ``get_peft_model``: the traced adapters are the run's, dropout included.

    Raises :class:`TraceUnsupported` (a layout that cannot be traced; the message says which part and why),
    :class:`TraceTimeout` (past the limit; ``.partial`` is the peak of what ran, when the worker got that far),
    :class:`TraceError` (the model failed under the layout), ``ValueError`` (bad input: an unbuildable config, a
    world size the mesh cannot take; :class:`~hf_dist.planning.remote_code.RemoteCodeError` for a config whose
    causal LM is only the folder's ``auto_map`` code, unless ``trust_remote_code=True``).
    """
    config = _config_of(model, trust_remote_code)
    spec = _setup_of(model, plan, candidate, peft_config, setup)
    if spec.lora is not None:  # a target that matches nothing, or no linear, is refused here, by name
        place(model_spec(config, trust_remote_code=trust_remote_code), spec.lora)
    check_traceable(spec, config)
    time_limit_s = check_time_limit(time_limit_s)
    if not isolate:
        return trace_here(config, spec, time_limit_s=time_limit_s, trust_remote_code=trust_remote_code)
    return _run_worker(config, _code_folder(model, config, trust_remote_code), trust_remote_code, spec, time_limit_s)


_LORA_KEYWORDS = ("lora_rank", "lora_dropout", "lora_targets")


def _setup_of(model: Any, plan: Any, candidate: Any, peft_config: Any, setup: dict[str, Any]) -> TraceSetup:
    """The traced setup: the plan's (its LoRA checked against a PeftModel's own), or ``setup`` with its LoRA resolved
    from the model, ``peft_config`` and the LoRA keywords."""
    keywords = {k: setup.pop(k) for k in _LORA_KEYWORDS if k in setup}
    if plan is not None:
        if peft_config is not None or keywords:
            raise ValueError("trace_memory(model, plan) traces the plan's LoRA; pass peft_config / lora_* to plan()")
        traced = TraceSetup.from_plan(plan, candidate, **setup)
        own = from_peft_model(model) if is_peft_model(model) else None
        if own is not None and (traced.lora is None or not same_adapters(own, traced.lora, model_spec(model))):
            planned = traced.lora.describe() if traced.lora else "full fine-tuning"
            raise ValueError(
                f"the PeftModel's LoRA ({own.describe()}) is not the plan's ({planned}); plan the model itself: "
                "hf_dist.plan(peft_model, ...)"
            )
        return traced
    if "lora" not in setup:
        setup["method"], setup["lora"] = resolve(model, setup.get("method"), peft_config, **keywords)
    return TraceSetup(**setup)


def _config_of(model: Any, trust_remote_code: bool) -> Any:
    """The config to trace, refused before any process starts when it is no causal LM, or when its causal LM is the
    folder's ``auto_map`` code and ``trust_remote_code`` is False."""
    from hf_dist.planning.config_checks import check_dimensions
    from hf_dist.planning.model_source import check_causal_lm, resolve_config

    if hasattr(model, "config") and not isinstance(model, (str, dict)) and hasattr(model, "parameters"):
        config = model.config
        base = getattr(model, "get_base_model", None)
        config = base().config if callable(base) else config
    else:
        config = resolve_config(model, trust_remote_code=trust_remote_code)
    check_causal_lm(config, trust_remote_code=trust_remote_code)
    check_dimensions(config)
    return config


def _code_folder(model: Any, config: Any, trust_remote_code: bool) -> str | None:
    """Where the worker reads the config again: only for trusted ``auto_map`` code, which it must import itself;
    every other config travels as data (nothing of the folder is read)."""
    if not trust_remote_code or not getattr(config, "auto_map", None):
        return None
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model)
    return getattr(config, "_name_or_path", None) or None


def _run_worker(config: Any, source: str | None, trust_remote_code: bool, setup: TraceSetup, limit: float):
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES and not k.startswith(_LAUNCH_PREFIXES)}
    with tempfile.TemporaryDirectory(prefix="hf_dist_trace_") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(json.dumps({
            "config": config.to_dict(), "source": source,
            "trust_remote_code": trust_remote_code, "setup": setup.to_dict(), "time_limit_s": limit,
        }))  # fmt: skip
        command = [sys.executable, "-m", "hf_dist.tracing", str(request), str(result)]
        try:
            proc = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=limit + STARTUP_ALLOWANCE_S
            )
        except subprocess.TimeoutExpired:
            raise TraceTimeout(
                f"the trace of {setup.layout.describe()} did not finish within {limit + STARTUP_ALLOWANCE_S:g} s "
                "(its limit plus the worker's start) and was stopped; the analytic estimate stands"
            ) from None
        if not result.is_file():
            tail = " | ".join(proc.stderr.strip().splitlines()[-3:])[:500]
            raise TraceError(f"the trace worker exited with code {proc.returncode} and no result ({tail})")
        answer = json.loads(result.read_text())
    if "result" in answer:
        return TraceResult.from_dict(answer["result"])
    error = answer["error"]
    if error["type"] == "TraceTimeout":
        partial = error.get("partial")
        raise TraceTimeout(error["message"], TraceResult.from_dict(partial) if partial else None)
    if error["type"] == "TraceUnsupported":
        raise TraceUnsupported(error["message"], error.get("reason", ""))
    raise _ERRORS.get(error["type"], TraceError)(error["message"])


def worker_main(argv: list[str] | None = None) -> int:
    """Read a request, trace, write ``{"result": ...}`` or ``{"error": {type, message, partial}}`` atomically."""
    from hf_dist.atomic_io import atomic_write_json
    from hf_dist.planning.model_source import config_from_dict, resolve_config

    request_path, result_path = (argv or sys.argv[1:])[:2]
    request = json.loads(Path(request_path).read_text())
    try:
        if request.get("source"):
            config = resolve_config(request["source"], trust_remote_code=request["trust_remote_code"])
        else:
            config = config_from_dict(request["config"])
        answer = {"result": trace_here(config, TraceSetup.from_dict(request["setup"]),
                                       time_limit_s=request["time_limit_s"],
                                       trust_remote_code=request["trust_remote_code"]).to_dict()}  # fmt: skip
    except TraceTimeout as exc:
        answer = {"error": {"type": "TraceTimeout", "message": str(exc),
                            "partial": exc.partial.to_dict() if exc.partial else None}}  # fmt: skip
    except (TraceUnsupported, TraceError, ValueError) as exc:
        answer = {"error": {"type": type(exc).__name__, "message": str(exc), "reason": getattr(exc, "reason", "")}}
    atomic_write_json(result_path, answer)
    return 0
