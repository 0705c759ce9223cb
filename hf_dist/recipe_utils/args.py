"""Recipe arguments: the dataclasses behind the command line, parsing, and TrainingArguments with the strategy."""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, field, fields
from typing import Any

from hf_dist.planning.layout import STRATEGIES
from hf_dist.planning.lora import DEFAULT_TARGETS, RECIPE_ALPHA, RECIPE_DROPOUT, RECIPE_RANK
from hf_dist.recipe_utils.checks import check_engine_runs_here

LLAMA_LORA_TARGETS = DEFAULT_TARGETS  # every linear of a Llama block: the LoRA hf_dist plans unless told otherwise
STRATEGY_CHOICES = STRATEGIES  # the registry's user-facing names
STRATEGY_FLAGS = ("fsdp", "fsdp_config", "deepspeed")  # TrainingArguments flags that choose a strategy


# The schedule every recipe uses on the embedded tiny model and task (recipes override a few keys).
EMBEDDED_TRAINING_DEFAULTS = dict(
    max_steps=600,
    per_device_train_batch_size=16,
    learning_rate=3e-3,
    warmup_steps=20,
    lr_scheduler_type="linear",
    weight_decay=0.0,
    logging_steps=50,
    save_strategy="no",
    report_to="none",
    seed=42,
)
# What every recipe uses on a real model and real data (recipes override a few keys, e.g. the learning rate).
REAL_TRAINING_DEFAULTS = dict(
    num_train_epochs=1,
    warmup_steps=0.03,
    lr_scheduler_type="cosine",
    logging_steps=10,
    save_strategy="steps",
    save_steps=500,
    save_total_limit=2,
    report_to="none",
)


@dataclass
class RunArguments:
    """What a run does besides training: its CPU test mode and the checks of its export."""

    fsdp_on_cpu: bool = field(
        default=False,
        metadata={
            "help": "Tests and CPU development only: let accelerate run FSDP2 on CPU ranks, which it otherwise "
            "silently replaces with DDP (hf_dist.runtime.cpu_fsdp.enable_fsdp_on_cpu). Never needed on GPUs."
        },
    )
    model_parallel_on_cpu: bool = field(
        default=False,
        metadata={
            "help": "Tests and CPU development only: let accelerate accept a ParallelismConfig (--tp_size, "
            "--sp_size) on CPU ranks, which it otherwise refuses "
            "(hf_dist.runtime.cpu_fsdp.allow_parallelism_config_on_cpu). Never needed on GPUs."
        },
    )
    deepspeed_on_cpu: bool = field(
        default=False,
        metadata={
            "help": "Tests and CPU development only: let DeepSpeed count every CPU rank (gloo), which accelerate "
            "does not set up on CPU (hf_dist.runtime.cpu_fsdp.cpu_deepspeed_training_kwargs). Never needed on GPUs."
        },
    )
    async_save: bool = field(
        default=False,
        metadata={
            "help": "Write checkpoints in the background: each save stages the state to host memory and training "
            "goes on while a thread writes checkpoint-N/ (hf_dist.callbacks.attach(trainer, async_save=True)); the "
            "plan counts the staging copy in host RAM. DeepSpeed saves synchronously."
        },
    )
    check_export: bool = field(
        default=False,
        metadata={
            "help": "Reload the export with from_pretrained and generate a sample from it. Always on for the "
            "embedded task, which also scores exact-match accuracy before and after training."
        },
    )


