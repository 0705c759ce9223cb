"""What the installed libraries accept, as one explicit value the planner and the config factories take.

The factories in ``hf_dist.configs`` are pure: they never import transformers to look at it. Whoever calls
them says which library behaviour to target: ``hf_dist.auto_args`` and ``hf-dist config`` pass
:func:`installed_features` (probed once per process, for features, not version numbers); the default,
:data:`NEWEST_TESTED_FEATURES`, is what the newest tested versions accept (transformers 5.23,
accelerate 1.15). :func:`check_features` refuses a layout the described libraries cannot run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hf_dist.planning.feature_store import load_features, store_features


@dataclass(frozen=True)
class LibraryFeatures:
    """``fsdp_version``: 2 where torch/accelerate/transformers run FSDP2 through the Trainer, else 1.
    ``fsdp_flag_takes_bool``: ``TrainingArguments(fsdp=True)`` (transformers >= 5.1; 5.0 wants the string
    form ``"full_shard auto_wrap"``). ``activation_checkpointing_field``: the ``TrainingArguments`` flag
    (``gradient_checkpointing`` up to transformers 5.22). ``warmup_ratio_field``: whether
    ``TrainingArguments`` still has ``warmup_ratio`` (a float ``warmup_steps`` < 1 is a ratio without it).
    ``parallelism_config``: accelerate's ``ParallelismConfig`` with ``tp_size``/``cp_size`` and
    ``TrainingArguments(parallelism_config=...)`` (accelerate >= 1.10), needed for TP and CP.
    ``sequence_parallel``: ``ParallelismConfig(sp_backend="deepspeed", sp_size=...)`` with DeepSpeed's Ulysses
    attention (accelerate >= 1.12, deepspeed >= 0.18.2). ``deepspeed_autotp``: DeepSpeed's training AutoTP
    (``"tensor_parallel": {"autotp_size": N}``, deepspeed >= 0.16.4). ``fsdp2_checkpoints_children``: accelerate's
    ``fsdp2_apply_ac`` wraps every *child* of a decoder layer in its own checkpoint (accelerate <= 1.14: it tests the
    wrap policy on the parent), so each child's input is saved, not only the layer's. ``fsdp2_embedding_unit``:
    accelerate's ``fsdp2_prepare_model`` shards an untied input embedding as its own unit, resharded after its
    forward (accelerate >= 1.15), so only the tail (final norm, ``lm_head``) stays gathered until backward.
    ``tp_distributed_config``: ``from_pretrained(distributed_config={"tp_plan": "auto"})`` shards a model at load
    (transformers' ``DistributedConfig`` has ``tp_plan``); the ``tp_plan=`` keyword it replaces warns once per rank.
    ``default_adamw``: the ``TrainingArguments.optim`` default, the AdamW a plan's ``adamw`` runs as
    (``adamw_torch_fused`` where transformers sees torch >= 2.8, else ``adamw_torch``).
    """

    fsdp_version: int = 2
    fsdp_flag_takes_bool: bool = True
    activation_checkpointing_field: str = "activation_checkpointing"
    warmup_ratio_field: bool = False
    parallelism_config: bool = True
    sequence_parallel: bool = True
    deepspeed_autotp: bool = True
    fsdp2_checkpoints_children: bool = False
    fsdp2_embedding_unit: bool = True
    tp_distributed_config: bool = True
    default_adamw: str = "adamw_torch_fused"

    def __post_init__(self) -> None:
        if self.fsdp_version not in (1, 2):
            raise ValueError(f"FSDP version must be 1 or 2, got {self.fsdp_version!r}.")

    @property
    def activation_checkpointing_kwargs_field(self) -> str:
        return f"{self.activation_checkpointing_field}_kwargs"


NEWEST_TESTED_FEATURES = LibraryFeatures()


def check_features(layout, features: LibraryFeatures) -> None:
    """Refuse a layout whose model-parallel dimensions the libraries described by ``features`` cannot run."""
    s = layout.strategy
    if (layout.tp_size > 1 and not s.is_deepspeed) or layout.cp_size > 1:
        if not features.parallelism_config:
            dim = f"tp_size {layout.tp_size}" if layout.tp_size > 1 else f"cp_size {layout.cp_size}"
            raise ValueError(
                f"{dim} needs accelerate's ParallelismConfig with tp_size/cp_size and "
                "TrainingArguments(parallelism_config=...) (accelerate >= 1.10, transformers >= 4.57); the installed "
                "versions lack it: upgrade accelerate and transformers, or drop the size"
            )
        if features.fsdp_version != 2 and s.is_fsdp:
            raise ValueError(f"{s.name} with tp/cp needs FSDP2 (accelerate >= 1.10); the installed versions run FSDP1")
    if layout.tp_size > 1 and not s.is_deepspeed:
        _check_tensor_parallel_load(layout, features)
    if layout.sp_size > 1 and not features.sequence_parallel:
        raise ValueError(
            f"sp_size {layout.sp_size} needs ParallelismConfig(sp_backend='deepspeed') with DeepSpeed Ulysses "
            "(accelerate >= 1.12, deepspeed >= 0.18.2); the installed versions lack it: upgrade accelerate and "
            "deepspeed, or drop sp_size"
        )
    if layout.tp_size > 1 and s.is_deepspeed and not features.deepspeed_autotp:
        raise ValueError(
            f"tp_size {layout.tp_size} with {s.name} needs DeepSpeed AutoTP training "
            "('tensor_parallel': {'autotp_size': N}, deepspeed >= 0.16.4); the installed DeepSpeed lacks it: "
            "upgrade deepspeed, or use fsdp_full_shard for FSDP2 x TP"
        )


def _check_tensor_parallel_load(layout, features: LibraryFeatures) -> None:
    """TP with DDP or FSDP2 is applied by transformers as it loads the model
    (:func:`hf_dist.configs.training_args.from_pretrained_kwargs`): with data-parallel ranks it needs the
    ``DistributedConfig`` that names their sizes, and its FSDP2 reshards every decoder layer after its forward."""
    s = layout.strategy
    if layout.dp_size > 1 and not features.tp_distributed_config:
        raise ValueError(
            f"tp_size {layout.tp_size} with {layout.dp_size} data-parallel ranks needs transformers >= 5.23, whose "
            "DistributedConfig(tp_size=..., fsdp_size=...) shards the model over both as it loads; this transformers "
            "spreads the TP plan over every rank. Upgrade transformers, or use tp_size = world size, or zero1/zero2 "
            "(DeepSpeed AutoTP)"
        )
    if s.gathers_params:
        raise ValueError(
            f"tp_size {layout.tp_size} with {s.name}: under FSDP2 x TP transformers applies FSDP2 as it loads the "
            "model and reshards every decoder layer after its forward, so shard-grad-op's gathered parameters are "
            "never kept; use fsdp_full_shard (or hsdp across nodes)"
        )


@functools.cache
def installed_features() -> LibraryFeatures:
    """What the installed transformers / accelerate / torch accept: :func:`probe_features`, kept on disk per set of
    installed versions (:mod:`hf_dist.planning.feature_store`), so a plan need not import them to ask."""
    stored = load_features(LibraryFeatures)
    if stored is not None:
        return stored
    probed = probe_features()
    store_features(probed)
    return probed


def probe_features() -> LibraryFeatures:
    """What the installed transformers / accelerate / torch accept (probed for features, not version numbers)."""
    import dataclasses

    from transformers import TrainingArguments

    fields = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    ac_field = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    return LibraryFeatures(
        fsdp_version=_installed_fsdp_version(),
        # newer transformers 5.x want fsdp=True (strings/lists are deprecated); 5.0 wants the string form
        fsdp_flag_takes_bool=hasattr(TrainingArguments, "_apply_legacy_fsdp_to_config"),
        activation_checkpointing_field=ac_field,
        warmup_ratio_field="warmup_ratio" in fields,
        parallelism_config="parallelism_config" in fields and {"tp_size", "cp_size"} <= _parallelism_fields(),
        sequence_parallel={"sp_size", "sp_backend"} <= _parallelism_fields()
        and _deepspeed_has("runtime/sequence_parallel/ulysses_sp.py"),
        deepspeed_autotp=_deepspeed_has("runtime/tensor_parallel/config.py"),
        fsdp2_checkpoints_children=_fsdp2_ac_wraps_children(),
        fsdp2_embedding_unit=_fsdp2_shards_embedding_alone(),
        tp_distributed_config=_distributed_config_has_tp_plan(),
        default_adamw=str(getattr(TrainingArguments.optim, "value", TrainingArguments.optim)),
    )


def _distributed_config_has_tp_plan() -> bool:
    """Whether the installed transformers' ``DistributedConfig`` takes ``tp_plan`` (its replacement of
    ``from_pretrained(tp_plan=...)``); older ones had a ``DistributedConfig`` without it."""
    import inspect

    try:
        from transformers.distributed import DistributedConfig

        return "tp_plan" in inspect.signature(DistributedConfig).parameters
    except (ImportError, TypeError, ValueError):
        return False


def _fsdp2_ac_wraps_children() -> bool:
    """Whether the installed accelerate's ``fsdp2_apply_ac`` checkpoints each child of a wrapped unit (it tests the
    wrap policy on the parent module: accelerate <= 1.14) instead of the unit itself."""
    import inspect

    try:
        from accelerate.utils.fsdp_utils import fsdp2_apply_ac

        return "auto_wrap_policy_func(parent_module)" in inspect.getsource(fsdp2_apply_ac)
    except (ImportError, OSError, TypeError):
        return False


def _fsdp2_shards_embedding_alone() -> bool:
    """Whether the installed accelerate's ``fsdp2_prepare_model`` gives an untied input embedding a unit of its own
    (resharded after forward) instead of leaving it in the root unit, gathered from forward to backward."""
    import inspect

    try:
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        return "fully_shard(input_embed" in inspect.getsource(fsdp2_prepare_model)
    except (ImportError, OSError, TypeError):
        return False


def _parallelism_fields() -> set[str]:
    """Fields of the installed accelerate's ``ParallelismConfig`` (empty before accelerate 1.10)."""
    import dataclasses

    try:
        from accelerate.parallelism_config import ParallelismConfig
    except ImportError:
        return set()
    return {f.name for f in dataclasses.fields(ParallelismConfig)}


