"""Shared logic of the recipes in ``recipes/``: arguments, model/tokenizer/data setup, evaluation, export.

The recipes read top to bottom and call these functions (``from hf_dist import recipe_utils as ru``);
nothing here is specific to one recipe. Everything that can reject user input (paths, columns,
sequence length, LoRA targets, QLoRA without a GPU) runs before a model is built, so no accelerator
time is spent on a bad command.

- :mod:`~hf_dist.recipe_utils.args`: argument dataclasses, parsing, ``TrainingArguments`` + strategy;
- :mod:`~hf_dist.recipe_utils.model`: tokenizer, config, model, LoRA/QLoRA;
- :mod:`~hf_dist.recipe_utils.data`: chat and packed-text datasets, collators;
- :mod:`~hf_dist.recipe_utils.run`: resume, callbacks, strategy check, training, export, results.
"""

from hf_dist.configs.training_args import shards_at_load
from hf_dist.recipe_utils.args import (
    EMBEDDED_TRAINING_DEFAULTS,
    LLAMA_LORA_TARGETS,
    REAL_TRAINING_DEFAULTS,
    STRATEGY_CHOICES,
    STRATEGY_FLAGS,
    DataArguments,
    LoraArguments,
    ModelArguments,
    QuantArguments,
    RunArguments,
    parse_recipe_args,
    training_arguments,
)
from hf_dist.recipe_utils.data import chat_datasets, check_dataset, collator, text_datasets
from hf_dist.recipe_utils.export import export_model
from hf_dist.recipe_utils.model import (
    apply_lora,
    bnb_config,
    build_model,
    check_lora_targets,
    embedded_base_on_disk,
    load_tokenizer,
    lora_config,
    model_config,
    parallel_load_kwargs,
    require_cuda,
    resolve_seq_len,
    save_base_model,
)
from hf_dist.recipe_utils.run import (
    baseline_accuracy,
    check_strategy,
    cpu_test_modes,
    describe_plan,
    finish_run,
    finished_run,
    format_results,
    load_recipe,
    make_trainer,
    print_plan,
    resume_checkpoint,
    save_at_end_callback,
    train,
)
from hf_dist.runtime.dist import shutdown  # the recipes' last call, on every rank

__all__ = [
    "DataArguments", "EMBEDDED_TRAINING_DEFAULTS", "LLAMA_LORA_TARGETS", "LoraArguments", "ModelArguments",
    "QuantArguments", "REAL_TRAINING_DEFAULTS", "RunArguments", "STRATEGY_CHOICES", "STRATEGY_FLAGS",
    "apply_lora", "baseline_accuracy", "bnb_config", "build_model", "chat_datasets", "check_dataset",
    "check_lora_targets", "check_strategy", "collator", "cpu_test_modes", "describe_plan", "embedded_base_on_disk",
    "export_model", "finish_run",
    "format_results", "load_recipe", "load_tokenizer", "lora_config", "make_trainer", "model_config",
    "parallel_load_kwargs", "parse_recipe_args", "print_plan", "require_cuda", "resolve_seq_len", "resume_checkpoint",
    "save_at_end_callback", "save_base_model", "shards_at_load", "shutdown", "text_datasets", "train", "training_arguments",
    "finished_run",
]  # fmt: skip
