"""DeepSpeed ZeRO-1/2/3 traced: the engine the Trainer builds through accelerate, on rank 0 of the fake world.

The config is hf_dist's own (:func:`hf_dist.configs.deepspeed.deepspeed_config`) with the ``"auto"`` values filled by
transformers' ``HfTrainerDeepSpeedConfig`` from the run's ``TrainingArguments``; the optimizer is the Trainer's (its
class and keywords, its weight-decay and no-decay parameter groups); ``deepspeed.initialize`` gets both, as
accelerate's ``_prepare_deepspeed`` passes them, and the steps are accelerate's ``DeepSpeedEngineWrapper.backward``:
``engine.backward`` every micro-batch, ``engine.step`` at the accumulation boundary. The engine runs unchanged but for
the two shims of :mod:`hf_dist.tracing.zero_shims`, and with the streams a GPU rank's ZeRO objects have
(:func:`name_streams`), whose allocations the replay serves from their own pools.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import warnings
from typing import Any

from hf_dist.tracing.setup import TraceSetup, TraceUnsupported
from hf_dist.tracing.zero_shims import fake_module_to, version_reason
from hf_dist.tracing.zero_shims import name_streams as _name_streams

_RANK_ENV = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


class _RankArgs:
    """``TrainingArguments`` as one rank of the planned world sees them: the world size and the precision flags of
    the plan (a ``TrainingArguments`` made here knows neither the fake world nor, on a CPU, bf16)."""

    def __init__(self, args: Any, **overrides: Any) -> None:
        self._args, self._overrides = args, overrides

    def __getattr__(self, name: str) -> Any:
        return self._overrides[name] if name in self._overrides else getattr(self._args, name)


def engine_config(setup: TraceSetup, model: Any) -> dict[str, Any]:
    """The DeepSpeed config the run starts with: hf_dist's JSON for the plan, its ``"auto"`` values filled as the
    Trainer fills them (``trainer_config_process`` from the arguments, ``trainer_config_finalize`` from the model)."""
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    from hf_dist.configs.deepspeed import deepspeed_config
    from hf_dist.tracing.prepare import _no_accelerate_env

    planned = deepspeed_config(setup.layout)
    with tempfile.TemporaryDirectory() as tmp, _no_accelerate_env():
        plain = TrainingArguments(
            output_dir=tmp, report_to="none", per_device_train_batch_size=setup.micro_batch_size,
            gradient_accumulation_steps=setup.gradient_accumulation_steps,
        )  # fmt: skip
    args = _RankArgs(
        plain, world_size=setup.layout.dp_size, bf16=setup.mixed_precision == "bf16",
        fp16=setup.mixed_precision == "fp16",
    )  # fmt: skip
    filled = HfTrainerDeepSpeedConfig(planned)
    try:
        filled.trainer_config_process(args)
        filled.trainer_config_finalize(args, model, num_training_steps=2)
    finally:
        unset_hf_deepspeed_config()  # the weak reference would make transformers build later models under zero.Init
    return filled.config


def trainer_optimizer(model: Any, optimizer: tuple[Any, dict[str, Any]]) -> Any:
    """The optimizer ``Trainer.create_optimizer`` builds: the weight-decay and the no-decay parameter groups (one
    may be empty; DeepSpeed flattens and partitions each group on its own)."""
    from transformers import Trainer, TrainingArguments

    cls, kwargs = optimizer
    decay = set(Trainer.get_decay_parameter_names(None, model))
    weight_decay = TrainingArguments.weight_decay
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    return cls(groups, **kwargs)


@contextlib.contextmanager
def rank_zero(setup: TraceSetup):
    """Rank 0's launcher variables (DeepSpeed reads ``LOCAL_RANK`` at start and in ZeRO-3's rank checks) and
    DeepSpeed's log level as the Trainer sets it (warnings), restored afterwards, with the functions DeepSpeed
    replaces for the rest of a process (:func:`process_functions_restored`)."""
    from deepspeed.utils import logger

    saved = {k: os.environ.get(k) for k in _RANK_ENV}
    per_node = setup.world_size // setup.nodes
    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE=str(setup.world_size), LOCAL_WORLD_SIZE=str(per_node))
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with process_functions_restored(), _launch_noise_quiet():
            yield
    finally:
        logger.setLevel(level)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _launch_noise_quiet():
    """What the traced engine would make a plan print that says nothing of the user's run: transformers' warning that
    ``TrainingArguments`` built under the (fake) process group is not a distributed launch, and torch's deprecation
    of the collectives DeepSpeed calls (:data:`hf_dist.runtime.library_warnings.DEPRECATED_COLLECTIVES`). Both
    restored afterwards."""
    from hf_dist.runtime.library_warnings import DEPRECATED_COLLECTIVES

    training_args = logging.getLogger("transformers.training_args")
    level = training_args.level
    training_args.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=DEPRECATED_COLLECTIVES, category=FutureWarning)
            yield
    finally:
        training_args.setLevel(level)


@contextlib.contextmanager
def process_functions_restored():
    """ZeRO-3 replaces ``torch.nn.functional.linear`` with its own autograd function for the rest of the process
    (``partition_parameters.py _enable_mem_efficient_linear``: "This will persist unless manually reset"). Right for
    the run, which has one engine; a process that traces, or measures, several layouts restores it after each, or a
    ZeRO-1/2 layout traced after a ZeRO-3 one would save what ZeRO-3's linear saves."""
    import torch

    linear = torch.nn.functional.linear
    try:
        yield
    finally:
        torch.nn.functional.linear = linear


