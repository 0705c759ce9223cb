"""Shared logic of the recipes in ``recipes/``: arguments, model/tokenizer/data setup, evaluation, export.

The recipes read top to bottom and call these functions (``from hf_dist import recipe_utils as ru``);
nothing here is specific to one recipe. Everything that can reject user input (flags, the output folder, the
model's source, columns, sequence length, LoRA targets, QLoRA without a GPU, the plan, the checkpoint to resume)
runs inside :func:`checking`, before a model is built, so no accelerator time is spent on a bad command; the
recipes' entry point :func:`run_recipe` prints such a refusal once, from rank 0, without a traceback.

- :mod:`~hf_dist.recipe_utils.flags`: the recipes' flags (argument dataclasses) and training defaults;
- :mod:`~hf_dist.recipe_utils.args`: parsing, ``TrainingArguments`` + strategy;
- :mod:`~hf_dist.recipe_utils.model`: tokenizer, config, model, LoRA/QLoRA;
- :mod:`~hf_dist.recipe_utils.data`: chat and packed-text datasets, collators;
- :mod:`~hf_dist.recipe_utils.checks`: the output folder, the model's source, engines CPU ranks would not run;
- :mod:`~hf_dist.recipe_utils.refusal`: :class:`RecipeRefusal`, :func:`checking`, the entry point :func:`run_recipe`;
- :mod:`~hf_dist.recipe_utils.run`: resume, callbacks, strategy check, training, export, results.
"""

from hf_dist.configs.training_args import shards_at_load
from hf_dist.recipe_utils.args import STRATEGY_FLAGS, parse_recipe_args, training_arguments
from hf_dist.recipe_utils.checks import check_engine_runs_here, check_model_source, check_output_dir
from hf_dist.recipe_utils.data import (
    chat_datasets,
    check_dataset,
    collator,
    packing_attention,
    text_datasets,
    use_packing,
)
from hf_dist.recipe_utils.export import export_model
from hf_dist.recipe_utils.flags import (
    EMBEDDED_TRAINING_DEFAULTS,
    LLAMA_LORA_TARGETS,
    REAL_TRAINING_DEFAULTS,
    STRATEGY_CHOICES,
    DataArguments,
    LoraArguments,
    ModelArguments,
    QuantArguments,
    RunArguments,
)
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
from hf_dist.recipe_utils.refusal import RecipeRefusal, checking, run_recipe
from hf_dist.recipe_utils.run import (
    baseline_accuracy,
    batch_shape,
    check_strategy,
    cpu_test_modes,
    describe_plan,
    earlier_results,
    finish_run,
    format_results,
    is_finished,
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
    "QuantArguments", "REAL_TRAINING_DEFAULTS", "RecipeRefusal", "RunArguments", "STRATEGY_CHOICES", "STRATEGY_FLAGS",
    "apply_lora", "baseline_accuracy", "batch_shape", "bnb_config", "build_model", "chat_datasets", "check_dataset",
    "check_engine_runs_here", "check_lora_targets", "check_model_source", "check_output_dir", "check_strategy",
    "checking", "collator", "cpu_test_modes", "describe_plan", "earlier_results", "embedded_base_on_disk",
    "export_model", "finish_run", "format_results", "is_finished", "load_recipe", "load_tokenizer", "lora_config",
    "make_trainer", "model_config", "packing_attention", "parallel_load_kwargs", "parse_recipe_args", "print_plan",
    "require_cuda", "resolve_seq_len", "resume_checkpoint", "run_recipe", "save_at_end_callback", "save_base_model", "shards_at_load",
    "shutdown", "text_datasets", "train", "training_arguments", "use_packing",
]  # fmt: skip
