"""Tokenizer, config, model, LoRA/QLoRA setup for the recipes; every check runs before a model is built."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hf_dist.configs.training_args import shards_at_load
from hf_dist.data import (
    build_tokenizer,
    ensure_chat_template,
    ensure_pad_token,
)
from hf_dist.planning.config_checks import resolve_seq_len as resolve_planned_seq_len
from hf_dist.recipe_utils.flags import LoraArguments, ModelArguments, QuantArguments

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


def model_config(model_args: ModelArguments, tokenizer: Any) -> Any:
    """The model config: a tiny Llama sized to the tokenizer, or the checkpoint's own config, refused before
    anything is built when it is no causal LM or names code to import (``auto_map``) without
    ``--trust_remote_code`` (:mod:`hf_dist.planning.remote_code`)."""
    if model_args.embedded:
        from hf_dist.embedded.model import tiny_llama_config

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
    from hf_dist.planning.model_source import check_causal_lm, load_config

    trust = model_args.trust_remote_code
    config = load_config(model_args.model_name_or_path, trust_remote_code=trust)
    check_causal_lm(config, trust_remote_code=trust)
    return config


def resolve_seq_len(requested: int | None, config: Any, *, embedded: bool) -> int:
    """The sequence length to train with (default: 64 for the embedded model, else 2048, at most the model's
    positions); a ValueError when it exceeds the model's positions, by the planner's own check
    (:func:`hf_dist.planning.config_checks.resolve_seq_len`)."""
    return resolve_planned_seq_len(requested, config, default=64 if embedded else 2048, name="--max_seq_length")


def parallel_load_kwargs(args: Any) -> dict[str, Any]:
    """What ``from_pretrained`` needs for the layout in ``args`` (``TrainingArguments``) with the installed
    transformers: the tensor-parallel plan and the data-parallel sizes when torch TP shards the model at load
    (:func:`shards_at_load`; FSDP2 over ``dp_shard x cp``, replicated ``dp_replicate`` times), the
    attention Ulysses wraps under sequence parallelism (:func:`hf_dist.configs.training_args.load_kwargs`; the SP
    handler's when ``args`` has one: the packed recipes' document-aware sdpa)."""
    from hf_dist.configs.training_args import load_kwargs
    from hf_dist.planning.features import installed_features
    from hf_dist.runtime.dist import deepspeed_config, parallel_sizes

    parallelism = getattr(args, "parallelism_config", None)
    sizes = parallel_sizes(parallelism, deepspeed_config(args))
    data = {name: int(getattr(parallelism, f"{name}_size", 1) or 1) for name in ("dp_shard", "dp_replicate", "cp")}
    mixed = bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))  # pure bf16 runs neither flag
    out = load_kwargs(
        sizes["tp"], sizes["sp"], deepspeed=bool(args.deepspeed), features=installed_features(),
        fsdp_size=data["dp_shard"] * data["cp"], replicate_size=data["dp_replicate"], fsdp_mixed_precision=mixed,
    )  # fmt: skip
    handler = getattr(parallelism, "sp_handler", None)
    if sizes["sp"] > 1 and getattr(handler, "sp_attn_implementation", None):  # the attention Ulysses wraps
        out["attn_implementation"] = handler.sp_attn_implementation
    return out


def build_model(
    model_args: ModelArguments, config: Any, *, seed: int, quantization_config: Any = None, **load: Any
) -> Any:
    """The model on CPU (the Trainer/accelerate move and shard it), seeded so every rank agrees.

    The embedded tiny model is built whole on every rank (:func:`whole_on_every_rank`), also after
    :func:`training_arguments` chose the strategy: ZeRO-3 partitions it when the engine starts, instead of inside
    ``deepspeed.zero.Init``, which needs DeepSpeed's own communication backend that accelerate does not start on CPU
    ranks, and FSDP2 shards it when accelerate prepares it. Pretrained models are loaded under ``zero.Init`` when
    ZeRO-3 is on (GPU machines). ``load``: more ``from_pretrained`` keywords (:func:`parallel_load_kwargs`: a TP model
    is sharded as it loads).
    """
    import torch
    from transformers import AutoModelForCausalLM, set_seed

    set_seed(seed)
    extra = {"attn_implementation": model_args.attn_implementation} if model_args.attn_implementation else {}
    extra.update(load)
    if model_args.embedded and shards_at_load(extra):
        raise ValueError("a tensor-parallel model is sharded as it loads: save the embedded model and load it by path")
    if model_args.embedded:
        with whole_on_every_rank():  # even once the strategy is chosen (see above)
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False, **extra)
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

    from hf_dist.planning.model_source import causal_lm_from_config

    with outside_zero3(), init_empty_weights():
        skeleton = causal_lm_from_config(config, trust_remote_code=trust_remote_code)
    return lora_config(lora_args, skeleton)


def save_base_model(model: Any, tokenizer: Any, base_dir: Path, args: Any) -> None:
    """Save the embedded (randomly initialised) base so the exported adapter can be loaded on top of it.

    The model's ``name_or_path`` is pointed at the folder, which PEFT records in the adapter config
    as ``base_model_name_or_path``.
    """
    if args.should_save:
        # the model is still whole; outside ZeRO-3 save_pretrained does not gather (a collective
        # only this rank would join)
        with outside_zero3():
            model.save_pretrained(base_dir)
        tokenizer.save_pretrained(base_dir)
    model.name_or_path = str(base_dir)
    model.config._name_or_path = str(base_dir)


def embedded_base_on_disk(model: Any, tokenizer: Any, model_args: ModelArguments, args: Any, *, reload: bool) -> Any:
    """Save the embedded model as ``<output_dir>/base`` (an adapter's base must be loadable later); with
    ``reload`` (QLoRA's 4-bit weights, a TP model sharded as it loads) point ``model_args`` at it and return
    None, so the model is built again from disk; else return ``model``."""
    base_dir = Path(args.output_dir) / "base"
    with args.main_process_first(desc="saving base"):
        save_base_model(model, tokenizer, base_dir, args)
    if not reload:
        return model
    model_args.model_name_or_path = str(base_dir)
    return None


def apply_lora(model: Any, lora_args: LoraArguments, *, quantized: bool = False) -> Any:
    """Wrap ``model`` with LoRA adapters (base frozen); print the trainable share on the main process."""
    from peft import prepare_model_for_kbit_training

    from hf_dist.runtime.peft_calls import get_peft_model

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


@contextmanager
def whole_on_every_rank():
    """Build a model whole on every rank once a strategy is chosen: outside ZeRO-3's ``zero.Init``
    (:func:`outside_zero3`), and without FSDP's ``cpu_ram_efficient_loading``, under which transformers leaves the
    weights of every rank but 0 uninitialised for a broadcast (``is_fsdp_enabled()`` once the process group exists),
    which CPU ranks hang in."""
    saved = os.environ.get(FSDP_RAM_EFFICIENT)
    os.environ[FSDP_RAM_EFFICIENT] = "false"
    try:
        with outside_zero3():
            yield
    finally:
        if saved is None:
            os.environ.pop(FSDP_RAM_EFFICIENT, None)
        else:
            os.environ[FSDP_RAM_EFFICIENT] = saved


FSDP_RAM_EFFICIENT = "FSDP_CPU_RAM_EFFICIENT_LOADING"  # what accelerate's FSDP plugin exports for transformers


@contextmanager
def outside_zero3():
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
