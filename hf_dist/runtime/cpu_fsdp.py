"""Opt-in: let accelerate run FSDP2 on CPU ranks (gloo). For tests and CPU development only.

accelerate only takes its FSDP branch when the process runs on an accelerator
(``AcceleratorState.__init__`` checks ``distributed_type in [MULTI_GPU, MULTI_NPU, ...]``).
On CPU the state stays ``DistributedType.MULTI_CPU`` and the FSDP plugin is silently dropped: the
Trainer then trains plain DDP and saves full weights, so a test of "FSDP" would prove nothing.
Torch's FSDP2 (``fully_shard``) itself works on CPU over gloo, so the only thing missing is that
one branch. :func:`enable_fsdp_on_cpu` wraps ``AcceleratorState.__init__`` and, when a fresh state
came out as ``MULTI_CPU`` while an FSDP2 plugin was passed, does exactly what accelerate's own
branch does (set ``DistributedType.FSDP``, store the plugin, apply mixed precision). Nothing else
in accelerate is touched.

It is always an explicit opt-in, made by whoever launches on CPU, before ``TrainingArguments``/
``Accelerator`` are created: a user script with ``hf_dist.auto_args(model, ..., engine_on_cpu=True)``
(:func:`engine_on_cpu_ranks`; without it ``auto_args`` refuses an FSDP or ZeRO plan on CPU ranks), the recipes
when launched with ``--fsdp_on_cpu`` (``tests/distributed/test_recipes.py`` does); test scripts call::

    from hf_dist.runtime.cpu_fsdp import enable_fsdp_on_cpu_from_env
    enable_fsdp_on_cpu_from_env()      # active only when HF_DIST_FSDP_ON_CPU=1

Never use this for real training: CPU FSDP is orders of magnitude slower than GPU FSDP and
exists here so the FSDP code path (wrapping, DTensor shards, DCP checkpoints) can be tested on
machines without GPUs. A ``RuntimeWarning`` is emitted when it is switched on.
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from typing import Any

ENV_VAR = "HF_DIST_FSDP_ON_CPU"

_ORIGINAL_INIT_ATTR = "_hf_dist_original_init"


def fsdp_on_cpu_enabled() -> bool:
    """Whether :func:`enable_fsdp_on_cpu` is active in this process."""
    from accelerate.state import AcceleratorState

    return hasattr(AcceleratorState.__init__, _ORIGINAL_INIT_ATTR)


def enable_fsdp_on_cpu() -> None:
    """Make accelerate keep an FSDP2 plugin on CPU ranks instead of silently training DDP.

    Idempotent. Call it before the first ``Accelerator``/``Trainer`` of the process is built; a state
    that already exists is not changed. Only FSDP2 is supported: FSDP1 on CPU fails inside torch
    ("no available devices" with ``sync_module_states``), so an FSDP1 plugin raises ``RuntimeError``.
    """
    from accelerate.state import AcceleratorState

    if fsdp_on_cpu_enabled():
        return
    warnings.warn(
        f"hf_dist: FSDP on CPU is enabled (enable_fsdp_on_cpu(): auto_args(..., engine_on_cpu=True), --fsdp_on_cpu or "
        f"{ENV_VAR}=1). This is for tests and CPU development only; never use it for real training.",
        RuntimeWarning,
        stacklevel=2,
    )
    original = AcceleratorState.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def patched_init(self, *args: Any, **kwargs: Any) -> None:
        fresh = _state_is_fresh()
        original(self, *args, **kwargs)
        if fresh:
            fsdp_plugin = signature.bind(self, *args, **kwargs).arguments.get("fsdp_plugin")
            _promote_to_fsdp(self, fsdp_plugin)

    setattr(patched_init, _ORIGINAL_INIT_ATTR, original)
    AcceleratorState.__init__ = patched_init


def disable_fsdp_on_cpu() -> None:
    """Undo :func:`enable_fsdp_on_cpu` (for tests). States already built keep their type."""
    from accelerate.state import AcceleratorState

    original = getattr(AcceleratorState.__init__, _ORIGINAL_INIT_ATTR, None)
    if original is not None:
        AcceleratorState.__init__ = original


def enable_fsdp_on_cpu_from_env() -> bool:
    """Call :func:`enable_fsdp_on_cpu` when ``HF_DIST_FSDP_ON_CPU`` is ``1``/``true``; return whether it did."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value not in ("1", "true", "yes"):
        raise ValueError(f"{ENV_VAR}={value!r} is not understood; use 1 to enable FSDP on CPU or 0 to leave it off.")
    enable_fsdp_on_cpu()
    return True


def _state_is_fresh() -> bool:
    from accelerate.state import AcceleratorState, PartialState

    # accelerate's own test: AcceleratorState holds more keys than PartialState once initialized.
    shared = AcceleratorState._shared_state
    return len(shared) == 0 or shared == PartialState._shared_state


