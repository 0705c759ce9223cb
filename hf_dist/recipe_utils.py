"""Shared logic of the recipes in ``recipes/``: arguments, model/tokenizer/data setup, evaluation, export.

The recipes read top to bottom and call these functions; nothing here is specific to one recipe.
Everything that can reject user input (paths, columns, sequence length, LoRA targets, QLoRA
without a GPU) runs before a model is built, so no accelerator time is spent on a bad command.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hf_dist.data import (
    IGNORE_INDEX,
    build_tokenizer,
    ensure_chat_template,
    ensure_pad_token,
    generation_prompt,
    load_local_dataset,
    matching_columns,
    pack_batch,
    split_eval,
    to_messages,
    tokenize_chat,
    train_eval_examples,
    validate_messages,
)
from hf_dist.memory import STRATEGIES

LLAMA_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STRATEGY_CHOICES = STRATEGIES
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


@dataclass
class ModelArguments:
    """Which model to train. Without ``--model_name_or_path`` a tiny Llama is built from a config."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Hub name or local folder; omit to train the embedded tiny Llama."}
    )
    tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "Defaults to the model's."})
    torch_dtype: str = field(default="auto", metadata={"help": "auto | bfloat16 | float16 | float32"})
    attn_implementation: str | None = field(default=None, metadata={"help": "e.g. sdpa, flash_attention_2"})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom modelling code from the hub."})
    tiny_hidden_size: int = field(default=128, metadata={"help": "Embedded model only: hidden size."})
    tiny_num_layers: int = field(default=2, metadata={"help": "Embedded model only: decoder layers."})
    strategy: str | None = field(
        default=None,
        metadata={"help": f"Force a strategy ({', '.join(STRATEGY_CHOICES)}); default: the plan's choice."},
    )

    def __post_init__(self) -> None:
        if self.torch_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"--torch_dtype {self.torch_dtype!r} is not one of auto, bfloat16, float16, float32")
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

    lora_r: int = field(default=16, metadata={"help": "Adapter rank."})
    lora_alpha: int = field(default=32, metadata={"help": "Scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the adapter input."})
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
    TrainingArguments values (the recipe's ``embedded_defaults`` without ``--model_name_or_path``,
    else ``real_defaults``, applied where the user gave no flag) and
    ``explicit`` the names the user set on the command line, which always win over the plan.
    """
    from transformers import HfArgumentParser, TrainingArguments

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = HfArgumentParser((*types, TrainingArguments))
    namespace = vars(parser.parse_args(argv))
    explicit = set(vars(_suppressed_parser(types).parse_args(argv)))
    instances = []
    for cls in types:
        names = {f.name for f in fields(cls) if f.init}
        instances.append(cls(**{k: v for k, v in namespace.items() if k in names}))
    train_names = {f.name for f in fields(TrainingArguments) if f.init}
    training_kwargs = {k: v for k, v in namespace.items() if k in train_names}
    defaults = embedded_defaults if namespace.get("model_name_or_path") is None else real_defaults
    training_kwargs.update({k: v for k, v in defaults.items() if k not in explicit})
    return (*instances, training_kwargs, explicit)


def _suppressed_parser(types: tuple[type, ...]) -> argparse.ArgumentParser:
    """The same parser with every default suppressed: its namespace holds only flags given explicitly."""
    from transformers import HfArgumentParser, TrainingArguments

    parser = HfArgumentParser((*types, TrainingArguments))
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
    lora_rank: int = 16,
):
    """``TrainingArguments`` = recipe defaults < ``hf_dist.auto_args`` (the plan) < explicit user flags.

    The plan is skipped when the user chose the strategy with ``--fsdp``/``--deepspeed`` or an
    accelerate FSDP/DeepSpeed config; ``--strategy`` pins the plan's strategy instead.
    """
    from transformers import TrainingArguments

    from hf_dist.cpu_fsdp import enable_fsdp_on_cpu_from_env

    enable_fsdp_on_cpu_from_env()  # HF_DIST_FSDP_ON_CPU=1: tests of the FSDP2 path on CPU ranks
    kwargs = dict(training_kwargs)
    if not (explicit & set(STRATEGY_FLAGS)) and not _accelerate_config_strategy():
        import hf_dist

        plan_kwargs: dict[str, Any] = {"method": method, "seq_len": seq_len, "strategy": strategy}
        if method != "full":
            plan_kwargs["lora_rank"] = lora_rank
        if "per_device_train_batch_size" in explicit or kwargs.get("per_device_train_batch_size") != 8:
            # a user flag or a recipe default (transformers' own default is 8) pins the micro batch
            plan_kwargs["micro_batch_size"] = kwargs["per_device_train_batch_size"]
        planned = hf_dist.auto_args(model, **plan_kwargs)
        kwargs.update({k: v for k, v in planned.items() if k not in explicit})
    if kwargs.get("deepspeed"):
        from hf_dist.cpu_fsdp import cpu_deepspeed_training_kwargs

        kwargs.update(cpu_deepspeed_training_kwargs())
    from hf_dist.configs.fsdp import apply_fp32_reduce

    # FSDP2 + bf16/fp16: reduce gradients in fp32 (a no-op for every other setup)
    return apply_fp32_reduce(TrainingArguments(**kwargs))


def _accelerate_config_strategy() -> bool:
    flags = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED")
    return any(os.environ.get(k, "").lower() in ("1", "true") for k in flags)


# ---------------------------------------------------------------- model and tokenizer


def load_tokenizer(model_args: ModelArguments, *, chat: bool, max_length: int = 256) -> Any:
    """The embedded character tokenizer, or the model's own (pad token and chat template ensured)."""
    if model_args.embedded and model_args.tokenizer_name_or_path is None:
        return build_tokenizer(model_max_length=max_length)
    from transformers import AutoTokenizer

    name = model_args.tokenizer_name_or_path or model_args.model_name_or_path
    tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=model_args.trust_remote_code)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"tokenizer {name!r} is a slow tokenizer; the recipes need a fast one (offset mappings)")
    ensure_pad_token(tokenizer)
    if chat and ensure_chat_template(tokenizer):
        print(f"[hf_dist] tokenizer {name!r} has no chat template: using hf_dist.data.DEFAULT_CHAT_TEMPLATE")
    return tokenizer


