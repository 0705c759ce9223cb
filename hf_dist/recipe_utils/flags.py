"""The recipes' own flags, as the dataclasses ``HfArgumentParser`` reads (each field's ``help`` is its ``--help``
line), and the ``TrainingArguments`` values every recipe starts from (embedded tiny model, or a real one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hf_dist.planning.layout import STRATEGIES
from hf_dist.planning.lora import DEFAULT_TARGETS, RECIPE_ALPHA, RECIPE_DROPOUT, RECIPE_RANK
from hf_dist.planning.request import PlanRequest, request_help

LLAMA_LORA_TARGETS = DEFAULT_TARGETS  # every linear of a Llama block: the LoRA hf_dist plans unless told otherwise
STRATEGY_CHOICES = STRATEGIES  # the registry's user-facing names
LAYOUT_PINS = ("strategy", "tp_size", "cp_size", "sp_size", "offload", "offload_device")  # PlanRequest fields


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
    # the layout pins: hf_dist.planning.request.PlanRequest's fields, with its help (None: the plan's choice)
    strategy: str | None = field(default=None, metadata={"help": request_help("strategy")})
    tp_size: int | None = field(default=None, metadata={"help": request_help("tp_size")})
    cp_size: int | None = field(default=None, metadata={"help": request_help("cp_size")})
    sp_size: int | None = field(default=None, metadata={"help": request_help("sp_size")})
    offload: str | None = field(default=None, metadata={"help": request_help("offload")})
    offload_device: str | None = field(default=None, metadata={"help": request_help("offload_device")})
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

    def plan_request(self, method: str, seq_len: int, *, peft_config: Any = None, async_save: bool = False):
        """What these flags ask the plan for: the layout pins (None: searched), the method and sequence length, the
        LoRA (``peft_config``, when ``method`` is not ``full``) and background saves (``async_save``: their staging
        copy counts in host RAM)."""
        pins = {name: getattr(self, name) for name in LAYOUT_PINS}
        return PlanRequest(
            method=method, seq_len=seq_len, peft_config=peft_config if method != "full" else None,
            async_save=async_save, trust_remote_code=self.trust_remote_code, **pins,
        )  # fmt: skip


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