def _promote_to_fsdp(state: Any, fsdp_plugin: Any) -> None:
    """Mirror accelerate's FSDP branch of ``AcceleratorState.__init__`` for a MULTI_CPU state."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if fsdp_plugin is None or state.distributed_type != DistributedType.MULTI_CPU:
        return
    if getattr(fsdp_plugin, "fsdp_version", 1) != 2:
        raise RuntimeError(
            f"FSDP on CPU needs FSDP2 but the plugin has fsdp_version={fsdp_plugin.fsdp_version}; "
            "set fsdp_version: 2 (accelerate YAML) or fsdp_config['version']=2 (TrainingArguments)."
        )
    state.distributed_type = DistributedType.FSDP
    if state._mixed_precision != "no":
        fsdp_plugin.set_mixed_precision(state._mixed_precision)
    state.fsdp_plugin = fsdp_plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def cpu_deepspeed_training_kwargs() -> dict[str, Any]:
    """Make DeepSpeed under the Trainer count every CPU rank; return the TrainingArguments kwargs it needs.

    accelerate takes its DeepSpeed branch only when not forced onto CPU, and then (no GPU found)
    leaves the backend unset, so its state reports world size 1 and DeepSpeed's batch check fails
    (``train_batch_size 2 != 2 * 1 * 2``). ``TrainingArguments`` does not forward ``ddp_backend`` for
    DeepSpeed, so the state is built here over gloo and the Trainer told to reuse it. Returns ``{}``
    on a GPU machine or a single process, where none of this is needed. Call it before
    ``TrainingArguments`` is created. For tests and CPU development only.
    """
    if not cpu_ranks():
        return {}
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    os.environ["ACCELERATE_USE_CPU"] = "false"
    PartialState(backend="gloo")
    return {"use_cpu": False, "accelerator_config": {"use_configured_state": True}}


def cpu_ranks() -> int:
    """The ranks of this launch when they run on CPU (``WORLD_SIZE`` > 1 on a machine without CUDA), else 0."""
    import torch

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return 0 if torch.cuda.is_available() or world < 2 else world


def cpu_launch_kwargs(deepspeed: bool) -> dict[str, Any]:
    """``{"use_cpu": True}`` for a DDP/FSDP launch of several ranks on a machine without CUDA, else ``{}``.

    That is what ``ACCELERATE_USE_CPU=1`` sets: without it transformers trains every rank of ``torchrun`` /
    ``accelerate launch`` as its own single process (``parallel_mode != ParallelMode.DISTRIBUTED``), separate copies
    writing to one folder. DeepSpeed needs the opposite setup (:func:`cpu_deepspeed_training_kwargs`), which an
    explicit call makes.
    """
    return {"use_cpu": True} if cpu_ranks() and not deepspeed else {}


def engine_on_cpu_ranks(*, fsdp: bool, deepspeed: bool) -> dict[str, Any]:
    """Make the planned engine run on this launch's CPU ranks; return the ``TrainingArguments`` kwargs it adds.

    ``hf_dist.auto_args(..., engine_on_cpu=True)`` calls it: FSDP2 through :func:`enable_fsdp_on_cpu`, DeepSpeed
    through :func:`cpu_deepspeed_training_kwargs`; nothing for DDP, on a CUDA machine or in one process. For tests
    and CPU development only (the recipes' ``--fsdp_on_cpu`` / ``--deepspeed_on_cpu``).
    """
    if not cpu_ranks():
        return {}
    if fsdp:
        enable_fsdp_on_cpu()
        return {}
    return cpu_deepspeed_training_kwargs() if deepspeed else {}


def allow_parallelism_config_on_cpu() -> None:
    """Let accelerate's ``ParallelismConfig`` validation accept a distributed CPU run (tensor/sequence parallelism
    on gloo ranks). For tests and CPU development only; called by the recipes under ``--model_parallel_on_cpu``.

    ``ParallelismConfig._validate_accelerator`` refuses any parallelism config on ``DistributedType.MULTI_CPU``
    ("ParallelismConfig is only compatible DistributedType.FSDP (version 2) or DistributedType.Multi{Device} or
    DistributedType.DEEPSPEED, but got DistributedType.MULTI_CPU."), although nothing after that check needs a
    GPU: a model sharded at load time is not wrapped again by the Trainer. This lets that one check treat a
    distributed CPU run like a multi-device one; nothing else is patched. Idempotent.
    """
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    original = ParallelismConfig._validate_accelerator
    if getattr(original, "_hf_dist_cpu", False):
        return

    def validate(self, accelerator):
        if not (accelerator.distributed_type == DistributedType.MULTI_CPU and accelerator.use_distributed):
            return original(self, accelerator)
        saved = Accelerator.multi_device
        Accelerator.multi_device = property(lambda _: True)
        try:
            return original(self, accelerator)
        finally:
            Accelerator.multi_device = saved

    validate._hf_dist_cpu = True
    ParallelismConfig._validate_accelerator = validate


def parallelism_config_on_cpu_allowed() -> bool:
    """Whether :func:`allow_parallelism_config_on_cpu` is active in this process."""
    from accelerate.parallelism_config import ParallelismConfig

    return getattr(ParallelismConfig._validate_accelerator, "_hf_dist_cpu", False)