def load_config(model_args: ModelArguments, tokenizer: Any) -> Any:
    """The model config: a tiny Llama sized to the tokenizer, or the checkpoint's own config."""
    if model_args.embedded:
        from hf_dist.testing import tiny_llama_config

        hidden = model_args.tiny_hidden_size
        return tiny_llama_config(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=model_args.tiny_num_layers,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_args.model_name_or_path, trust_remote_code=model_args.trust_remote_code)


def resolve_seq_len(requested: int | None, config: Any, *, embedded: bool) -> int:
    """The sequence length to train with; a ValueError when it exceeds the model's positions."""
    max_positions = getattr(config, "max_position_embeddings", None)
    if requested is None:
        default = 64 if embedded else 2048
        return min(default, max_positions) if max_positions else default
    if max_positions is not None and requested > max_positions:
        raise ValueError(
            f"--max_seq_length {requested} exceeds the model's max_position_embeddings={max_positions}; "
            f"use --max_seq_length <= {max_positions} (or a model with longer context)"
        )
    return requested


def build_model(model_args: ModelArguments, config: Any, *, seed: int, quantization_config: Any = None) -> Any:
    """The model on CPU (the Trainer/accelerate move and shard it), seeded so every rank agrees.

    Build the embedded tiny model *before* :func:`training_arguments`: it is then created whole and
    ZeRO-3 partitions it when the engine starts, instead of inside ``deepspeed.zero.Init``, which
    needs DeepSpeed's own communication backend that accelerate does not start on CPU ranks.
    Pretrained models are loaded after it, under ``zero.Init`` when ZeRO-3 is on (GPU machines).
    """
    import torch
    from transformers import AutoModelForCausalLM, set_seed

    set_seed(seed)
    extra = {"attn_implementation": model_args.attn_implementation} if model_args.attn_implementation else {}
    if model_args.embedded:
        with _outside_zero3():  # whole, even if a ZeRO-3 config is registered (see above)
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32, **extra)
    dtype = model_args.torch_dtype if model_args.torch_dtype == "auto" else getattr(torch, model_args.torch_dtype)
    return AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path,
        config=config,
        dtype=dtype,
        quantization_config=quantization_config,
        trust_remote_code=model_args.trust_remote_code,
        **extra,
    )