def _deepspeed_has(relative: str) -> bool:
    """Whether the installed DeepSpeed ships ``relative`` (a feature's module), without importing DeepSpeed."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any((Path(loc) / relative).is_file() for loc in spec.submodule_search_locations)


def _installed_fsdp_version() -> int:
    """2 when the installed torch/accelerate/transformers can run FSDP2 through the Trainer, else 1."""
    import dataclasses

    try:
        from accelerate.utils import FullyShardedDataParallelPlugin
        from torch.distributed.fsdp import fully_shard  # noqa: F401  (FSDP2's entry point)
    except ImportError:
        return 1
    plugin_fields = {f.name for f in dataclasses.fields(FullyShardedDataParallelPlugin)}
    return 2 if "fsdp_version" in plugin_fields and _trainer_reads_fsdp_version() else 1


def _trainer_reads_fsdp_version() -> bool:
    """Whether ``TrainingArguments`` forwards ``fsdp_config["version"]`` to accelerate (every transformers 5.x)."""
    import inspect

    from transformers import TrainingArguments

    process = getattr(TrainingArguments, "_process_fsdp_args", None) or TrainingArguments.__post_init__
    try:
        source = inspect.getsource(process)
    except (OSError, TypeError):  # no source on disk (frozen install): every supported transformers forwards it
        return True
    return '"version"' in source or "'version'" in source