@dataclass
class ModelArguments:
    """Which model to train. Without ``--model_name_or_path`` a tiny Llama is built from a config."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Hub name or local folder; omit to train the embedded tiny Llama."}
    )
    tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "Defaults to the model's."})
    torch_dtype: str = field(default="auto", metadata={"help": "auto | bfloat16 | float16 | float32"})
    attn_implementation: str | None = field(default=None, metadata={"help": "e.g. sdpa, flash_attention_2"})
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "Import the modelling code the model config's auto_map names (files in its folder or hub repo); "
            "only for a model you trust. Without it that code never runs: a registered model_type is built with "
            "transformers' own class, any other is refused."
        },
    )
    tiny_hidden_size: int = field(default=128, metadata={"help": "Embedded model only: hidden size."})
    tiny_num_layers: int = field(default=2, metadata={"help": "Embedded model only: decoder layers."})
    strategy: str | None = field(
        default=None,
        metadata={"help": f"Force a strategy ({', '.join(STRATEGY_CHOICES)}); default: the plan's choice."},
    )

    tp_size: int | None = field(
        default=None, metadata={"help": "Tensor parallel size (inside a node; 1 = off); default: the plan's choice."}
    )
    cp_size: int | None = field(
        default=None, metadata={"help": "Context parallel size (FSDP2, GPUs); default: the plan's choice."}
    )
    sp_size: int | None = field(
        default=None, metadata={"help": "Ulysses sequence parallel size (DeepSpeed); default: the plan's choice."}
    )
    offload: str | None = field(
        default=None,
        metadata={"help": "Pin offload: none | optimizer | optimizer+params; default: the plan's choice."},
    )
    offload_device: str | None = field(
        default=None,
        metadata={
            "help": "Pin where offloaded states go: cpu | nvme (ZeRO-Infinity, with --nvme_path); default: searched."
        },
    )
    nvme_path: str | None = field(
        default=None,
        metadata={
            "help": "Folder on each node's local NVMe drive for ZeRO-Infinity's swap files (checked before training)."
        },
    )

    def __post_init__(self) -> None:
        for name in ("tp_size", "cp_size", "sp_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name} must be a positive int (1 = off), got {value}")
        if self.torch_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"--torch_dtype {self.torch_dtype!r} is not one of auto, bfloat16, float16, float32")
        if self.offload not in (None, "none", "optimizer", "optimizer+params"):
            raise ValueError(f"--offload {self.offload!r} is not one of none, optimizer, optimizer+params")
        if self.offload_device not in (None, "cpu", "nvme"):
            raise ValueError(f"--offload_device {self.offload_device!r} is not one of cpu, nvme")
        if self.strategy is not None and self.strategy not in STRATEGY_CHOICES:
            raise ValueError(f"--strategy {self.strategy!r} is not one of {list(STRATEGY_CHOICES)}")
        if self.tiny_hidden_size % 4 or self.tiny_hidden_size <= 0 or self.tiny_num_layers <= 0:
            raise ValueError(
                f"tiny model needs hidden size divisible by 4 heads and >= 1 layer, got "
                f"--tiny_hidden_size {self.tiny_hidden_size} --tiny_num_layers {self.tiny_num_layers}"
            )

    @property
    def embedded(self) -> bool:
        return self.model_name_or_path is None

    @property
    def sizes(self) -> dict[str, int | None]:
        """``--tp_size``/``--cp_size``/``--sp_size`` as planner keywords (None: the plan's choice)."""
        return {"tp_size": self.tp_size, "cp_size": self.cp_size, "sp_size": self.sp_size}

    @property
    def offloading(self) -> dict[str, str | None]:
        """``--offload``/``--offload_device``/``--nvme_path`` as ``auto_args`` keywords (None: the plan's choice)."""
        return {"offload": self.offload, "offload_device": self.offload_device, "nvme_path": self.nvme_path}


@dataclass
class DataArguments:
    """Which data. Without ``--dataset`` the embedded string-operation task is generated."""

    dataset: str | None = field(
        default=None, metadata={"help": "Local .jsonl/.json/.parquet/.csv file, folder of them, or save_to_disk dir."}
    )
    eval_dataset: str | None = field(default=None, metadata={"help": "Held-out data; default: split --dataset."})
    eval_fraction: float = field(default=0.02, metadata={"help": "Share of --dataset held out when no eval set."})
    max_seq_length: int | None = field(
        default=None, metadata={"help": "Tokens per example/block; default 64 embedded, else min(2048, positions)."}
    )
    packing: bool | None = field(
        default=None,
        metadata={
            "help": "Chat data: pack whole conversations into --max_seq_length rows (best-fit-decreasing; each "
            "attends only to itself, no label crosses a boundary) instead of padding each micro-batch to its "
            "longest. Default: on for --dataset, where the layout allows it (rank 0 says why not), off for the "
            "embedded task; true: refuse a layout or attention that cannot keep conversations apart; false: pad."
        },
    )
    document_attention: bool = field(
        default=False,
        metadata={
            "help": "Pretraining: each document packed into a block attends only to itself (position_ids restart "
            "at each document) instead of to the whole block."
        },
    )
    num_train_examples: int = field(default=4000, metadata={"help": "Embedded task: training examples."})
    num_eval_examples: int = field(default=100, metadata={"help": "Embedded task: eval examples (accuracy)."})

    def __post_init__(self) -> None:
        if self.max_seq_length is not None and self.max_seq_length < 8:
            raise ValueError(f"--max_seq_length {self.max_seq_length} is too short; use >= 8")
        if self.num_train_examples < 1 or self.num_eval_examples < 1:
            raise ValueError(
                f"--num_train_examples {self.num_train_examples} and --num_eval_examples "
                f"{self.num_eval_examples} must both be >= 1"
            )


@dataclass
class LoraArguments:
    """PEFT LoRA adapter settings; the default targets every linear layer of a Llama block."""

    lora_r: int = field(default=RECIPE_RANK, metadata={"help": "Adapter rank."})
    lora_alpha: int = field(default=int(RECIPE_ALPHA), metadata={"help": "Scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=RECIPE_DROPOUT, metadata={"help": "Dropout on the adapter input."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: list(LLAMA_LORA_TARGETS), metadata={"help": "Module names to adapt."}
    )

    def __post_init__(self) -> None:
        if self.lora_r <= 0 or self.lora_alpha <= 0 or not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(
                f"need --lora_r > 0, --lora_alpha > 0 and 0 <= --lora_dropout < 1, got "
                f"{self.lora_r}, {self.lora_alpha}, {self.lora_dropout}"
            )


@dataclass
class QuantArguments:
    """bitsandbytes 4-bit settings for QLoRA (defaults from the QLoRA paper: NF4, double quant)."""

    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "nf4 | fp4"})
    bnb_4bit_use_double_quant: bool = field(default=True, metadata={"help": "Quantize the quantization constants."})
    bnb_4bit_compute_dtype: str = field(default="bfloat16", metadata={"help": "bfloat16 | float16 | float32"})

    def __post_init__(self) -> None:
        if self.bnb_4bit_quant_type not in ("nf4", "fp4"):
            raise ValueError(f"--bnb_4bit_quant_type {self.bnb_4bit_quant_type!r} is not one of nf4, fp4")
        if self.bnb_4bit_compute_dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(
                f"--bnb_4bit_compute_dtype {self.bnb_4bit_compute_dtype!r} is not one of bfloat16, float16, float32"
            )


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
    *,
    method: str,
    seq_len: int,
    strategy: str | None,
    peft_config: Any = None,
    deepspeed_on_cpu: bool = False,
    sizes: dict[str, int | None] | None = None,
    async_save: bool = False,
    offloading: dict[str, str | None] | None = None,
    trust_remote_code: bool = False,
):
    """``TrainingArguments`` = recipe defaults < ``hf_dist.auto_args`` (the plan) < explicit user flags.

    The plan is skipped when the user chose the strategy with ``--fsdp``/``--deepspeed`` or an
    accelerate FSDP/DeepSpeed config; ``--strategy`` pins the plan's strategy instead.
    ``sizes``: the recipes' ``--tp_size``/``--cp_size``/``--sp_size`` (None: the plan searches them).
    ``peft_config``: the ``peft.LoraConfig`` the recipe will apply (``--lora_r``, ``--lora_alpha``, ``--lora_dropout``,
    ``--lora_target_modules``): the plan is made for that LoRA.
    ``async_save``: the plan counts the staging copy of background saves in host RAM. ``offloading``: the recipes'
    ``--offload``/``--offload_device``/``--nvme_path`` (None: the plan's choice).
    ``deepspeed_on_cpu`` (the recipes' ``--deepspeed_on_cpu``, tests and CPU development only) lets a
    DeepSpeed run count every CPU rank (:func:`hf_dist.runtime.cpu_fsdp.cpu_deepspeed_training_kwargs`);
    without it DeepSpeed on several CPU ranks is refused here, before DeepSpeed's own batch-size error.
    ``trust_remote_code`` (``--trust_remote_code``): the plan may import the model config's ``auto_map`` code.
    """
    from transformers import TrainingArguments

    from hf_dist.runtime.launch import check_one_process_launch

    check_one_process_launch()  # also when the user's own config skips the plan
    kwargs = dict(training_kwargs)
    if not (explicit & set(STRATEGY_FLAGS)) and not _accelerate_config_strategy():
        import hf_dist

        plan_kwargs = _plan_kwargs(kwargs, explicit, method, seq_len, strategy, peft_config, sizes, async_save,
                                   offloading)  # fmt: skip
        planned = hf_dist.auto_args(
            model, trust_remote_code=trust_remote_code, engine_on_cpu=deepspeed_on_cpu, **plan_kwargs
        )  # --fsdp_on_cpu turned FSDP on already (cpu_test_modes)
        kwargs.update({k: v for k, v in planned.items() if k not in explicit})
    if kwargs.get("deepspeed") and not _has_accelerator() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        kwargs.update(_deepspeed_on_cpu_kwargs(deepspeed_on_cpu))
    if "dataloader_pin_memory" not in explicit and not _has_accelerator():
        kwargs["dataloader_pin_memory"] = False  # pinning needs a GPU; on CPU torch warns from every DataLoader
    from hf_dist.configs.fsdp import apply_fp32_reduce

    # FSDP2 + bf16/fp16: reduce gradients in fp32 (a no-op for every other setup)
    args = apply_fp32_reduce(TrainingArguments(**kwargs))
    _check_sizes_honoured(args, sizes or {}, explicit)
    check_engine_runs_here(args, has_accelerator=_has_accelerator())  # before accelerate drops or refuses it
    from hf_dist.checkpoint.lifecycle.output_lock import claim_output_dir

    claim_output_dir(args.output_dir)  # one live job per output folder, refused before any model is built
    if not args.deepspeed and os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() not in ("1", "true"):
        _no_deepspeed_in_unwrap()
    return args