# ---------------------------------------------------------------- LoRA / QLoRA


def lora_config(lora_args: LoraArguments, model: Any) -> Any:
    """A ``peft.LoraConfig``; unknown target names raise with the linear module names the model has."""
    import torch
    from peft import LoraConfig

    available = sorted(
        {name.rsplit(".", 1)[-1] for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    )
    missing = [t for t in lora_args.lora_target_modules if t not in available]
    if missing:
        raise ValueError(
            f"--lora_target_modules {missing} not found in {type(model).__name__}; "
            f"available linear modules: {available}"
        )
    return LoraConfig(
        r=lora_args.lora_r,
        lora_alpha=lora_args.lora_alpha,
        lora_dropout=lora_args.lora_dropout,
        target_modules=list(lora_args.lora_target_modules),
        task_type="CAUSAL_LM",
    )


def check_lora_targets(lora_args: LoraArguments, config: Any, *, trust_remote_code: bool = False) -> Any:
    """Validate ``--lora_target_modules`` on a weightless (meta) copy of the model: no memory, no download."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with _outside_zero3(), init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return lora_config(lora_args, skeleton)


def save_base_model(model: Any, tokenizer: Any, base_dir: Path, args: Any) -> None:
    """Save the embedded (randomly initialised) base so the exported adapter can be loaded on top of it.

    The model's ``name_or_path`` is pointed at the folder, which PEFT records in the adapter config
    as ``base_model_name_or_path``.
    """
    if args.should_save:
        # the model is still whole; outside ZeRO-3 save_pretrained does not gather (a collective
        # only this rank would join)
        with _outside_zero3():
            model.save_pretrained(base_dir)
        tokenizer.save_pretrained(base_dir)
    model.name_or_path = str(base_dir)
    model.config._name_or_path = str(base_dir)


def apply_lora(model: Any, lora_args: LoraArguments, *, quantized: bool = False) -> Any:
    """Wrap ``model`` with LoRA adapters (base frozen); print the trainable share on the main process."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    if quantized:
        # fp32 norms/head and input grads so gradients flow through the frozen 4-bit layers
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    peft_model = get_peft_model(model, lora_config(lora_args, model))
    trainable, total = peft_model.get_nb_trainable_parameters()
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"[hf_dist] LoRA r={lora_args.lora_r} on {lora_args.lora_target_modules}: "
            f"{trainable:,} of {total:,} parameters trainable ({trainable / total:.2%})",
            flush=True,
        )
    return peft_model


