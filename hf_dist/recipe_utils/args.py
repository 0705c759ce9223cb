"""Recipe arguments: the command line parsed (:mod:`hf_dist.recipe_utils.flags` holds its dataclasses), and
``TrainingArguments`` with the strategy: the recipe's defaults, the plan, then the user's flags."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from dataclasses import fields
from typing import Any

from hf_dist.planning.request import PlanRequest
from hf_dist.recipe_utils.checks import check_engine_runs_here

STRATEGY_FLAGS = ("fsdp", "fsdp_config", "deepspeed")  # TrainingArguments flags that choose a strategy


# ---------------------------------------------------------------- arguments


def parse_recipe_args(
    types: tuple[type, ...],
    argv: list[str] | None,
    *,
    embedded_defaults: dict[str, Any],
    real_defaults: dict[str, Any],
):
    """Parse recipe dataclasses plus every ``TrainingArguments`` flag.

    Returns ``(*instances, training_kwargs, explicit)``: ``training_kwargs`` holds the
    TrainingArguments values someone chose: the user's flags, and the recipe's ``embedded_defaults``
    without ``--model_name_or_path``, else ``real_defaults``, where the user gave no flag (transformers'
    own defaults are left out, so the plan can choose those values); and
    ``explicit`` the names the user set on the command line, which always win over the plan.
    """
    from transformers import HfArgumentParser, TrainingArguments

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _refusing(HfArgumentParser((*types, TrainingArguments)))
    namespace = vars(parser.parse_args(argv))
    explicit = set(vars(_suppressed_parser(types).parse_args(argv)))
    instances = []
    for cls in types:
        names = {f.name for f in fields(cls) if f.init}
        instances.append(cls(**{k: v for k, v in namespace.items() if k in names}))
    train_names = {f.name for f in fields(TrainingArguments) if f.init}
    # only choices someone made: the user's flags, then the recipe's defaults; TrainingArguments fills the rest
    training_kwargs = {k: v for k, v in namespace.items() if k in train_names and k in explicit}
    embedded = namespace.get("model_name_or_path") is None
    defaults = embedded_defaults if embedded else real_defaults
    training_kwargs.update({k: v for k, v in defaults.items() if k not in explicit})
    _interval_strategies(training_kwargs, explicit)
    quiet_progress_bars(embedded=embedded)
    return (*instances, training_kwargs, explicit)


# "--save_steps N" does something only under save_strategy "steps" (likewise evaluation), which a recipe default may
# have turned off (the embedded default saves only at the end): a flag the user gave is never silently dropped
INTERVAL_FLAGS = {"save_steps": "save_strategy", "eval_steps": "eval_strategy"}


def _interval_strategies(training_kwargs: dict[str, Any], explicit: set[str]) -> None:
    """``--save_steps``/``--eval_steps`` without their ``--..._strategy``: the strategy becomes ``steps``; with
    another strategy given, the flag would be ignored and the contradiction is refused."""
    for steps, strategy in INTERVAL_FLAGS.items():
        if steps not in explicit:
            continue
        if strategy not in explicit:
            training_kwargs[strategy] = "steps"
            continue
        chosen = getattr(training_kwargs[strategy], "value", training_kwargs[strategy])
        if chosen != "steps":
            given = training_kwargs[steps]
            given = f"{given:g}" if isinstance(given, float) else given
            raise ValueError(
                f"--{steps} {given} has no effect with --{strategy} {chosen}: pass --{strategy} steps (or leave it "
                f"out), or drop --{steps}"
            )


def _refusing(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` raising a ValueError for a command line it refuses (a refusal the recipe reports once), instead of
    printing its usage from every rank and exiting."""

    def error(message: str) -> None:
        raise ValueError(f"{message} (see --help for every flag)")

    parser.error = error  # type: ignore[method-assign]
    return parser


def quiet_progress_bars(*, embedded: bool) -> None:
    """One progress bar per run: the Trainer's, on the main process.

    Every rank would draw its own bar for tokenizing (datasets), downloading (hub) and writing or loading
    shards (transformers), interleaved with the training bar. Other ranks never draw them; the main
    process keeps them for real models and data, where they take long enough to be worth watching.
    """
    if not embedded and os.environ.get("RANK", "0") == "0":
        return
    import huggingface_hub.utils
    import transformers.utils.logging

    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()
    try:
        import datasets
    except ImportError:  # the `data` extra is optional
        return
    datasets.disable_progress_bars()