def _plan_kwargs(
    kwargs: dict[str, Any],
    explicit: set[str],
    method: str,
    seq_len: int,
    strategy: str | None,
    peft_config: Any,
    sizes: dict[str, int | None] | None,
    async_save: bool,
    offloading: dict[str, str | None] | None,
) -> dict[str, Any]:
    """``hf_dist.auto_args`` keywords for the recipe's flags; ``kwargs``' micro batch, when set, is pinned."""
    plan_kwargs: dict[str, Any] = {"method": method, "seq_len": seq_len, "strategy": strategy}
    plan_kwargs.update({k: v for k, v in (sizes or {}).items() if v is not None})  # --tp_size/--cp_size/--sp_size
    plan_kwargs.update({k: v for k, v in (offloading or {}).items() if v is not None})  # --offload, --nvme_path
    if method != "full" and peft_config is not None:
        plan_kwargs["peft_config"] = peft_config
    if async_save:
        plan_kwargs["async_save"] = True
    if "per_device_train_batch_size" in kwargs:  # a user flag or a recipe default pins the micro batch
        plan_kwargs.update(_batch_kwargs(kwargs["per_device_train_batch_size"], explicit, plan_kwargs))
    return plan_kwargs


def _batch_kwargs(micro_batch: int, explicit: set[str], plan_kwargs: dict[str, Any]) -> dict[str, int]:
    """The planner's batch keywords for a micro batch the user (in ``explicit``) or the recipe's defaults chose.

    A recipe default means that many sequences per data-parallel rank. Where the pinned layout runs only smaller
    micro-batches (Ulysses SP on CPU ranks: 1, :func:`hf_dist.planning.model_parallel.micro_batch_limit`), it
    becomes that global batch, which gradient accumulation then makes up. The user's own micro batch (or
    accumulation) stays pinned: the plan refuses a micro batch the layout cannot run, with the arithmetic.
    """
    from hf_dist.planning.model_parallel import micro_batch_limit

    limit = micro_batch_limit("cuda" if _has_accelerator() else "cpu", plan_kwargs.get("sp_size") or 1)
    users = explicit & {"per_device_train_batch_size", "gradient_accumulation_steps"}
    if users or limit is None or micro_batch <= limit[0]:
        return {"micro_batch_size": micro_batch}
    shared = math.prod(plan_kwargs.get(f"{n}_size") or 1 for n in ("tp", "cp", "sp"))
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