def require_cuda(recipe: str) -> None:
    """QLoRA's 4-bit kernels (bitsandbytes) need a CUDA GPU: fail before any model or data is loaded."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{recipe} needs a CUDA GPU: bitsandbytes 4-bit weights have no CPU training kernels, and "
            "torch.cuda.is_available() is False here. Run it on a GPU machine, or use recipes/lora.py "
            "(same adapter, 16/32-bit base weights) on CPU"
        )


def bnb_config(quant_args: QuantArguments) -> Any:
    """The ``BitsAndBytesConfig`` for a 4-bit base model; the storage dtype matches the compute dtype
    so FSDP can shard the quantized weights (it needs one dtype per flat parameter)."""
    import torch
    from transformers import BitsAndBytesConfig

    compute = getattr(torch, quant_args.bnb_4bit_compute_dtype)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_args.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=quant_args.bnb_4bit_use_double_quant,
        bnb_4bit_compute_dtype=compute,
        bnb_4bit_quant_storage=compute,
    )


# ---------------------------------------------------------------- data


def chat_datasets(data_args: DataArguments, tokenizer: Any, *, seq_len: int, seed: int):
    """(train, eval, task eval examples | None) tokenized for SFT with labels on assistant tokens."""
    from datasets import Dataset

    if data_args.dataset is None:
        train_ex, eval_ex = train_eval_examples(data_args.num_train_examples, data_args.num_eval_examples, seed=seed)
        train = Dataset.from_list([{"messages": ex.messages()} for ex in train_ex])
        eval_ = Dataset.from_list([{"messages": ex.messages()} for ex in eval_ex])
        columns, task = ("messages",), eval_ex
    else:
        train, eval_ = _user_splits(data_args, kind="chat", seed=seed)
        columns, task = matching_columns(train.column_names, "chat"), None

    def encode(example: dict[str, Any], idx: int) -> dict[str, list[int]]:
        return tokenize_chat(tokenizer, validate_messages(to_messages(example, columns), idx), seq_len)

    def encode_all(ds: Any) -> Any:
        ds = ds.map(encode, with_indices=True, remove_columns=ds.column_names, desc="tokenizing")
        # an example truncated before its first assistant token has nothing to learn from
        return ds.filter(lambda ex: any(label != IGNORE_INDEX for label in ex["labels"]))

    return encode_all(train), encode_all(eval_), task


def text_datasets(data_args: DataArguments, tokenizer: Any, *, seq_len: int, seed: int):
    """(train, eval, task eval examples | None) of packed ``seq_len`` blocks for continued pretraining."""
    from datasets import Dataset

    if data_args.dataset is None:
        train_ex, eval_ex = train_eval_examples(data_args.num_train_examples, data_args.num_eval_examples, seed=seed)
        train = Dataset.from_list([{"text": ex.text()} for ex in train_ex])
        eval_ = Dataset.from_list([{"text": ex.text()} for ex in eval_ex])
        task = eval_ex
    else:
        train, eval_ = _user_splits(data_args, kind="text", seed=seed)
        matching_columns(eval_.column_names, "text")
        task = None

    def pack(ds: Any) -> Any:
        return ds.map(
            pack_batch,
            batched=True,
            batch_size=1000,
            remove_columns=ds.column_names,
            fn_kwargs={"tokenizer": tokenizer, "block_size": seq_len},
            desc="packing",
        )

    train, eval_ = pack(train), pack(eval_)
    if len(train) == 0 or len(eval_) == 0:
        raise ValueError(
            f"packing into blocks of {seq_len} tokens left {len(train)} train / {len(eval_)} eval blocks; "
            "use a smaller --max_seq_length or more text"
        )
    return train, eval_, task


def check_dataset(data_args: DataArguments, *, kind: str) -> None:
    """Fail fast on a missing path or wrong columns, before any model is built (``datasets`` caches the load)."""
    for path in filter(None, (data_args.dataset, data_args.eval_dataset)):
        matching_columns(load_local_dataset(path).column_names, kind)


def _user_splits(data_args: DataArguments, *, kind: str, seed: int):
    train = load_local_dataset(data_args.dataset)
    matching_columns(train.column_names, kind)
    if data_args.eval_dataset is not None:
        return train, load_local_dataset(data_args.eval_dataset)
    return split_eval(train, data_args.eval_fraction, seed=seed)


def collator(tokenizer: Any, *, packed: bool) -> Any:
    """Packed blocks are already equal length; chat examples are padded (labels with IGNORE_INDEX)."""
    from transformers import DataCollatorForSeq2Seq, default_data_collator

    if packed:
        return default_data_collator
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, return_tensors="pt")


# ---------------------------------------------------------------- the run


def save_at_end_callback() -> Any:
    """A callback that saves a checkpoint at the last step, so every run has one to export from."""
    from transformers import TrainerCallback

    class SaveAtEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.max_steps and state.global_step >= state.max_steps:
                control.should_save = True
            return control

    return SaveAtEnd()


def resume_checkpoint(args: Any) -> str | None:
    """What ``--resume_from_checkpoint`` names, made loadable by this run; call before the Trainer is built.

    ``auto``: the newest complete checkpoint in ``--output_dir`` (:func:`hf_dist.auto_resume`; None, a fresh
    start, when there is none); a path: that checkpoint. A DeepSpeed ZeRO checkpoint saved by another number
    of ranks is converted to DeepSpeed's universal format first, and a checkpoint of another strategy is
    refused (:func:`hf_dist.reshard.prepare_resume`).
    """
    value = args.resume_from_checkpoint
    if not value:
        return None
    if value == "auto":
        from hf_dist.callbacks.resume import auto_resume

        found = auto_resume(args.output_dir, training_args=args)
        if args.process_index == 0:
            print(f"[hf_dist] resuming from {found}" if found else
                  f"[hf_dist] no complete checkpoint in {args.output_dir}: starting from scratch", flush=True)  # fmt: skip
        return found
    from hf_dist.reshard import prepare_resume

    return prepare_resume(value, training_args=args)


def train(trainer: Any, resume: str | None) -> str:
    """Check the strategy really runs, add hf_dist's callbacks, train (resuming from ``resume``); returns the strategy.

    The callbacks (:func:`hf_dist.callbacks.default`) mark checkpoints complete for ``--resume_from_checkpoint
    auto``, skip non-finite updates, and log memory and throughput per rank.
    """
    from hf_dist.callbacks import attach

    strategy = check_strategy(trainer)
    attach(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return strategy


def effective_strategy(trainer: Any) -> str:
    """What accelerate actually runs (not what was asked for): ddp, fsdp2, zero<stage> or single."""
    state = trainer.accelerator.state
    kind = str(state.distributed_type).rsplit(".", 1)[-1]
    if kind == "DEEPSPEED":
        stage = trainer.accelerator.state.deepspeed_plugin.zero_stage
        return f"zero{stage}"
    if kind == "FSDP":
        return f"fsdp{getattr(state.fsdp_plugin, 'fsdp_version', 1)}"
    return "ddp" if state.num_processes > 1 else "single"


def check_strategy(trainer: Any) -> str:
    """The strategy accelerate actually runs; a RuntimeError when it silently dropped the requested one.

    accelerate falls back to plain DDP on CPU for DeepSpeed when ``use_cpu``/``ACCELERATE_USE_CPU``
    is set, and for FSDP unless ``HF_DIST_FSDP_ON_CPU=1``; training on would produce a run the user
    did not ask for.
    """
    actual = effective_strategy(trainer)
    wanted = "zero" if trainer.args.deepspeed else "fsdp" if trainer.args.fsdp else None
    if wanted and not actual.startswith(wanted):
        raise RuntimeError(
            f"{wanted} was requested but accelerate runs {actual}: on CPU it drops DeepSpeed when use_cpu / "
            "ACCELERATE_USE_CPU=1 is set (unset it) and FSDP unless HF_DIST_FSDP_ON_CPU=1 (tests only)"
        )
    if trainer.args.process_index == 0:
        print(f"[hf_dist] running {actual} ({type(trainer.model).__name__})", flush=True)
    return actual


def describe_plan(config: Any, *, method: str, seq_len: int, args: Any, strategy: str | None = None) -> str:
    """The planner's explanation for this model/method on the detected hardware, plus the batch math."""
    world = args.world_size
    batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    lines = [
        f"[hf_dist] {method} training, {world} process(es) on {args.device.type}: micro batch "
        f"{args.per_device_train_batch_size} x grad accum {args.gradient_accumulation_steps} x world {world} "
        f"= global batch {batch} sequences of <= {seq_len} tokens"
    ]
    from hf_dist.planner import plan

    try:
        explained = plan(config, method=method, seq_len=seq_len, global_batch_size=batch, strategy=strategy).explain()
        # model / hardware / chosen / why; `hf-dist plan` prints the full per-strategy table
        lines += ["[hf_dist] plan: " + line for line in explained.splitlines()[:4]]
    except ValueError as exc:  # PlanError: e.g. no strategy fits the detected hardware
        lines.append(f"[hf_dist] planner: {exc}")
    return "\n".join(lines)