def _suppressed_parser(types: tuple[type, ...]) -> argparse.ArgumentParser:
    """The same parser with every default suppressed: its namespace holds only flags given explicitly."""
    from transformers import HfArgumentParser, TrainingArguments

    parser = _refusing(HfArgumentParser((*types, TrainingArguments)))
    for action in parser._actions:
        if action.dest != "help":
            action.default = argparse.SUPPRESS
            action.required = False
    return parser


def training_arguments(
    training_kwargs: dict[str, Any],
    explicit: set[str],
    model: Any,
    request: PlanRequest,
    *,
    deepspeed_on_cpu: bool = False,
    nvme_path: str | None = None,
):
    """``TrainingArguments`` = recipe defaults < ``hf_dist.auto_args`` (the plan of ``request``) < explicit user flags.

    ``request``: what the recipe's flags ask the plan for (:meth:`~hf_dist.recipe_utils.flags.ModelArguments.
    plan_request`: ``--strategy``, the ``--tp_size``/``--cp_size``/``--sp_size``/``--offload``/``--offload_device``
    pins, the method, sequence length and LoRA); the micro batch of ``training_kwargs`` is pinned in it here.
    The plan is skipped when the user chose the strategy with ``--fsdp``/``--deepspeed`` or an accelerate
    FSDP/DeepSpeed config; the sizes asked for must then be the ones that config runs.
    ``nvme_path`` (``--nvme_path``): ZeRO-Infinity's swap folder when the plan offloads to NVMe.
    ``deepspeed_on_cpu`` (the recipes' ``--deepspeed_on_cpu``, tests and CPU development only) lets a
    DeepSpeed run count every CPU rank (:func:`hf_dist.runtime.cpu_fsdp.cpu_deepspeed_training_kwargs`);
    without it DeepSpeed on several CPU ranks is refused here, before DeepSpeed's own batch-size error.
    """

    from hf_dist.runtime.launch import check_one_process_launch

    check_one_process_launch()  # also when the user's own config skips the plan
    kwargs = dict(training_kwargs)
    if not (explicit & set(STRATEGY_FLAGS)) and not _accelerate_config_strategy():
        import hf_dist

        planned = hf_dist.auto_args(
            model, with_batch(request, kwargs, explicit), engine_on_cpu=deepspeed_on_cpu, nvme_path=nvme_path
        )  # --fsdp_on_cpu turned FSDP on already (cpu_test_modes)
        kwargs.update({k: v for k, v in planned.items() if k not in explicit})
    if kwargs.get("deepspeed") and not _has_accelerator() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        kwargs.update(_deepspeed_on_cpu_kwargs(deepspeed_on_cpu))
    if "dataloader_pin_memory" not in explicit and not _has_accelerator():
        kwargs["dataloader_pin_memory"] = False  # pinning needs a GPU; on CPU torch warns from every DataLoader
    sizes = {name: getattr(request, name) for name in ("tp_size", "cp_size", "sp_size")}
    return _built(kwargs, sizes, explicit)


def _built(kwargs: dict[str, Any], sizes: dict[str, int | None], explicit: set[str]) -> Any:
    """``TrainingArguments(**kwargs)``, checked: the sizes asked for honoured, the engine one these ranks run, the
    output folder claimed for this job."""
    from transformers import TrainingArguments

    from hf_dist.checkpoint.output.lock import claim_output_dir
    from hf_dist.configs.fsdp import apply_fp32_reduce

    # FSDP2 + bf16/fp16: reduce gradients in fp32 (a no-op for every other setup)
    args = apply_fp32_reduce(TrainingArguments(**kwargs))
    _check_sizes_honoured(args, sizes, explicit)
    check_engine_runs_here(args, has_accelerator=_has_accelerator())  # before accelerate drops or refuses it
    claim_output_dir(args.output_dir)  # one live job per output folder, refused before any model is built
    if not args.deepspeed and os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() not in ("1", "true"):
        _no_deepspeed_in_unwrap()
    return args


def with_batch(request: PlanRequest, kwargs: dict[str, Any], explicit: set[str]) -> PlanRequest:
    """``request`` with the micro batch of ``kwargs`` (a user flag or a recipe default), when set, pinned."""
    if "per_device_train_batch_size" not in kwargs:
        return request
    return dataclasses.replace(request, **_batch_kwargs(kwargs["per_device_train_batch_size"], explicit, request))