def release_groups() -> None:
    """Drop DeepSpeed's references to the fake process groups (before the fake world is destroyed), as
    ``deepspeed.comm.destroy_process_group`` does (DeepSpeed 0.19.8, ``utils/groups.py``)."""
    from deepspeed.utils import groups

    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:
        release(group=None)


def start_engine(model: Any, optimizer: Any, setup: TraceSetup) -> Any:
    """``deepspeed.initialize`` as accelerate's ``_prepare_deepspeed`` calls it: the model, the Trainer's optimizer
    and the filled config (:func:`engine_config`); the engine it returns."""
    import deepspeed

    reason = version_reason(deepspeed.__version__)  # the module imported, whatever the package metadata says
    if reason:
        raise TraceUnsupported(f"cannot trace {setup.layout.describe()}: {reason}")
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config_params=engine_config(setup, model))
    return engine


def initialize(model: Any, optimizer: Any, setup: TraceSetup) -> Any:
    """:func:`start_engine` on the fake-materialised ``model``, with ``module.to`` shimmed (call inside
    ``FakeTensorMode``, within :func:`rank_zero`, with the scalar-read shim entered)."""
    with fake_module_to(model), warnings.catch_warnings():
        # ZeRO-1/2 assert the alignment of their flat buffers by data_ptr(): a fake tensor's is 0, which passes
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        return start_engine(model, optimizer, setup)


def name_streams(engine: Any) -> list[str]:
    """The started engine's ZeRO objects given the streams a GPU rank's hold (:func:`zero_shims.name_streams`); the
    attributes named. A DeepSpeed whose streams moved is refused."""
    try:
        return _name_streams(engine)
    except LookupError as error:
        raise TraceUnsupported(str(error)) from error


def train_steps(engine: Any, setup: TraceSetup, vocab_size: int, on_phase: Any, after_backward: Any) -> None:
    """The tracer's steps (warm-up of one micro-batch, then up to two) as the Trainer runs them under DeepSpeed:
    accelerate's ``DeepSpeedEngineWrapper.backward`` marks the accumulation boundary, runs ``engine.backward`` and, at
    the boundary, ``engine.step`` (clipping, optimizer step, zeroing of the gradients)."""
    import torch

    ids = torch.randint(0, vocab_size, (setup.micro_batch_size, setup.seq_len))
    for micro_batches in (1, min(setup.gradient_accumulation_steps, 2)):
        for index in range(micro_batches):
            last = index == micro_batches - 1
            on_phase("forward")
            loss = engine(input_ids=ids, labels=ids).loss
            on_phase("backward")
            engine.set_gradient_accumulation_boundary(last)
            engine.backward(loss)
            del loss
            after_backward()
            if last:
                on_phase("optimizer step")
                engine.step()


# Where DeepSpeed 0.19.8's ZeRO optimizers (stage_1_and_2.py DeepSpeedZeroOptimizer, bf16_optimizer.py BF16_Optimizer,
# stage3.py DeepSpeedZeroOptimizer_Stage3) keep each model state, by memory-model term; anything else they keep
# (reduce buckets, flat copies) counts as buffers
HOLDERS = {
    "params": ("bit16_groups_flat", "bf16_groups_flat", "fp16_partitioned_groups_flat"),
    "optimizer": ("single_partition_of_fp32_groups", "fp32_groups_flat_partition", "fp32_partitioned_groups_flat"),
    "grads": ("grads_in_partition", "averaged_gradients", "fp32_groups_gradients_flat", "grad_partitions_flat_buffer"),
}


def state_tensors(engine: Any) -> dict[str, list[Any]]:
    """The engine's tensors by memory-model term: ``params`` (the module's parameters: ZeRO-1/2's flat 16-bit
    buffers they view, ZeRO-3's partitions), ``optimizer`` (the fp32 master partitions and the torch optimizer's
    state), ``grads`` (the ZeRO optimizer's gradient buffers and partitions)."""
    ds_optimizer = engine.optimizer
    inner = getattr(ds_optimizer, "optimizer", ds_optimizer)
    out = {term: [t for name in names for t in _tensors_in(getattr(ds_optimizer, name, None))]
           for term, names in HOLDERS.items()}  # fmt: skip
    out["params"] += list(engine.module.parameters())
    out["params"] += [p.ds_tensor for p in engine.module.parameters() if getattr(p, "ds_tensor", None) is not None]
    out["optimizer"] += [t for state in inner.state.values() for t in state.values() if _is_tensor(t)]
    out["grads"] += [p.grad for p in engine.module.parameters() if _owns_storage(p.grad)]  # ZeRO-1's kept .grad
    return out


def _owns_storage(tensor: Any) -> bool:
    """A tensor that is its storage (not a view into one of DeepSpeed's buckets)."""
    return tensor is not None and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _tensors_in(value: Any, depth: int = 0) -> list[Any]:
    if _is_tensor(value):
        return [value]
    if depth > 2:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_in(item, depth + 1)]
    return []