def baseline_accuracy(model: Any, tokenizer: Any, task: Any, *, mode: str, args: Any) -> float | None:
    """Task accuracy before training, computed once on the main process (others wait)."""
    from hf_dist.data.task_eval import exact_match

    if task is None:
        return None
    accuracy = None
    with args.main_process_first(desc="baseline accuracy"):
        if args.process_index == 0:
            accuracy = exact_match(model, tokenizer, task, mode=mode)
            print(f"[hf_dist] task accuracy before training: {accuracy:.0%} ({len(task)} held-out examples)")
    return accuracy


def finish_run(trainer: Any, tokenizer: Any, *, task: Any, mode: str, adapter: bool, before: float | None) -> dict:
    """Evaluate, export an HF folder (or adapter), reload it with from_pretrained, score and sample it.

    Returns (and writes to ``<output_dir>/results.json`` on the main process) the run summary.
    """
    metrics = trainer.evaluate()
    eval_loss = float(metrics["eval_loss"])
    if trainer.args.process_index == 0:
        print(f"[hf_dist] eval loss {eval_loss:.4f}; exporting", flush=True)
    export_dir = Path(trainer.args.output_dir) / ("adapter" if adapter else "final")
    how = export_model(trainer, tokenizer, export_dir, adapter=adapter)
    trainer.accelerator.wait_for_everyone()
    if not trainer.args.should_save:
        return {}
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    results = {
        "strategy": effective_strategy(trainer),
        "wrapped_model": type(trainer.model_wrapped).__name__,
        "model": type(trainer.model).__name__,
        "world_size": trainer.args.world_size,
        "steps": trainer.state.global_step,
        "train_losses": losses,
        "eval_loss": eval_loss,
        "perplexity": math.exp(min(eval_loss, 50.0)),
        "accuracy_before": before,
        "export_dir": str(export_dir),
        "exported_with": how,
    }
    results.update(_check_export(export_dir, tokenizer, task=task, mode=mode, adapter=adapter))
    _write_json_atomic(Path(trainer.args.output_dir) / "results.json", results)
    print(format_results(results))
    return results