def _batch_kwargs(micro_batch: int, explicit: set[str], request: PlanRequest) -> dict[str, int]:
    """The planner's batch keywords for a micro batch the user (in ``explicit``) or the recipe's defaults chose.

    A recipe default means that many sequences per data-parallel rank. Where the pinned layout runs only smaller
    micro-batches (Ulysses SP on CPU ranks: 1, :func:`hf_dist.planning.model_parallel.micro_batch_limit`), it
    becomes that global batch, which gradient accumulation then makes up. The user's own micro batch (or
    accumulation) stays pinned: the plan refuses a micro batch the layout cannot run, with the arithmetic.
    """
    from hf_dist.planning.model_parallel import micro_batch_limit

    limit = micro_batch_limit("cuda" if _has_accelerator() else "cpu", request.sp_size or 1)
    users = explicit & {"per_device_train_batch_size", "gradient_accumulation_steps"}
    if users or limit is None or micro_batch <= limit[0]:
        return {"micro_batch_size": micro_batch}
    shared = math.prod(getattr(request, f"{n}_size") or 1 for n in ("tp", "cp", "sp"))
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world % shared:  # the plan refuses those sizes, naming them
        return {"micro_batch_size": micro_batch}
    return {"global_batch_size": micro_batch * (world // shared)}


def _deepspeed_on_cpu_kwargs(deepspeed_on_cpu: bool) -> dict[str, Any]:
    """DeepSpeed over several CPU ranks: refused unless ``--deepspeed_on_cpu``, then the kwargs that make it count
    every rank."""
    if not deepspeed_on_cpu:
        raise ValueError(
            "DeepSpeed on CPU ranks: accelerate would count one rank and DeepSpeed's batch check fail; pass "
            "--deepspeed_on_cpu (tests and CPU development only) or train on GPUs"
        )
    from hf_dist.runtime.cpu_fsdp import cpu_deepspeed_training_kwargs

    return cpu_deepspeed_training_kwargs()


def _check_sizes_honoured(args: Any, sizes: dict[str, int | None], explicit: set[str]) -> None:
    """``--tp_size``/``--cp_size``/``--sp_size`` next to the user's own ``--deepspeed``/``--fsdp`` config: the config
    decides what runs, so a size it does not carry is refused instead of silently dropped."""
    from hf_dist.runtime.dist import deepspeed_config, parallel_sizes

    running = parallel_sizes(getattr(args, "parallelism_config", None), deepspeed_config(args))
    wrong = {n: v for n, v in sizes.items() if v is not None and running[n.removesuffix("_size")] != v}
    if wrong:
        given = " ".join(f"--{k} {v}" for k, v in wrong.items())
        runs = ", ".join(f"{k.removesuffix('_size')} {running[k.removesuffix('_size')]}" for k in wrong)
        chosen = sorted(explicit & set(STRATEGY_FLAGS)) or ["an accelerate config"]
        raise ValueError(
            f"{given} asks for what your own strategy config ({', '.join(chosen)}) does not run ({runs}): the config "
            "decides the run. Put the size in it (e.g. `hf-dist config --strategy zero2 --tp-size 2 --format deepspeed "
            "--out ds.json` for DeepSpeed AutoTP), or drop the config and let the plan set both"
        )


def _has_accelerator() -> bool:
    import torch

    if hasattr(torch, "accelerator"):
        return torch.accelerator.is_available()
    return torch.cuda.is_available()


def _no_deepspeed_in_unwrap() -> None:
    """Keep a run without DeepSpeed from importing it.

    accelerate's ``extract_model_from_parallel`` (behind ``unwrap_model``, called from ``Trainer.__init__``)
    imports deepspeed whenever it is installed, only to recognise a ``DeepSpeedEngine``; that costs seconds
    and prints DeepSpeed's accelerator-detection warnings on every rank. A run that uses no DeepSpeed has no
    engine, and no engine can exist before deepspeed is imported: that one check is told deepspeed is
    available only once something has imported it, so a later DeepSpeed run in the same process still unwraps.
    """
    from accelerate.utils import other

    original = getattr(other, "is_deepspeed_available", None)
    if original is None or getattr(original, "_hf_dist_lazy", False):
        return

    def is_deepspeed_imported() -> bool:
        return "deepspeed" in sys.modules and original()

    is_deepspeed_imported._hf_dist_lazy = True  # type: ignore[attr-defined]
    other.is_deepspeed_available = is_deepspeed_imported


def _accelerate_config_strategy() -> bool:
    flags = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED")
    return any(os.environ.get(k, "").lower() in ("1", "true") for k in flags)
