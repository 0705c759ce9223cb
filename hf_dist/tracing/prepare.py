"""Build the real model of a config on the meta device and prepare it as ``auto_args()`` + the Trainer would.

Nothing here allocates: the model is built on ``meta``, wrapped (PEFT LoRA, activation checkpointing, FSDP2 through
accelerate's own ``fsdp2_apply_ac`` / ``fsdp2_prepare_model``), and only then materialised as fake tensors by
:func:`materialize`. Preparation calls the installed libraries' functions rather than copies of them, so the trace
follows the versions the run will use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import Any

from hf_dist.tracing.setup import TraceSetup, TraceUnsupported

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "bf16": "bfloat16", "fp16": "float16"}


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, _DTYPES[name])


def compute_dtype(setup: TraceSetup) -> Any:
    import torch

    return torch.float32 if setup.mixed_precision == "no" else _dtype(setup.mixed_precision)


def trainable_dtype(setup: TraceSetup) -> Any:
    """fp32 master weights under mixed precision (auto_args upcasts for DDP, accelerate for FSDP2); 16-bit
    weights under pure bf16; fp32 when training is fp32."""
    import torch

    return torch.bfloat16 if setup.pure_bf16 else torch.float32


def native_amp(setup: TraceSetup) -> bool:
    """Whether accelerate wraps the forward in autocast: mixed precision on, except pure bf16 FSDP2, which
    hf_dist runs with mixed precision "no" (``hf_dist.configs.training_args.trainer_mixed_precision``), and DeepSpeed,
    whose engine casts the module to the 16-bit dtype instead (accelerate's ``native_amp`` is off for it)."""
    strategy = setup.layout.strategy
    return setup.mixed_precision != "no" and not (setup.pure_bf16 and strategy.is_fsdp) and not strategy.is_deepspeed


def build_model(config: Any, setup: TraceSetup, *, trust_remote_code: bool = False) -> Any:
    """The causal LM of ``config`` on the meta device, in the dtypes the run keeps, with LoRA when planned (the
    config's ``auto_map`` class only with ``trust_remote_code``: :mod:`hf_dist.planning.remote_code`)."""
    import copy

    from hf_dist.planning.model_source import meta_model
    from hf_dist.planning.modelinfo import model_spec

    config = copy.deepcopy(config)
    config._attn_implementation = (  # eager where sdpa is refused
        setup.attention or model_spec(config, trust_remote_code=trust_remote_code).attention
    )
    if setup.activation_checkpointing:  # what auto_args sets (hf_dist.auto.disable_kv_cache_under_checkpointing)
        config.use_cache = False
    model = meta_model(config, trust_remote_code=trust_remote_code)
    if setup.method == "full":
        return model.to(trainable_dtype(setup))
    model = model.to(_dtype(setup.base_dtype))
    model.requires_grad_(False)
    return _add_lora(model, setup)


def _add_lora(model: Any, setup: TraceSetup) -> Any:
    """The run's own LoRA (``setup.lora``: rank, alpha, dropout, targets, ``modules_to_save``, bias...) applied as the
    run applies it, through PEFT's ``get_peft_model``; trainable parameters in the trainable dtype."""
    from peft import LoraConfig

    from hf_dist.runtime.peft_calls import get_peft_model

    model = get_peft_model(model, LoraConfig(**setup.lora.peft_kwargs(), task_type="CAUSAL_LM"))
    for param in model.parameters():  # PEFT keeps adapters in fp32 (autocast_adapter_dtype); pure bf16 does not
        if param.requires_grad:
            param.data = param.data.to(trainable_dtype(setup))
    return model


def enable_checkpointing(model: Any, setup: TraceSetup) -> Any:
    """Activation checkpointing as the Trainer applies it for DDP (``gradient_checkpointing_enable`` with
    ``use_reentrant=False``, what auto_args asks for); FSDP2 gets it from accelerate in :func:`shard`, except with
    tensor parallelism, where transformers distributes the model and the layers are checkpointed here the same way
    (one decoder layer at a time; without it the FSDP2 x TP traces kept every layer's activations)."""
    fsdp_applies_it = setup.layout.strategy.is_fsdp and setup.tp_size == 1
    if setup.activation_checkpointing and not fsdp_applies_it:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23 (the Trainer's own choice)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def shard(model: Any, setup: TraceSetup, mesh: Any) -> Any:
    """FSDP2 exactly as accelerate prepares it for hf_dist's plugin settings (``hf_dist.configs.fsdp``); with
    tensor parallelism, transformers' own TP plan and FSDP2 over the rest (:func:`distribute_tensor_parallel`)."""
    if setup.tp_size > 1:
        return distribute_tensor_parallel(model, setup)
    if not setup.layout.strategy.is_fsdp:
        return model
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_apply_ac, fsdp2_prepare_model

    from hf_dist.configs.fsdp import fsdp_plugin_kwargs
    from hf_dist.planning.wrap import fsdp_wrap_classes

    mixed = "no" if not native_amp(setup) else setup.mixed_precision
    kwargs = fsdp_plugin_kwargs(
        setup.strategy, wrap_classes=fsdp_wrap_classes(model), activation_checkpointing=setup.activation_checkpointing,
        mixed_precision=mixed,
    )  # fmt: skip
    kwargs["cpu_ram_efficient_loading"] = False  # a loading-time choice: no weights are loaded here
    with _no_accelerate_env():
        plugin = FullyShardedDataParallelPlugin(**kwargs)
    plugin.set_auto_wrap_policy(model)
    accelerator = types.SimpleNamespace(
        state=types.SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=mesh,
        parallelism_config=types.SimpleNamespace(fsdp_dim_names=mesh.mesh_dim_names), mixed_precision=mixed,
        is_main_process=True, device=_cpu(),
    )  # fmt: skip
    if setup.activation_checkpointing:
        model = fsdp2_apply_ac(accelerator, model)
    return fsdp2_prepare_model(accelerator, model)


def distribute_tensor_parallel(model: Any, setup: TraceSetup) -> Any:
    """What the run's ``from_pretrained(**from_pretrained_kwargs(layout))`` does to the meta model before loading
    weights: transformers' ``prepare_distribute_model`` builds its (dp_replicate, fsdp, tp) mesh from the same
    ``DistributedConfig``, ``maybe_distribute_model`` applies the model's TP plan (DTensor placements, input/output
    hooks) and FSDP2 over the ``fsdp`` dimension (HSDP: replicated across ``dp_replicate``), with the mixed-precision
    policy the run's FSDP2 has (accelerate's ``MixedPrecisionPolicy``: bf16 gathered weights, fp32 reduce;
    ``fsdp_mixed_precision``). Without it the gathered weights stay fp32 and autocast caches a bf16 copy of every
    layer's weights until the loss (``cached_cast``), which the real run never holds."""
    from transformers.distributed import DistributedConfig

    from hf_dist.configs.training_args import from_pretrained_kwargs
    from hf_dist.planning.features import installed_features

    cls = type(model)
    kwargs = from_pretrained_kwargs(setup.layout, installed_features()).get("distributed_config") or {}  # the run's
    missing = sorted(set(kwargs or {"tp_plan"}) - {f.name for f in dataclasses.fields(DistributedConfig)})
    if missing:
        raise TraceUnsupported(f"tensor parallelism: this transformers' DistributedConfig lacks {missing}")
    config, _, mesh_manager = cls.prepare_distribute_model(DistributedConfig(**kwargs))
    return cls.maybe_distribute_model(model, config, mesh_manager)


def _cpu() -> Any:
    import torch

    return torch.device("cpu")


@contextlib.contextmanager
def _no_accelerate_env():
    """The plugin reads ``FSDP_*`` / ``ACCELERATE_*`` variables of a launched process; the trace must follow the
    setup, not the caller's launch."""
    import os

    saved = {k: v for k, v in os.environ.items() if k.startswith(("FSDP_", "ACCELERATE_"))}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def ddp_buckets(model: Any, setup: TraceSetup) -> list[Any]:
    """DDP's gradient buckets, allocated as the Reducer does at construction (torch ``reducer.cpp``
    ``initialize_buckets``; ``gradient_as_bucket_view=False``, accelerate's default): one flat copy of every
    trainable gradient, in its dtype. The Reducer itself cannot run on fake tensors (it reads raw storage), and a
    real all-reduce works in place on these buckets, so they are all the memory DDP adds. Call inside
    ``FakeTensorMode``; empty without data-parallel replicas."""
    if not setup.layout.strategy.is_ddp or setup.layout.dp_size == 1:
        return []
    import torch

    sizes: dict[Any, int] = {}
    for param in model.parameters():
        if param.requires_grad:
            sizes[param.dtype] = sizes.get(param.dtype, 0) + param.numel()
    return [torch.empty(numel, dtype=dtype) for dtype, numel in sizes.items()]


def materialize(model: Any) -> Any:
    """Give every meta parameter and buffer fake storage (call inside ``FakeTensorMode``); tied weights stay tied."""
    model.to_empty(device="cpu")
    inner = getattr(model, "module", model)
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    if hasattr(base, "tie_weights"):
        base.tie_weights()
    model.train()
    return model


def autocast_forward(model: Any, setup: TraceSetup) -> Any:
    """accelerate's ``prepare_model`` for native AMP: forward under autocast, outputs converted to fp32."""
    if not native_amp(setup):
        return model
    import torch
    from accelerate.utils import convert_outputs_to_fp32

    forward = model.forward
    dtype = compute_dtype(setup)

    def amp_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type="cpu", dtype=dtype):
            return forward(*args, **kwargs)

    model.forward = convert_outputs_to_fp32(amp_forward)
    return model


@contextlib.contextmanager
def cuda_dropout():
    """Dropout as it runs on CUDA: ATen's ``dropout`` takes the fused ``native_dropout`` (a 1-byte bool mask saved
    for backward) only for CUDA tensors (``is_fused_kernel_acceptable``); on CPU it saves a noise tensor in the
    input's dtype instead. The trace predicts a GPU run, so dropout (PEFT's ``lora_dropout``) takes the CUDA path."""
    import torch

    original = torch.nn.functional.dropout

    def dropout(input, p=0.5, training=True, inplace=False):  # noqa: A002  (torch's own signature)
        if not training or p == 0 or inplace:
            return original(input, p, training, inplace)
        return torch.native_dropout(input, p, True)[0]

    torch.nn.functional.dropout = dropout
    try:
        yield
    finally:
        torch.nn.functional.dropout = original


def trainer_optimizer(setup: TraceSetup) -> tuple[Any, dict[str, Any]]:
    """The optimizer class and kwargs the Trainer builds (``Trainer.get_optimizer_cls_and_kwargs``): its default
    ``optim`` for AdamW (fused AdamW on torch >= 2.8), ``optim="sgd"`` for SGD."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    with tempfile.TemporaryDirectory() as tmp, _no_accelerate_env():
        extra = {"optim": "sgd"} if setup.optimizer == "sgd" else {}
        args = TrainingArguments(output_dir=tmp, report_to="none", **extra)
        return Trainer.get_optimizer_cls_and_kwargs(args)