def export_model(trainer: Any, tokenizer: Any, export_dir: Path, *, adapter: bool) -> str:
    """Write a consolidated HF folder (or PEFT adapter) to ``export_dir``; returns how it was made.

    Sharded runs (FSDP, ZeRO) go through ``hf_dist.convert`` from the last checkpoint; without a
    checkpoint (and for DDP) the full weights are gathered and saved in-process.
    """
    strategy = effective_strategy(trainer)
    checkpoint = _last_checkpoint(trainer.args.output_dir)
    if strategy.startswith(("fsdp", "zero")) and checkpoint is not None:
        if trainer.args.should_save:
            _convert_checkpoint(trainer, tokenizer, checkpoint, export_dir, adapter=adapter)
        trainer.accelerator.wait_for_everyone()
        return f"hf_dist.convert({checkpoint.name})"
    if strategy.startswith("fsdp"):
        # FSDP with a sharded state dict makes save_model a no-op; gather a full state dict instead
        state_dict = trainer.accelerator.get_state_dict(trainer.model_wrapped)
        if trainer.args.should_save:
            trainer.accelerator.unwrap_model(trainer.model).save_pretrained(export_dir, state_dict=state_dict)
            tokenizer.save_pretrained(export_dir)
        return "accelerator.get_state_dict"
    trainer.save_model(str(export_dir))
    return "trainer.save_model"


def _convert_checkpoint(trainer: Any, tokenizer: Any, checkpoint: Path, export_dir: Path, *, adapter: bool) -> None:
    """Run ``hf_dist.convert`` on the checkpoint in a fresh process, as ``hf-dist convert`` would.

    A separate process keeps the converter away from this job's initialised process group (its
    readers must not join collectives the other ranks are not in).
    """
    import subprocess

    model = trainer.accelerator.unwrap_model(trainer.model)
    # sharded checkpoints hold tensors only; the config (and adapter config) make them loadable
    base = model.get_base_model() if adapter else model
    base.config.save_pretrained(checkpoint)
    if adapter:
        model.peft_config["default"].save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    code = (
        "import sys, hf_dist; "
        "hf_dist.convert(sys.argv[1], sys.argv[2], adapter=sys.argv[3] == '1', overwrite=True, progress=False)"
    )
    dist_vars = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(checkpoint), str(export_dir), "1" if adapter else "0"],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"hf_dist.convert({checkpoint} -> {export_dir}) failed:\n{proc.stderr[-4000:]}")


def _last_checkpoint(output_dir: str) -> Path | None:
    from transformers.trainer_utils import get_last_checkpoint

    found = get_last_checkpoint(output_dir) if Path(output_dir).is_dir() else None
    return Path(found) if found else None


def _check_export(export_dir: Path, tokenizer: Any, *, task: Any, mode: str, adapter: bool) -> dict:
    """Reload the export the way a user would and run it: accuracy on the task and one sample."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_dist.data.task_eval import exact_match, generate, task_prompt

    with _outside_zero3():
        if adapter:
            from peft import AutoPeftModelForCausalLM

            model = AutoPeftModelForCausalLM.from_pretrained(export_dir)
        else:
            model = AutoModelForCausalLM.from_pretrained(export_dir)
    if adapter:
        _check_adapter_loaded(model, export_dir)
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    reloaded_tokenizer = AutoTokenizer.from_pretrained(export_dir)
    out: dict[str, Any] = {"exported_params": sum(p.numel() for p in model.parameters())}
    if task is not None:
        out["accuracy_after"] = exact_match(model, reloaded_tokenizer, task, mode=mode)
        prompt = task_prompt(reloaded_tokenizer, task[0], mode)
        out["sample_expected"] = task[0].answer
    else:
        text = "Explain in one sentence what data parallel training is."
        messages = [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
        prompt = generation_prompt(reloaded_tokenizer, messages) if mode == "chat" else text
    out["sample_prompt"] = prompt
    out["sample_output"] = generate(model, reloaded_tokenizer, [prompt], max_new_tokens=32)[0]
    return out


def _check_adapter_loaded(model: Any, export_dir: Path) -> None:
    """LoRA B matrices start at zero, so all-zero B after loading means PEFT matched none of the
    exported keys (it only warns) and the "fine-tuned" model is the bare base."""
    from safetensors import safe_open

    lora_b = [p for name, p in model.named_parameters() if "lora_B" in name]
    if lora_b and all(float(p.abs().max()) == 0.0 for p in lora_b):
        with safe_open(str(export_dir / "adapter_model.safetensors"), "pt") as fh:
            keys = sorted(fh.keys())[:3]
        raise RuntimeError(
            f"the adapter exported to {export_dir} did not load: every lora_B is zero after from_pretrained. "
            f"Its keys start {keys}; PEFT expects 'base_model.model.<module>.lora_B.weight'"
        )


@contextmanager
def _outside_zero3():
    """Load a model as a plain single-process user would, even inside a ZeRO-3 run.

    transformers builds every model inside ``deepspeed.zero.Init`` while a ZeRO-3 config is
    registered; the export check must load full, unpartitioned weights on one rank instead.
    """
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def format_results(results: dict) -> str:
    """The end-of-run summary printed by every recipe."""
    losses = results["train_losses"]
    lines = [
        f"[hf_dist] strategy run: {results['strategy']} ({results['wrapped_model']}), "
        f"{results['steps']} steps on {results['world_size']} process(es)",
        f"[hf_dist] train loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "[hf_dist] no train loss logged",
        f"[hf_dist] eval loss {results['eval_loss']:.4f}, perplexity {results['perplexity']:.2f}",
        f"[hf_dist] exported {results['export_dir']} via {results['exported_with']}; reloaded with from_pretrained",
    ]
    if "accuracy_after" in results:
        before = results["accuracy_before"]
        before_txt = f"{before:.0%}" if before is not None else "n/a"
        lines.append(
            f"[hf_dist] task exact-match accuracy: {before_txt} before -> {results['accuracy_after']:.0%} after"
        )
    lines.append(f"[hf_dist] sample: {results['sample_prompt']!r} -> {results['sample_output']!r}")
    return "\n".join(lines)


def _write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=2)
    os.replace(tmp, path)
